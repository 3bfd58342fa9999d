"""Per-layer costs: FLOPs forward and backward (torch.utils.flop_counter), and, when the plan
targets this machine, the measured time of each layer's forward plus backward.

Each layer is run on its own, its inputs detached, so the counts and times belong to that
layer alone. FLOPs are counted on meta tensors: nothing is allocated. Times are medians
(a best-of-N is optimistic next to a training loop's typical step), cached by shape, and
Linear / Conv2d layers are also timed at the shapes their model-parallel shards have:
a half-width matmul is not half the time of a full one on a CPU, so scaling one linearly
misprices model parallelism.
"""

from __future__ import annotations

import statistics
import time
import warnings
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from profiler.graph import Layer, ModelGraph
from profiler.allocator import keep_freed_memory
from profiler import export_timing
from profiler.export_timing import measure_export_times
from profiler.whole_step import (
    buffers_kept, cached_whole_step_s, forward_share, glue_factor, split_backward_ratio,
)
from profiler.machine import threads as thread_count
from profiler.rounds import medians_in_rounds
from profiler.trace import materialize, meta_params, run_node, to_meta, weights_device
from profiler.traffic import (
    COUNTED, LOW_DTYPES, OPAQUE, Recorder, Seen, accumulation, constant, op_name, replay,
    with_float16,
)

# (what ran, at which shapes, with how many threads) -> seconds of forward + backward
_TIMES: dict[tuple, float] = {}


def forget_layer_times() -> None:
    """Empty this process's caches of measured layer times (this module's, and the
    torch.export path's in profiler.export_timing): the next planning times every layer
    again, as a new process would. The layer times of a shape are otherwise measured once
    per process (benchmarks/fidelity.py replans with them emptied)."""
    _TIMES.clear()
    export_timing._TIMES.clear()


def profile(graph: ModelGraph, measure: bool = False, measure_batch: int | None = None,
            threads: int | None = None, ranks: int = 1, model: nn.Module | None = None,
            example_inputs=None) -> ModelGraph:
    """Add FLOPs to every layer and, with `measure`, time each layer on this machine's CPU
    at `measure_batch` rows (default: the graph's batch) with `threads` intra-op threads,
    and Linear / Conv2d layers also at the shapes a `ranks`-way split gives them. A graph
    from torch.export already carries its FLOPs; its layers are timed from `model` and
    `example_inputs` (profiler.export_timing), and left untimed without them. Given the
    model, every time is scaled by its whole step's glue (profiler.whole_step)."""
    if graph.tracer == "export":
        if not measure or model is None or example_inputs is None:
            return graph
        flops = {layer.node: (layer.fwd_flops, layer.bwd_flops) for layer in graph.layers}
        moved = {}
    else:
        flops, moved = count_flops_and_traffic(graph)
    times: dict[str, float] = {}
    shards: dict[str, dict[str, float]] = {}
    split, share = 1.0, 1 / 3
    batch = measure_batch or graph.batch_size
    if measure:
        keep_freed_memory()  # as the ranks run (profiler.allocator)
        with thread_count(threads), buffers_kept(graph.module, model):
            if graph.tracer == "export":
                by_name = measure_export_times(graph, model, example_inputs, batch, timed)
                times = {layer.node: by_name[layer.name] for layer in graph.layers
                         if layer.name in by_name}
                if times:
                    times.update({l.node: 0.0 for l in graph.layers if l.is_input})
                    shards = measure_shards(graph, ranks, batch, dict(model.named_modules()))
            else:
                times = measure_times(graph, batch)
                if times:
                    shards = measure_shards(graph, ranks, batch)
            shards = in_the_layers_window(times, shards)
            if times and model is not None and example_inputs is not None:
                glue = glue_factor(cached_whole_step_s(model, example_inputs,
                                                       graph.example_kwargs, graph.batch_size,
                                                       batch, _timed_step),
                                   sum(times.values()))
                times = {node: t * glue for node, t in times.items()}
                shards = {node: {k: t * glue for k, t in by.items()}
                          for node, by in shards.items()}
                if ranks > 1:  # a pipeline may run it: its schedules' timelines
                    split = split_backward_ratio(model, example_inputs, graph.example_kwargs,
                                                 graph.batch_size, batch, layer_clock())
                    share = forward_share(model, example_inputs, graph.example_kwargs,
                                          graph.batch_size, batch, layer_clock())
    layers = tuple(
        replace(layer, fwd_flops=flops[layer.node][0], bwd_flops=flops[layer.node][1],
                attrs={**layer.attrs, "traffic": moved[layer.node]}
                if layer.node in moved else layer.attrs,
                measured_s=times.get(layer.node),
                measured_batch=batch if layer.node in times else None,
                measured_shards=shards.get(layer.node, {}),
                measured_parts=ranks if layer.node in shards else None,
                shards_batch=graph.batch_size if layer.node in shards else None)
        for layer in graph.layers
    )
    return replace(graph, layers=layers, split_backward=split, forward_share=share)


def _inputs_for(node: fx.Node, values: dict, needs_grad: dict) -> tuple[dict, list]:
    """The node's input values cut from the graph before it: leaves requiring grad where the
    real run would, handed to the node as a copy so that in-place ops stay legal."""
    local, leaves = {}, []
    for src in node.all_input_nodes:
        value = values.get(src.name)
        if isinstance(value, torch.Tensor):
            value = value.detach()
            if needs_grad.get(src.name) and value.is_floating_point():
                leaf = value.requires_grad_(True)
                leaves.append(leaf)
                value = leaf.clone()
        local[src.name] = value
    return local, leaves


def _grad_targets(leaves: list, params: dict) -> list[torch.Tensor]:
    return leaves + [p for p in params.values() if p.requires_grad]


def _placeholder_value(layer: Layer | None, graph: ModelGraph, node: fx.Node, device, batch):
    if layer is None:
        return graph.example_kwargs.get(node.target)
    shape = list(layer.output.shape)
    if shape and shape[0] == graph.batch_size:
        shape[0] = batch
    dtype = getattr(torch, layer.output.dtype)
    if dtype.is_floating_point:
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.zeros(shape, dtype=dtype, device=device)


def _node_flops(node, values, needs_grad, modules, gm, meta: bool):
    """(forward FLOPs, backward FLOPs, output, what it ran) of one node run on its own;
    what it ran (profiler.traffic.Recorder's ATen ops, the tensors handed to it in input
    order, its parameters) prices its memory traffic under each precision."""
    local, leaves = _inputs_for(node, values, needs_grad)
    module = modules[node.target] if node.op == "call_module" else None
    if module is None:
        params = {}
    elif meta:
        params = meta_params(module)
    else:
        params = dict(module.named_parameters())
    with FlopCounterMode(display=False) as counter, Recorder() as recorder:
        out = run_node(node, local, modules, gm, params if meta and module is not None else None)
    fwd = counter.get_total_flops()
    handed = [local.get(n.name) for n in node.all_input_nodes]
    ops = recorder.ops
    if node.op == "call_function" and op_name(node.target) in OPAQUE:
        # one fused kernel on a GPU; on meta tensors it ran as its math decomposition
        ops = [(op_name(node.target), False, None, [out],
                [t for t in handed if isinstance(t, torch.Tensor)])]
    ran = (ops, handed, params, out)
    targets = _grad_targets(leaves, params)
    bwd = 0
    if isinstance(out, torch.Tensor) and out.requires_grad and targets:
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(out, targets, torch.empty_like(out), allow_unused=True)
        bwd = counter.get_total_flops()
    return fwd, bwd, out, ran


def _traffic(node, ran, upstream: dict, batch: int) -> tuple[dict, dict]:
    """({precision: traffic attr}, {precision: record of the output}) of one node, its ATen
    ops replayed with what is known of its inputs (`upstream`: {precision: {node name:
    Seen, or a list of them for a tuple}})."""
    ops, handed, params, out = ran
    attrs, records = {}, {}
    for precision in COUNTED:
        known: dict[int, Seen] = {}
        for src, value in zip(node.all_input_nodes, handed):
            record = upstream[precision].get(src.name)
            if isinstance(value, torch.Tensor) and isinstance(record, Seen):
                known[id(value)] = record
            elif isinstance(value, (tuple, list)) and isinstance(record, list):
                known.update({id(v): r for v, r in zip(value, record)
                              if isinstance(v, torch.Tensor)})
        for p in params.values():
            known[id(p)] = Seen(p, p.dtype, p.requires_grad, False)
        attrs[precision] = replay(ops, known, LOW_DTYPES.get(precision), batch).as_attr()
        if isinstance(out, torch.Tensor):
            records[precision] = known.get(id(out)) or constant(out, batch)
        elif isinstance(out, (tuple, list)):
            records[precision] = [known.get(id(o)) or constant(o, batch)
                                  for o in out if isinstance(o, torch.Tensor)]
    return attrs, records


def count_flops(graph: ModelGraph) -> dict[str, tuple[int, int]]:
    """{fx node name: (forward FLOPs, backward FLOPs)} for every layer, on meta tensors."""
    return count_flops_and_traffic(graph)[0]


def count_flops_and_traffic(graph: ModelGraph) -> tuple[dict, dict]:
    """({fx node name: (forward FLOPs, backward FLOPs)}, {fx node name: {precision: traffic
    attr (profiler.traffic)}}) for every layer, on meta tensors."""
    gm = graph.module
    modules = dict(gm.named_modules())
    values: dict[str, object] = {}
    needs_grad: dict[str, bool] = {}
    result: dict[str, tuple[int, int]] = {}
    # node key (what times a node, _node_key: op, module configuration, input shapes) ->
    # (fwd, bwd, output, needs grad): a transformer's repeated blocks are counted once
    # (a 48-block GPT: 390 nodes run under the FLOP counter, 3.5 s, where 10 differ)
    counted: dict[tuple, tuple] = {}
    batch = graph.batch_size
    moved: dict[str, dict] = {}
    records: dict[str, dict] = {p: {} for p in COUNTED}
    read: set[str] = set()  # nodes whose output some node has read already
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        layer = graph._by_node.get(node.name)
        if node.op in ("placeholder", "get_attr"):
            _input_value(node, layer, graph, gm, modules, values, needs_grad, records, batch)
            if layer is not None:
                result[node.name] = (0, 0)
            continue
        key = _node_key(node, modules, values, needs_grad)
        if key in counted:
            fwd, bwd, value, grad, ran = counted[key]
        else:
            fwd, bwd, value, grad, ran = _count_node(node, values, needs_grad, modules, gm)
            if key is not None:
                counted[key] = (fwd, bwd, value, grad, ran)
        needs_grad[node.name] = grad
        values[node.name] = value
        attrs, outs = _traffic(node, ran, records, batch)
        _record_outputs(node, attrs, outs, records, read)
        read.update(src.name for src in node.all_input_nodes)
        if layer is not None:
            result[node.name] = (fwd, bwd)
            moved[node.name] = with_float16(attrs)
    return result, moved


def _input_value(node, layer, graph: ModelGraph, gm, modules: dict, values: dict,
                 needs_grad: dict, records: dict, batch: int) -> None:
    """A placeholder's or get_attr's value, gradient flag and traffic record, as meta
    tensors."""
    if node.op == "placeholder":
        values[node.name] = _placeholder_value(layer, graph, node, "meta", batch)
        needs_grad[node.name] = False
        if isinstance(values[node.name], torch.Tensor):
            for p in COUNTED:
                records[p][node.name] = constant(values[node.name], batch)
        return
    # a bare parameter or buffer: counted as a meta tensor, as everything else here is (a
    # GPU model's weight met by a meta input fails in backward: "expected device cuda:0
    # but got meta")
    attr = run_node(node, values, modules, gm)
    values[node.name] = to_meta(attr)
    needs_grad[node.name] = isinstance(attr, torch.Tensor) and attr.requires_grad
    if isinstance(attr, torch.Tensor):
        for p in COUNTED:
            records[p][node.name] = Seen(values[node.name], attr.dtype,
                                         needs_grad[node.name], False)


def _count_node(node, values: dict, needs_grad: dict, modules: dict, gm) -> tuple:
    """(fwd, bwd, output as a meta value, whether it needs grad, what ran) of one node."""
    try:
        fwd, bwd, out, ran = _node_flops(node, values, needs_grad, modules, gm, meta=True)
    except Exception:  # data-dependent Python in a leaf module: count it on zeros
        home = weights_device(modules[node.target] if node.op == "call_module" else None)
        real = {n.name: materialize(values.get(n.name), home)
                for n in node.all_input_nodes}
        fwd, bwd, out, ran = _node_flops(node, real, needs_grad, modules, gm,
                                         meta=False)
        out = to_meta(out)
    grad = isinstance(out, torch.Tensor) and out.requires_grad
    value = out.detach() if isinstance(out, torch.Tensor) else out
    return fwd, bwd, value, grad, ran


def _record_outputs(node, attrs: dict, outs: dict, records: dict, read: set[str]) -> None:
    """Keep the node's output records, and add to `attrs` the gradient accumulation of
    each input some earlier node has read already."""
    for p, record in outs.items():
        records[p][node.name] = record
        for src in dict.fromkeys(node.all_input_nodes):  # a second reader of a tensor
            # adds its gradient to the first's (paid here, as profiler.traffic does)
            upstream = records[p].get(src.name)
            if src.name in read and isinstance(upstream, Seen):
                extra = accumulation(upstream, 2)
                attrs[p] = tuple(a + b for a, b in zip(attrs[p], extra.as_attr()))


def median_time(fn, repeats: int = 5, budget_s: float = 0.3, clock=time.perf_counter) -> float:
    """Median seconds of `fn` after one warm-up call: `repeats` calls, more (up to 25) while
    they fit in `budget_s`, so that quick ops are not decided by one noisy sample. `clock`:
    wall time by default; layer timing passes `layer_clock()`."""
    fn()
    times: list[float] = []
    spent = 0.0
    while len(times) < repeats or (spent < budget_s and len(times) < 25):
        start = clock()
        fn()
        times.append(clock() - start)
        spent += times[-1]
    return statistics.median(times)


def layer_clock():
    """The clock a layer is timed by: with one intra-op thread, this process's CPU time,
    which is the op's own time on an idle core whatever else the machine runs (on a shared
    machine, wall time prices others' load into every layer: 2.5x on a 2-core VM under
    load 8, where CPU time stayed within 5%); with several threads, wall time. Sharing
    the cores among the ranks is priced apart (Cluster.compute_slowdown)."""
    return time.process_time if torch.get_num_threads() == 1 else time.perf_counter


def timed(fn) -> float:
    """One layer's median seconds by `layer_clock()`."""
    return median_time(fn, clock=layer_clock())


def _timed_step(fn) -> float:
    """A whole step's median seconds by `layer_clock()`, over up to a second of samples
    rather than a layer's 0.3 s: the step sets one factor on every layer (the glue), so a
    slow spell of the machine in a short window would skew the whole plan."""
    return median_time(fn, budget_s=1.0, clock=layer_clock())


def _shape_key(value):
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), str(value.dtype), value.requires_grad)
    if isinstance(value, (list, tuple)):
        return tuple(_shape_key(v) for v in value)
    if isinstance(value, fx.Node):
        return ("node", value.name)
    return repr(value)


def _node_key(node: fx.Node, modules: dict, local: dict, needs_grad: dict) -> tuple:
    """What decides a node's time: its op, its module's configuration, its inputs' shapes."""
    what = str(node.target)
    if node.op == "call_module":  # its configuration, its tensors' shapes (a custom
        # module's repr may not show them), and which weights train (its backward)
        module = modules[node.target]
        what = (repr(module), tuple((tuple(p.shape), p.requires_grad)
                                    for p in module.parameters()),
                tuple(tuple(b.shape) for b in module.buffers()))
    args = fx.node.map_arg((node.args, node.kwargs), lambda n: _shape_key(local.get(n.name)))
    grads = tuple(bool(needs_grad.get(n.name)) for n in node.all_input_nodes)
    return (node.op, what, _shape_key(args), grads, torch.get_num_threads())


def measure_times(graph: ModelGraph, batch: int) -> dict[str, float]:
    """{fx node name: seconds of forward + backward} for every layer, run for real on the
    CPU at `batch` rows. Returns {} (the planner then uses FLOP rates) when the model's
    weights are on the meta device or a layer cannot run at that batch."""
    gm = graph.module
    if any(p.is_meta for p in gm.parameters()):
        return {}
    modules = dict(gm.named_modules())
    values: dict[str, object] = {}
    needs_grad: dict[str, bool] = {}
    times: dict[str, float] = {}
    try:
        for node in gm.graph.nodes:
            if node.op == "output":
                continue
            layer = graph._by_node.get(node.name)
            if node.op == "placeholder":
                values[node.name] = _placeholder_value(layer, graph, node, "cpu", batch)
                needs_grad[node.name] = False
                if layer is not None:
                    times[node.name] = 0.0
                continue
            local, _ = _inputs_for(node, values, needs_grad)
            module = modules.get(node.target) if node.op == "call_module" else None
            params = dict(module.named_parameters()) if module is not None else {}
            out = run_node(node, local, modules, gm)

            def step():
                # fresh inputs each call (in-place ops consume them), and the gradient
                # asked of these very leaves: autograd skips the input gradient, often a
                # third of a layer's time, for leaves that are not in this graph
                fresh, leaves = _inputs_for(node, values, needs_grad)
                targets = _grad_targets(leaves, params)
                y = run_node(node, fresh, modules, gm)
                if isinstance(y, torch.Tensor) and y.requires_grad and targets:
                    torch.autograd.grad(y, targets, torch.ones_like(y), allow_unused=True)

            if layer is not None:
                key = _node_key(node, modules, local, needs_grad)
                if key not in _TIMES:
                    _TIMES[key] = timed(step)
                times[node.name] = _TIMES[key]
            needs_grad[node.name] = isinstance(out, torch.Tensor) and out.requires_grad
            values[node.name] = out.detach() if isinstance(out, torch.Tensor) else out
    except Exception as error:  # e.g. a hard-coded batch size in a view()
        warnings.warn(f"hyplan: could not time layers at batch {batch} ({error}); "
                      f"using FLOP rates instead", stacklevel=2)
        return {}
    return times


def _shard_module(module: nn.Module, split: str, parts: int) -> nn.Module | None:
    """A fresh module of the shape one of `parts` shards of `module` has under `split`."""
    if isinstance(module, nn.Linear):
        fin, fout = module.in_features, module.out_features
        if split == "out" and fout % parts == 0:
            fout //= parts
        elif split == "in" and fin % parts == 0:
            fin //= parts
        elif split != "whole":
            return None
        return nn.Linear(fin, fout, bias=module.bias is not None)
    if isinstance(module, nn.Conv2d) and module.groups == 1:
        cout = module.out_channels
        if split == "out" and cout % parts == 0:
            cout //= parts
        elif split != "whole":
            return None
        return nn.Conv2d(module.in_channels, cout, module.kernel_size, module.stride,
                         module.padding, module.dilation, bias=module.bias is not None,
                         padding_mode=module.padding_mode)
    return None


def _module_step(module: nn.Module, shape: tuple[int, ...], input_grad: bool):
    """One forward + backward of `module` on a random input of `shape`."""
    x = torch.randn(shape)

    def step():
        inp = x.detach().requires_grad_(input_grad)
        y = module(inp)
        targets = [inp] * input_grad + [p for p in module.parameters() if p.requires_grad]
        torch.autograd.grad(y, targets, torch.ones_like(y))

    return step


def timed_together(steps: dict, least: int = 5, most: int = 25,
                   budget_s: float = 0.3) -> dict:
    """{key: median seconds} of each step by `layer_clock()`, timed in rounds of one call
    each (after one warm-up call each): at least `least` rounds, more (up to `most`) while
    they fit in `budget_s` per step. A slow spell of the machine then falls on every step
    alike, which timing one after another does not give: a layer's tensor-parallel shards
    timed 19% slower than its data-parallel rows in one planning of the FC-heavy CNN and
    not in the next, and its hyplan / DDP prediction moved from -14% to +13% off."""
    for step in steps.values():
        step()
    return medians_in_rounds(steps, layer_clock(), least, budget_s * len(steps), most)


def measure_shards(graph: ModelGraph, parts: int, rows: int,
                   modules: dict[str, nn.Module] | None = None) -> dict[str, dict[str, float]]:
    """{fx node name: {"whole" | "out" | "in" | "rows": seconds}} over the whole batch: for
    Linear and Conv2d layers unsplit, and one of `parts` shards split by output or input
    features (the shapes replicate, column / channel and row parallelism run at); for any
    other leaf module with weights, no buffers and one floating-point input (GPT-2's
    Conv1D, a norm), unsplit; "rows": the whole layer on `rows` rows, the data-parallel
    ones. A layer's shapes are timed together (`timed_together`), so their ratios hold
    whatever the machine's speed did meanwhile. With the data-parallel timing, "whole"
    gives a layer's time at any rows (strategies.catalog.rows_s). `modules`: the layers'
    modules by name (default: the fx graph's)."""
    if modules is None:
        modules = dict(graph.module.named_modules())
    out: dict[str, dict[str, float]] = {}
    for layer in graph.layers:
        module = modules.get(layer.name) if layer.op == "call_module" else None
        if module is None or len(layer.inputs) != 1:
            continue
        source = graph.layer(layer.inputs[0]).output
        shape = source.shape
        if not source.has_rows(graph.batch_size):
            continue
        per_row = shape[0] // graph.batch_size  # the rows merged with the next dims (OPT's MLP)
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            splits = ("whole", "out", "in") if parts > 1 else ("whole",)
        elif (source.dtype == "float32" and not any(True for _ in module.children())
              and any(p.requires_grad for p in module.parameters())
              and not any(True for _ in module.buffers())):  # a BatchNorm's statistics
            splits = ("whole",)
        else:
            continue
        input_grad = not graph.layer(layer.inputs[0]).is_input
        cases = {}  # split -> (module of that shape, input shape)
        for split in splits:
            shard = _shard_module(module, split, parts)
            if shard is None and split == "whole" and splits == ("whole",):
                shard = module  # timed as it is: autograd.grad leaves its .grad alone
            if shard is None:
                continue
            in_shape = list(shape)
            if split == "in":
                in_shape[-1] //= parts
            cases[split] = (shard, tuple(in_shape))
        if "whole" not in cases:
            continue
        if rows * per_row != shape[0]:
            cases["rows"] = (cases["whole"][0], (rows * per_row, *shape[1:]))
        key = ("shards", tuple((split, repr(m), s) for split, (m, s) in cases.items()),
               input_grad, torch.get_num_threads())
        if key not in _TIMES:
            try:
                _TIMES[key] = timed_together({split: _module_step(m, s, input_grad)
                                              for split, (m, s) in cases.items()})
            except Exception:  # noqa: BLE001 - a module that wants more than one tensor
                _TIMES[key] = None
        if _TIMES[key] is not None:
            out[layer.node] = dict(_TIMES[key])
    return out


def in_the_layers_window(times: dict[str, float], shards: dict[str, dict[str, float]]
                         ) -> dict[str, dict[str, float]]:
    """Each layer's shard timings scaled to the window its data-parallel timing (`times`,
    timed with the real inputs) was taken in: by that timing over the shards' own "rows"
    case, timed with them. What the solver weighs is a layer's strategies against each
    other: DDP's rows against tensor parallelism's shards."""
    out = {}
    for node, by in shards.items():
        by = dict(by)
        ref = by.pop("rows", None)
        if ref is None and by.get("whole") and node in times:  # the rows are the batch
            ref = by["whole"]
        if ref and times.get(node):
            by = {split: t * times[node] / ref for split, t in by.items()}
        out[node] = by
    return out
