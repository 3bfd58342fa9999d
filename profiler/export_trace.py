"""Trace a model torch.fx cannot follow (Hugging Face transformers) with torch.export.

`torch.export.export` runs the model on fake tensors and records ATen ops, each with
`node.meta["nn_module_stack"]`, the modules it was called from. The ops are grouped into
the same `ModelGraph` that `profiler.trace` makes: all ops called from inside a *unit*
module (a torch.nn leaf such as Linear or LayerNorm, or a type the strategy registry
knows, such as GPT-2's Conv1D or an attention block) become one layer named by the
module's path; every other op (a residual add, a view, the mask's arithmetic) is a layer
of its own. FLOPs are counted per op on meta tensors by running the exported graph.

The executor runs the *original* module for such a graph (executor.modules), applying each
layer's strategy by module path, so the layers that carry decisions are modules.
"""

from __future__ import annotations

import inspect
from dataclasses import replace
from collections.abc import Callable, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree
from torch.utils.flop_counter import FlopCounterMode

from profiler.blocks import decoder_blocks
from profiler.expert_flops import register as register_grouped_mm_flops
from profiler.export_program import export_program
from profiler.graph import Layer, ModelGraph, TensorMeta, canonical_names, count_once
from profiler.meta_attention import run_node as as_a_device_runs
from profiler.row_factors import in_order, row_factors
from profiler.saved import first_layer, per_output, run_recorded, with_saved
from profiler.trace import TraceError, _module_attrs, call_facts, fingerprint_modules
from profiler.traffic import COUNTED, layer_traffic, traffic, with_float16


def experts_count(module: nn.Module) -> int | None:
    """How many experts `module` holds, where it is the experts of a mixture-of-experts
    block as transformers 5.x writes every family (`...Experts`): weights of its own
    stacked per expert (experts x out x in; biases experts x out) and no child with
    weights. None for any other module. Read off the shape, not a list of class names,
    so that a family added later (or a user's own block) is found alike."""
    own = list(module.parameters(recurse=False))
    if not own or any(True for c in module.children() for _ in c.parameters()):
        return None
    leading = {p.shape[0] if p.dim() else 0 for p in own}
    if len(leading) != 1 or not any(p.dim() == 3 for p in own) or any(p.dim() < 2 for p in own):
        return None
    count = leading.pop()
    return count if count >= 2 else None


def routes_tokens(module: nn.Module) -> bool:
    """Is `module` an experts module called with the tokens, their top-k expert indices
    and those experts' weights (`forward(hidden_states, top_k_index, top_k_weights)`:
    Mixtral, Qwen2/3-MoE, DeepSeek-V3, gpt-oss)? Each token's output is then its own
    experts' outputs, weighted: the module keeps rows as a whole, and its experts may be
    split over ranks (strategies.experts). Llama 4's takes every token once per expert,
    already weighted, as one tensor (dense routing): its rows are tiled by expert, and
    the unit that keeps rows is the block around it (`experts_units`)."""
    if experts_count(module) is None:
        return False
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return False
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return len(positional) >= 3 or any(p.kind == p.VAR_POSITIONAL for p in params)


def experts_units(model: nn.Module) -> tuple[tuple[type, ...], tuple[type, ...]]:
    """(routed experts types, block types around dense-routed experts) in `model`: each
    traced as one layer, since the ops inside sort and regroup tokens across rows."""
    routed, blocks = set(), set()
    for module in model.modules():
        for child in module.children():
            if experts_count(child) is None:
                continue
            if routes_tokens(child):
                routed.add(type(child))
            else:
                blocks.add(type(module))
    return tuple(routed), tuple(blocks)


def _is_torch_leaf(module: nn.Module) -> bool:
    return (module.__module__.startswith("torch.nn")
            and not isinstance(module, (nn.Sequential, nn.ModuleList, nn.ModuleDict)))


def export(model: nn.Module, args: tuple, kwargs: dict) -> torch.export.ExportedProgram:
    """torch.export, with a message naming the op or frame where it stopped."""
    try:
        return export_program(model, args, kwargs)
    except Exception as error:
        lines = [l.strip() for l in str(error).splitlines() if l.strip()]
        where = next((l for l in reversed(lines) if l.startswith("File ") or ".py" in l), "")
        raise TraceError(
            f"cannot trace {type(model).__name__} with torch.export: {type(error).__name__}: "
            f"{lines[0] if lines else ''}{f' (at {where})' if where else ''}. Fix: pass the "
            f"keyword arguments a training forward takes (e.g. example_kwargs={{'use_cache': "
            f"False}}), or move data-dependent Python out of forward"
        ) from error


def _unit_path(node: fx.Node, modules: dict, is_unit: Callable[[nn.Module], bool]) -> str | None:
    """The outermost unit module an op was called from (None: called from no unit)."""
    for path, _ in (node.meta.get("nn_module_stack") or {}).values():
        module = modules.get(path)
        if module is not None and path and is_unit(module):
            return path
    return None


def _call_counts(graph: fx.Graph, modules: dict, is_unit) -> dict[str, int]:
    """{unit module path: how many separate calls the graph makes of it}."""
    counts: dict[str, int] = {}
    last = None
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        path = _unit_path(node, modules, is_unit)
        if path is not None and path != last:
            counts[path] = counts.get(path, 0) + 1
        last = path
    return counts


def _kind(node: fx.Node) -> str:
    target = node.target
    return getattr(target, "_opname", None) or getattr(target, "__name__", str(target))


def export_trace(model: nn.Module, example_inputs: Sequence, example_kwargs: dict | None = None,
                 unit_types: tuple[type, ...] = ()) -> ModelGraph:
    """Trace `model` with torch.export into a ModelGraph (see the module docstring).
    `unit_types`: module classes kept whole as one layer, besides torch.nn's own leaves."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    _batch(args)
    return graph_of_program(model, export(model, args, kwargs), args, kwargs, unit_types)


def _batch(args: tuple) -> int:
    tensors = [x for x in args if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("example_inputs: pass at least one tensor whose dim 0 is the batch")
    return tensors[0].shape[0]


def group_ops(program: torch.export.ExportedProgram, model: nn.Module,
              unit_types: tuple[type, ...] = ()) -> tuple[dict, dict, list]:
    """(fx node name -> layer key, layer key -> its nodes, layer keys in order): the ops of
    an exported graph grouped into layers as the module docstring says. Shared by the
    tracer and by profiler.export_timing, which groups a re-export at another batch the
    same way."""
    graph = program.graph_module.graph
    modules = dict(model.named_modules())

    def is_unit(m: nn.Module) -> bool:
        return isinstance(m, unit_types) or _is_torch_leaf(m)

    # A parameter-free module called more than once (one Dropout after attention and
    # after the MLP) gets no layer of its own: its calls meet tensors in different layouts,
    # which one module's hooks cannot serve, so its ops are layers like any other op. (A
    # module with parameters called again, ALBERT's shared layer, stays a unit: its calls
    # share the parameters and so one strategy, planner.ties.)
    reused = {path for path, n in _call_counts(graph, modules, is_unit).items()
              if n > 1 and not any(True for _ in modules[path].parameters())}
    single_use = is_unit

    def is_unit(m: nn.Module) -> bool:  # noqa: F811 - narrowed by the counts above
        return single_use(m) and not any(modules.get(p) is m for p in reused)

    user_inputs = set(program.graph_signature.user_inputs)
    group: dict[str, str] = {}  # fx node name -> layer key
    members: dict[str, list[fx.Node]] = {}
    order: list[str] = []
    last_path = None
    calls: dict[str, int] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            if node.name in user_inputs and isinstance(node.meta.get("val"), torch.Tensor):
                group[node.name] = node.name
                members[node.name] = [node]
                order.append(node.name)
            continue
        if node.op != "call_function":
            continue
        path = _unit_path(node, modules, is_unit)
        if path is None:
            key, last_path = node.name, None
        else:
            if path != last_path:
                calls[path] = calls.get(path, 0) + 1
            key = path if calls[path] == 1 else f"{path}#{calls[path]}"
            last_path = path
        if key not in members:
            members[key] = []
            order.append(key)
        members[key].append(node)
        group[node.name] = key
    return group, members, order


def graph_of_program(model: nn.Module, program: torch.export.ExportedProgram, args: tuple,
                     kwargs: dict, unit_types: tuple[type, ...] = ()) -> ModelGraph:
    """The ModelGraph of `model` as exported in `program` on (`args`, `kwargs`): layers,
    their FLOPs on fake tensors, parameters counted once (export_trace's second half,
    apart so that profiler.repeat_blocks can read the program's node names too)."""
    batch = _batch(args)
    graph = program.graph_module.graph
    group, members, order = group_ops(program, model, unit_types)
    layers, node_of, scopes = _program_layers(model, program, args, kwargs, batch,
                                              members, order)
    resolve = _resolver(group, node_of)
    by_name = {n.name: n for n in graph.nodes}
    fixed = []
    for layer in layers:
        inputs = []
        for src_name in layer.inputs:
            src = by_name[src_name]
            inputs.extend(r for r in resolve(src) if r != layer.node)
        fixed.append(replace(layer, inputs=tuple(dict.fromkeys(inputs))))
    layers = _mark_between_modules(_dense_blocks_in_order(in_order(fixed, batch), fixed, model))

    output_node = next(n for n in graph.nodes if n.op == "output")
    outputs = []
    for n in pytree.tree_leaves(output_node.args):
        if isinstance(n, fx.Node) and n.name in (program.graph_signature.user_outputs or ()):
            outputs.extend(resolve(n))
    flops = _count_flops(program, args, kwargs, group, node_of)
    layers = [_with_flops(l, flops.get(l.node, 0)) for l in count_once(layers, model)]
    ratios = _saved_per_output(program, args, kwargs, group, node_of, layers)
    layers = with_saved(layers, ratios)
    blocks, why = decoder_blocks(model)
    return ModelGraph(type(model).__name__, tuple(layers), tuple(dict.fromkeys(outputs)), batch,
                      fingerprint_modules(model), module=None, example_kwargs=kwargs,
                      tracer="export", blocks=blocks, scopes=scopes, no_blocks_why=why,
                      units=tuple(unit_types))


def _program_layers(model: nn.Module, program: torch.export.ExportedProgram, args: tuple,
                    kwargs: dict, batch: int, members: dict,
                    order: list) -> tuple[list[Layer], dict[str, str], dict[str, str]]:
    """(a Layer per group of ops, in `order`, its inputs still the fx nodes it reads; the
    fx node that carries each layer key's output; the innermost module that ran each
    layer's node)."""
    modules = dict(model.named_modules())
    user_inputs = set(program.graph_signature.user_inputs)
    factors = row_factors(model, args, kwargs, batch, program)
    # what each op's memory-bound kernels move under each precision (GPU pricing reads it)
    moved = {p: traffic(program, p, batch) for p in COUNTED}

    def value(n: fx.Node):
        return n.meta.get("val")

    names = canonical_names(model)
    # parameter placeholders -> the model's own name for that parameter (one per tensor)
    read = {ph: names[id(model.get_parameter(fqn))]
            for ph, fqn in program.graph_signature.inputs_to_parameters.items()
            if id(model.get_parameter(fqn)) in names}
    layers: list[Layer] = []
    node_of: dict[str, str] = {}  # layer key -> the fx node that carries its output
    scopes: dict[str, str] = {}  # layer node -> the innermost module that ran it
    for key in order:
        nodes = members[key]
        inside = {n.name for n in nodes}
        outs = [n for n in nodes if isinstance(value(n), torch.Tensor)
                and (any(u.name not in inside for u in n.users) or n is nodes[-1])]
        if not outs:
            continue
        out = max(outs, key=lambda n: value(n).numel()) if len(outs) > 1 else outs[0]
        node_of[key] = out.name
        stack = list((out.meta.get("nn_module_stack") or {}).values())
        path = key.split("#")[0]
        scopes[out.name] = (path if path in modules and nodes[0].op != "placeholder"
                            else stack[-1][0] if stack else "")
        srcs = [src for n in nodes for src in n.all_input_nodes
                if src.name not in inside and not (src.op == "placeholder" and src.name not in user_inputs)]
        layer = _export_layer(key, nodes, out, srcs, modules, factors)
        per_precision = with_float16({p: layer_traffic(m, nodes).as_attr()
                                      for p, m in moved.items()})
        layer = replace(layer, attrs={**layer.attrs, "traffic": per_precision})
        layers.append(replace(layer, params=_params_read(key, nodes, modules, read, names)))
    return layers, node_of, scopes


def _resolver(group: dict[str, str], node_of: dict[str, str]):
    """A function from an fx node to the layer nodes whose outputs it carries: a
    tuple-valued op (split) is no layer, so its items' readers read what it read."""
    produced = {node_of[k]: k for k in node_of}

    def resolve(src: fx.Node, seen=()) -> list[str]:
        if src.name in produced:
            return [node_of[produced[src.name]]]
        key = group.get(src.name)
        if key in node_of:  # an inner node of a layer (another of its outputs)
            return [node_of[key]]
        return [r for s in src.all_input_nodes if s.name not in seen
                for r in resolve(s, seen + (src.name,))]

    return resolve


def _dense_blocks_in_order(ordered: list[Layer], traced: list[Layer],
                           model: nn.Module) -> list[Layer]:
    """`ordered` (profiler.row_factors.in_order) with the traced row factor given back to
    blocks around dense-routed experts (Llama 4's MoE): such a block flattens its (batch,
    tokens) input row-major, each token on its own, so its output holds each row's tokens
    together, which in_order, seeing a module and not the reshape inside, cannot tell."""
    _, blocks = experts_units(model)
    if not blocks:
        return ordered
    factor = {l.node: l.output.row_factor for l in traced
              if l.module_type is not None and issubclass(l.module_type, blocks)}
    return [replace(l, output=replace(l.output, row_factor=factor[l.node]))
            if l.node in factor else l for l in ordered]


def _mark_between_modules(layers: list[Layer]) -> list[Layer]:
    """attrs["between_modules"] on an op outside modules whose inputs are module outputs
    it alone reads, and whose readers are all modules (Llama's `act(gate) * up` between
    its Linears): the module executor may hand it each rank's feature shard of its
    inputs and give its readers its own, with no code outside modules in between
    (planner.offers.module_executor_options)."""
    op = {l.node: l.op for l in layers}
    readers: dict[str, list[str]] = {}
    for layer in layers:
        for src in layer.inputs:
            readers.setdefault(src, []).append(layer.node)
    out = []
    for layer in layers:
        if (layer.op == "call_function" and layer.inputs and readers.get(layer.node)
                and all(op[s] == "call_module" and readers[s] == [layer.node]
                        for s in layer.inputs)
                and all(op[r] == "call_module" for r in readers[layer.node])):
            layer = replace(layer, attrs={**layer.attrs, "between_modules": True})
        out.append(layer)
    return out


def _export_layer(key: str, nodes: list[fx.Node], out: fx.Node, srcs: list[fx.Node],
                  modules: dict, factors: dict[str, int]) -> Layer:
    """`factors`: profiler.row_factors of the program's nodes (how dim 0 holds the batch)."""
    output = TensorMeta.of(out.meta["val"], factors.get(out.name))
    inputs = tuple(dict.fromkeys(s.name for s in srcs))
    path = key.split("#")[0]
    if path in modules and nodes[0].op != "placeholder":
        module = modules[path]
        attrs = _module_attrs(module)
        if routes_tokens(module):
            attrs.update(_routing_facts(module, srcs))
        return Layer(name=key, node=out.name, op="call_module", kind=type(module).__name__,
                     inputs=inputs, output=output, module_type=type(module), attrs=attrs)
    if nodes[0].op == "placeholder":
        return Layer(name=key, node=out.name, op="placeholder", kind="input", inputs=(),
                     output=output)
    tensors = [s for s in out.all_input_nodes if isinstance(s.meta.get("val"), torch.Tensor)]
    shapes = tuple(tuple(s.meta["val"].shape) for s in tensors)
    attrs = call_facts(out, shapes[0] if shapes else None)
    attrs["in_shapes"] = shapes
    if factors:  # strategies.rowwise reads where the rows came from
        attrs["in_row_factors"] = tuple(factors.get(s.name) for s in tensors)
    return Layer(name=key, node=out.name, op="call_function", kind=_kind(out), inputs=inputs,
                 output=output, attrs=attrs)


def _routing_facts(module: nn.Module, srcs: list[fx.Node]) -> dict:
    """What expert parallelism is priced from: the experts, and the tokens and experts per
    token of the call (the integer top-k index it is handed, tokens x k)."""
    facts = {"experts": experts_count(module)}
    for src in srcs:
        value = src.meta.get("val")
        if (isinstance(value, torch.Tensor) and value.dim() == 2
                and not value.dtype.is_floating_point):
            facts["tokens"], facts["top_k"] = int(value.shape[0]), int(value.shape[1])
            break
    return facts


def _params_read(key: str, nodes: list[fx.Node], modules: dict, read: dict[str, str],
                 names: dict[int, str]) -> tuple[str, ...]:
    """The parameters a layer reads: a unit module's own, and the parameter placeholders
    its ops read (bare parameters such as a cls_token, or a tied weight)."""
    path = key.split("#")[0]
    own = modules[path].parameters() if path in modules and path else ()
    found = [names[id(p)] for p in own if id(p) in names]
    found += [read[src.name] for n in nodes for src in n.all_input_nodes if src.name in read]
    return tuple(dict.fromkeys(found))


def _with_flops(layer: Layer, fwd: int) -> Layer:
    # backward of a matmul costs two (input and weight gradients), of other ops about one
    bwd = 2 * fwd if layer.params else fwd
    return replace(layer, fwd_flops=fwd, bwd_flops=bwd)


def _fake_feeds(program, args, kwargs, mode: FakeTensorMode, grads: bool = False) -> list:
    """The exported graph's inputs as fake tensors: its parameters, buffers and constants
    from the program, the user's from (`args`, `kwargs`); with `grads`, parameters that
    train require grad."""
    sig = program.graph_signature
    state = {**program.state_dict, **program.constants}
    user = iter(pytree.tree_leaves((args, kwargs)))
    feeds = []
    for spec in sig.input_specs:
        value = next(user) if spec.kind.name == "USER_INPUT" else state[spec.target]
        fake = mode.from_tensor(value) if isinstance(value, torch.Tensor) else value
        if (grads and spec.kind.name == "PARAMETER" and value.requires_grad
                and not fake.requires_grad):
            fake.requires_grad_(True)
        feeds.append(fake)
    return feeds


def _saved_per_output(program, args, kwargs, group: dict, node_of: dict,
                      layers: list[Layer]) -> dict[str, float]:
    """{layer node: bytes autograd keeps for backward that the layer produced, per byte of
    its output} (profiler.saved), the exported graph run once on fake tensors with its
    parameters requiring grad, attention on meta as a device's kernel saves
    (profiler.meta_attention); {} where it cannot run so."""
    user_inputs = set(program.graph_signature.user_inputs)

    def layer_of(n: fx.Node) -> str | None:
        return node_of.get(group.get(n.name))

    def owner(n: fx.Node) -> str | None:
        if n.op == "placeholder" and n.name not in user_inputs:
            return None  # a parameter, buffer or constant
        return first_layer(n, layer_of)

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    try:
        feeds = _fake_feeds(program, args, kwargs, mode, grads=True)
        with mode:
            saved = run_recorded(program.graph_module, feeds, owner, run=as_a_device_runs)
    except Exception:  # noqa: BLE001 - the layers then keep their outputs
        return {}
    return per_output(saved, layers)


def _count_flops(program, args, kwargs, group: dict, node_of: dict) -> dict[str, int]:
    """{output node of each layer: forward FLOPs}, running the exported graph on fake
    tensors. Fake tensors keep each tensor's device as metadata, so a graph that moves a
    buffer with `.to(device)` (a rotary `inv_freq`, inside a higher-order op's subgraph
    too) runs whether the model was built on the CPU, on meta or under torch.device(...),
    and nothing is allocated."""
    register_grouped_mm_flops()  # routed experts' grouped matmuls (profiler.expert_flops)
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    feeds = _fake_feeds(program, args, kwargs, mode)
    per_layer: dict[str, int] = {}
    counter = FlopCounterMode(display=False)

    class Counting(fx.Interpreter):
        def run_node(self, n):
            before = counter.get_total_flops()
            result = super().run_node(n)
            key = group.get(n.name)
            if key in node_of:
                per_layer[node_of[key]] = per_layer.get(node_of[key], 0) + (
                    counter.get_total_flops() - before)
            return result

    with mode, counter, torch.no_grad():
        Counting(program.graph_module).run(*feeds)
    return per_layer
