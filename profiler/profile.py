"""Per-layer costs: FLOPs forward and backward (torch.utils.flop_counter), and, when the plan
targets this machine, the measured time of each layer's forward plus backward.

Each layer is run on its own, its inputs detached, so the counts and times belong to that
layer alone. FLOPs are counted on meta tensors: nothing is allocated.
"""

from __future__ import annotations

import time
import warnings
from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils.flop_counter import FlopCounterMode

from profiler.graph import Layer, ModelGraph
from profiler.machine import threads as thread_count
from profiler.trace import to_meta, materialize, meta_params, run_node


def profile(graph: ModelGraph, measure: bool = False, measure_batch: int | None = None,
            threads: int | None = None) -> ModelGraph:
    """Add FLOPs to every layer and, with `measure`, time each layer on this machine's CPU
    at `measure_batch` rows (default: the graph's batch) with `threads` intra-op threads.
    A graph from torch.export already carries its FLOPs and is returned as it is."""
    if graph.tracer == "export":
        return graph
    flops = count_flops(graph)
    times: dict[str, float] = {}
    batch = measure_batch or graph.batch_size
    if measure:
        with thread_count(threads):
            times = measure_times(graph, batch)
    layers = tuple(
        replace(layer, fwd_flops=flops[layer.node][0], bwd_flops=flops[layer.node][1],
                measured_s=times.get(layer.node), measured_batch=batch if times else None)
        for layer in graph.layers
    )
    return replace(graph, layers=layers)


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
    """(forward FLOPs, backward FLOPs, output) of one node run on its own."""
    local, leaves = _inputs_for(node, values, needs_grad)
    module = modules[node.target] if node.op == "call_module" else None
    if module is None:
        params = {}
    elif meta:
        params = meta_params(module)
    else:
        params = dict(module.named_parameters())
    with FlopCounterMode(display=False) as counter:
        out = run_node(node, local, modules, gm, params if meta and module is not None else None)
    fwd = counter.get_total_flops()
    targets = _grad_targets(leaves, params)
    bwd = 0
    if isinstance(out, torch.Tensor) and out.requires_grad and targets:
        with FlopCounterMode(display=False) as counter:
            torch.autograd.grad(out, targets, torch.empty_like(out), allow_unused=True)
        bwd = counter.get_total_flops()
    return fwd, bwd, out


def count_flops(graph: ModelGraph) -> dict[str, tuple[int, int]]:
    """{fx node name: (forward FLOPs, backward FLOPs)} for every layer, on meta tensors."""
    gm = graph.module
    modules = dict(gm.named_modules())
    values: dict[str, object] = {}
    needs_grad: dict[str, bool] = {}
    result: dict[str, tuple[int, int]] = {}
    for node in gm.graph.nodes:
        if node.op == "output":
            continue
        layer = graph._by_node.get(node.name)
        if node.op == "placeholder":
            values[node.name] = _placeholder_value(layer, graph, node, "meta", graph.batch_size)
            needs_grad[node.name] = False
            if layer is not None:
                result[node.name] = (0, 0)
            continue
        try:
            fwd, bwd, out = _node_flops(node, values, needs_grad, modules, gm, meta=True)
        except Exception:  # data-dependent Python in a leaf module: count it on zeros
            real = {n.name: materialize(values.get(n.name)) for n in node.all_input_nodes}
            fwd, bwd, out = _node_flops(node, real, needs_grad, modules, gm, meta=False)
            out = to_meta(out)
        needs_grad[node.name] = isinstance(out, torch.Tensor) and out.requires_grad
        values[node.name] = out.detach() if isinstance(out, torch.Tensor) else out
        if layer is not None:
            result[node.name] = (fwd, bwd)
    return result


def _best_of(fn, repeats: int = 3) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


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
            local, leaves = _inputs_for(node, values, needs_grad)
            module = modules.get(node.target) if node.op == "call_module" else None
            params = dict(module.named_parameters()) if module is not None else {}
            targets = _grad_targets(leaves, params)
            out = run_node(node, local, modules, gm)

            def step():
                fresh, _ = _inputs_for(node, values, needs_grad)  # in-place ops consume it
                y = run_node(node, fresh, modules, gm)
                if isinstance(y, torch.Tensor) and y.requires_grad and targets:
                    torch.autograd.grad(y, targets, torch.ones_like(y), allow_unused=True)

            if layer is not None:
                times[node.name] = _best_of(step)
            needs_grad[node.name] = isinstance(out, torch.Tensor) and out.requires_grad
            values[node.name] = out.detach() if isinstance(out, torch.Tensor) else out
    except Exception as error:  # e.g. a hard-coded batch size in a view()
        warnings.warn(f"hyplan: could not time layers at batch {batch} ({error}); "
                      f"using FLOP rates instead", stacklevel=2)
        return {}
    return times
