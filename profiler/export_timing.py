"""Per-layer times of a torch.export graph on this machine's CPU: what profiler.profile does
for a torch.fx graph, for the models fx cannot follow (Hugging Face transformers).

The model is exported again at the rows one data-parallel rank runs (an exported graph
bakes its batch into its views), its ops grouped into the very layers of the planning
graph (profiler.export_trace.group_ops, keyed by module path or op name), and the graph
run once for real to have every op's input. Each layer's ops are then run on their own,
inputs detached, forward and backward, as the fx path times one node: a unit module's
ops (a Linear, an attention block) together, and each loose op (a residual add, the mask's
arithmetic) by itself, so that their per-op cost, which no FLOP count shows, is priced.
"""

from __future__ import annotations

import warnings

import torch
import torch.fx as fx
from torch import nn
from torch.utils import _pytree as pytree

from profiler.export_trace import export, group_ops
from profiler.graph import ModelGraph

# (a layer's ops, their inputs' shapes, which need grads, threads) -> seconds fwd + bwd
_TIMES: dict[tuple, float] = {}


def measure_export_times(graph: ModelGraph, model: nn.Module, example_inputs, batch: int,
                         timer) -> dict[str, float]:
    """{layer name: seconds of forward + backward at `batch` rows} for the layers of the
    export graph `graph` of `model`; {} (FLOP rates then price them) when the weights are
    on the meta device or the model does not run at that batch. `timer(fn)` times
    one call (profiler.profile.timed)."""
    if any(p.is_meta for p in model.parameters()):
        return {}
    args = _rows(tuple(example_inputs), graph.batch_size, batch)
    kwargs = _rows(dict(graph.example_kwargs), graph.batch_size, batch)
    try:
        program = export(model, args, kwargs)
        _, members, order = group_ops(program, model, graph.units)
        values = _run(program, model, args, kwargs)
    except Exception as error:  # e.g. a batch of 1 the model specializes on
        warnings.warn(f"hyplan: could not time the exported layers at batch {batch} "
                      f"({error}); using FLOP rates instead", stacklevel=3)
        return {}
    runner = fx.Interpreter(program.graph_module)
    params = {node.name for node in program.graph_module.graph.nodes
              if node.name in program.graph_signature.inputs_to_parameters}
    wanted = {layer.name: layer for layer in graph.layers if not layer.is_input}
    times: dict[str, float] = {}
    for key in order:
        if key not in wanted or members[key][0].op == "placeholder":
            continue
        nodes = members[key]
        out = _output(nodes, wanted[key].node, values)
        if out is None:
            continue
        inputs = list(dict.fromkeys(src for n in nodes for src in n.all_input_nodes
                                    if src not in nodes))
        cache = (_ops_key(nodes, inputs, values), torch.get_num_threads())
        if cache not in _TIMES:
            _TIMES[cache] = timer(
                lambda: _forward_backward(runner, nodes, inputs, out, values, params))
        times[key] = _TIMES[cache]
    return times


def _rows(value, batch: int, rows: int):
    """`value` with every tensor whose dim 0 is the batch cut to its first `rows` rows."""
    def cut(x):
        if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch:
            return x[:rows]
        return x
    return pytree.tree_map(cut, value)


def _run(program, model: nn.Module, args: tuple, kwargs: dict) -> dict[fx.Node, object]:
    """Every node's value in one real run of the exported graph, the model's own
    parameters as its weights (so activations carry requires_grad as in training)."""
    sig = program.graph_signature
    state = {**program.state_dict, **program.constants}
    user = iter(pytree.tree_leaves((args, kwargs)))
    feeds = []
    for spec in sig.input_specs:
        if spec.kind.name == "USER_INPUT":
            feeds.append(next(user))
        elif spec.kind.name == "PARAMETER":
            feeds.append(model.get_parameter(spec.target))
        else:
            feeds.append(state[spec.target])
    runner = fx.Interpreter(program.graph_module, garbage_collect_values=False)
    runner.run(*feeds)
    return dict(runner.env)


def _output(nodes: list[fx.Node], name: str, values: dict) -> fx.Node | None:
    """The node carrying the layer's output: the one the planning graph named, else the
    largest tensor the layer hands on."""
    found = [n for n in nodes if n.name == name and isinstance(values.get(n), torch.Tensor)]
    if found:
        return found[0]
    outs = [n for n in nodes if isinstance(values.get(n), torch.Tensor)
            and any(u not in nodes for u in n.users)]
    return max(outs, key=lambda n: values[n].numel()) if outs else None


def _ops_key(nodes: list[fx.Node], inputs: list[fx.Node], values: dict) -> tuple:
    """What decides the layer's time: its ops and arguments, its inputs' shapes and which
    of them need gradients. Repeated blocks share it, and so are timed once."""
    def shape(v):
        if isinstance(v, torch.Tensor):
            return (tuple(v.shape), str(v.dtype), v.requires_grad)
        return repr(v) if not isinstance(v, nn.Module) else type(v).__name__

    where = {n: ("op", i) for i, n in enumerate(nodes)}
    where.update({n: ("in", i) for i, n in enumerate(inputs)})
    ops = tuple((str(n.target), repr(fx.node.map_arg((n.args, n.kwargs), where.get)))
                for n in nodes)
    return ops, tuple(shape(values.get(n)) for n in inputs)


def _forward_backward(runner: fx.Interpreter, nodes: list[fx.Node], inputs: list[fx.Node],
                      out: fx.Node, values: dict, params: set[str]) -> None:
    """The layer's ops on their own: fresh leaves for the inputs that carry gradients
    (activations copied, so an in-place op stays legal; weights as they are), forward,
    then the gradient of every such leaf, as a training step computes it."""
    env, leaves = {}, []
    for src in inputs:
        value = values.get(src)
        if isinstance(value, torch.Tensor):
            grad = value.requires_grad and value.is_floating_point()
            value = value.detach()
            if grad:
                leaf = value.requires_grad_(True)
                leaves.append(leaf)
                value = leaf if src.name in params else leaf.clone()
        env[src] = value
    runner.env = env
    for node in nodes:
        env[node] = runner.run_node(node)
    y = env[out]
    if isinstance(y, torch.Tensor) and y.grad_fn is not None and leaves:
        torch.autograd.grad(y, leaves, torch.ones_like(y), allow_unused=True)
