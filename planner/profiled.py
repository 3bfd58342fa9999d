"""What every planning entry (optimize, optimize_3d, baseline) does first: check its
arguments, trace the model (torch.fx, or torch.export where fx cannot follow it) and
profile it on the cluster; and the error each raises when nothing fits.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from profiler import profile, trace
from profiler.export_trace import export_trace
from profiler.per_model import PerModel
from profiler.repeat_blocks import trace_repeated
from profiler.trace import TraceError
from strategies.catalog import OPTIMIZER_STATE_FACTOR, leaf_types, unit_types
from strategies.cluster import cpu_threads_per_device
from strategies.fusion import fused
from strategies.parse import parse_devices
from strategies.precision import at_precision

GB = 1e9


class PlanDoesNotFit(ValueError):
    """No assignment of strategies fits the devices' memory."""


def check_arguments(optimizer: str, example_inputs, memory_limit_bytes: float | None) -> None:
    """The checks every planning entry point makes before it traces anything."""
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"optimizer: {optimizer!r} is not one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    if example_inputs is None:
        raise ValueError("example_inputs: pass an example batch, e.g. example_inputs=(images,)")
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes: must be positive, got {memory_limit_bytes}")


def profiled_graph(model: nn.Module, devices, example_inputs, example_kwargs=None,
                   leaf_modules=(), measure: bool | None = None, tracer: str = "auto",
                   precision: str | None = None):
    """(traced and profiled graph, Cluster): the first two steps of the flow, shared by
    optimize() and the baselines (layer timings are cached by shape, so a second call on
    the same model costs no measuring). The Cluster records `precision` (None: its own or
    the device's default) and the graph's activations are sized in it."""
    cluster = parse_devices(devices).at_precision(precision)
    ranks = cluster.num_devices
    graph = trace_model(model, example_inputs, example_kwargs, leaf_modules, tracer)
    if ranks > 1:
        refuse_loss_inside(graph)
    if measure is None:
        measure = cluster.device.kind == "cpu"
    graph = profile(graph, measure=measure, measure_batch=max(1, graph.batch_size // ranks),
                    threads=cpu_threads_per_device(ranks) if cluster.device.kind == "cpu" else None,
                    ranks=ranks, model=model, example_inputs=example_inputs)
    graph = at_precision(graph, cluster.training_precision)
    # torch.compile priced: its fused element-wise traffic (strategies.fusion)
    return (fused(graph) if cluster.levers.compile else graph), cluster


def refuse_loss_inside(graph) -> None:
    """A model torch.export traced that returns a scalar made from its rows (a Hugging Face
    model handed `labels=` computes its loss inside forward) cannot be split by rows: the
    loss's mean runs between modules, where the module executor changes no layouts, and
    the integer program would say only that an edge into it cannot be made. Say what to
    do instead: compute the loss in the training step's loss_fn, as hyplan's loop does."""
    if graph.tracer != "export":
        return
    outputs = set(graph.outputs)
    scalars = [l.name for l in graph.layers if l.node in outputs and l.output.shape == ()]
    if scalars:
        keyword = next((k for k in ("labels", "label", "targets") if k in graph.example_kwargs),
                       None)
        given = f" from example_kwargs[{keyword!r}]" if keyword else ""
        raise ValueError(
            f"model: {graph.model_name} returns a scalar ({scalars[0]!r}): it computes a "
            f"loss inside forward{given}, over all the batch's rows, which no plan over "
            f"several devices splits. Fix: leave the labels out of the model's "
            f"inputs and compute the loss in the step's loss_fn, e.g. "
            f"executor.train_step(model, plan, (ids, targets), lambda out, y: "
            f"F.cross_entropy(out.logits.flatten(0, 1), y.flatten()), opt), with targets "
            f"as the model would make them from labels (a causal LM's: shifted by one)")


_traced = PerModel()  # model -> {what it was traced with: its ModelGraph}


def trace_model(model: nn.Module, example_inputs, example_kwargs=None, leaf_modules=(),
                tracer: str = "auto"):
    """The model's ModelGraph by torch.fx, or by torch.export where fx cannot follow it;
    traced once per model, structure and input shapes in a process (a ModelGraph is
    frozen): planning one model again, or its baselines beside it (`hyplan compare`, a
    plan of each kind), traced a Hugging Face model by torch.export each time, ~1 s."""
    if tracer not in ("auto", "fx", "export", "blocks"):
        raise ValueError(f"tracer: {tracer!r} is not one of 'auto', 'fx', 'export', 'blocks'")
    return _traced.get(model, _trace_key(model, example_inputs, example_kwargs, leaf_modules,
                                         tracer),
                       lambda: _trace(model, example_inputs, example_kwargs, leaf_modules,
                                      tracer))


def _trace_key(model: nn.Module, example_inputs, example_kwargs, leaf_modules, tracer) -> tuple:
    """What a trace depends on: the model's modules (names, classes), its parameters' and
    buffers' names, shapes and dtypes, its mode, and the inputs' shapes and dtypes (not
    any values: tracing runs on fake tensors)."""
    leaves, structure = pytree.tree_flatten((example_inputs, dict(example_kwargs or {})))
    inputs = (str(structure), tuple((tuple(x.shape), x.dtype, x.device.type)
                                    if isinstance(x, torch.Tensor) else repr(x) for x in leaves))
    tensors = [*model.named_parameters(remove_duplicate=False),
               *model.named_buffers(remove_duplicate=False)]
    return (tracer, model.training,
            tuple((name, type(m)) for name, m in model.named_modules()),
            tuple((name, tuple(t.shape), t.dtype, t.device.type) for name, t in tensors),
            tuple(id(p) for _, p in tensors),  # a tie made or broken changes the graph
            inputs, tuple(leaf_modules))


def _trace(model: nn.Module, example_inputs, example_kwargs, leaf_modules, tracer):
    if tracer == "blocks":  # torch.export of three blocks, repeated (profiler.repeat_blocks)
        return trace_repeated(model, example_inputs, example_kwargs, unit_types(model))
    if tracer != "export":
        try:
            return trace(model, example_inputs, example_kwargs,
                         tuple(leaf_modules) + leaf_types(model))
        except TraceError as fx_error:
            if tracer == "fx":
                raise
            first = fx_error
    else:
        first = None
    try:
        return export_trace(model, example_inputs, example_kwargs, unit_types(model))
    except TraceError as error:
        if first is None:
            raise
        raise TraceError(f"{first} -- and {error}") from error
