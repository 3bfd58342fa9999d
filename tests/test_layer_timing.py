"""Layer timing runs each layer's whole forward and backward, input gradients included."""

import importlib

import pytest
import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.profiled import trace_model

# the module (the package's `profiler.profile` attribute is the function of that name)
layer_timing = importlib.import_module("profiler.profile")


def test_timed_backward_includes_the_input_gradient(monkeypatch):
    # Count the FLOPs of what is timed instead of timing it: a Linear after another layer
    # must compute its input gradient too (3x its forward), as the real backward does.
    # (Timing once asked autograd for the gradient of the wrong leaves, and autograd
    # skipped the input gradient: every layer looked a third cheaper than it ran.)
    def flops_of(fn, *args, **kwargs):
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    monkeypatch.setattr(layer_timing, "median_time", flops_of)
    layer_timing.forget_layer_times()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
    graph = trace_model(model, (torch.randn(8, 32),), tracer="fx")
    times = layer_timing.measure_times(graph, 8)
    layer_timing.forget_layer_times()
    forward = 2 * 8 * 64 * 48
    assert times["_2"] == 3 * forward  # forward, weight gradient, input gradient
    assert times["_0"] == 2 * 2 * 8 * 32 * 64  # the first layer: no input gradient


def test_a_layer_is_priced_at_the_rows_it_runs_whatever_rows_it_was_timed_at(monkeypatch):
    # FLOPs stand in for seconds again (exactly linear in rows). Planning for 4 devices
    # times each layer at the data-parallel rows (8 of 32) and Linear layers also over the
    # whole batch; a pipeline stage's microbatch or a 3-D plan's dp group runs other rows
    # (16 on pp2 x dp2). They were priced at the whole batch's timing whatever their rows:
    # a 2-stage pipeline of a small CNN came out 1.6x its measured compute.
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import flop_registry

    from reference_profile import reference_profile
    from strategies.catalog import CostContext, compute_s

    class Flops(TorchDispatchMode):  # FlopCounterMode's module hooks refuse grad(leaf)
        total = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.overloadpacket in flop_registry:
                Flops.total += flop_registry[func.overloadpacket](
                    *args, **(kwargs or {}), out_val=out)
            return out

    def flops_of(fn, *args, **kwargs):
        Flops.total = 0
        with Flops():
            fn()
        return float(Flops.total)

    monkeypatch.setattr(layer_timing, "median_time", flops_of)
    monkeypatch.setattr(layer_timing, "timed_together",
                        lambda steps, **kw: {k: flops_of(fn) for k, fn in steps.items()})
    layer_timing.forget_layer_times()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
    graph = trace_model(model, (torch.randn(32, 32),), tracer="fx")
    graph = layer_timing.profile(graph, measure=True, measure_batch=8, ranks=4)
    layer_timing.forget_layer_times()
    last = graph.layers[-1]
    assert (last.measured_batch, last.shards_batch) == (8, 32)
    cluster = reference_profile(4).cluster(4).model_copy(update={"compute_slowdown": 1.0})
    forward = 2 * 64 * 48  # per row
    for rows in (4, 8, 16, 24, 32):
        whole = CostContext(cluster=cluster, ranks=1, batch=rows)  # replicated or one stage
        assert compute_s(last, 1.0, whole) == 3 * forward * rows
        split = CostContext(cluster=cluster, ranks=4, batch=rows)  # rows over 4 devices
        assert compute_s(last, 0.25, split) == 3 * forward * rows / 4
        # a column shard runs every row on a quarter of the output features
        assert compute_s(last, 0.25, split, "out") == 3 * forward * rows / 4


def test_fewer_rows_than_timed_keep_the_part_of_a_layer_that_does_not_shrink_with_rows():
    # A 4096-wide Linear, 1 thread, here: 58.9 ms at 8 rows, 64.3 at 16, 80.5 at 32 (its
    # weights are read and their gradient written whatever the rows). A 2-process plan
    # times it at 16 and 32; 4 microbatches of 8 rows were priced 32 ms each, in proportion.
    from dataclasses import replace

    from strategies.catalog import rows_s

    model = nn.Sequential(nn.Linear(64, 64))
    layer = trace_model(model, (torch.randn(32, 64),), tracer="fx").layers[-1]
    timed = replace(layer, measured_s=64.3, measured_batch=16,
                    measured_shards={"whole": 80.5}, shards_batch=32)
    slope = (80.5 - 64.3) / 16
    assert rows_s(timed, 24) == pytest.approx(64.3 + 8 * slope)
    # on the line, below the rows timed
    assert rows_s(timed, 8) == pytest.approx(64.3 - 8 * slope)
    assert rows_s(timed, 1) == pytest.approx(64.3 - 15 * slope)
    # never dearer than at the rows timed, never cheaper than in proportion to them
    flat = replace(timed, measured_shards={"whole": 60.0})
    assert rows_s(flat, 8) == 64.3
    steep = replace(timed, measured_shards={"whole": 200.0})
    assert rows_s(steep, 8) == 64.3 / 2
    alone = replace(timed, measured_shards={})  # timed once: in proportion
    assert rows_s(alone, 8) == 64.3 / 2 and rows_s(alone, 32) == 64.3 * 2
    # a column shard (timed over the whole batch) on a microbatch follows the whole layer
    from reference_profile import reference_profile
    from strategies.catalog import CostContext, compute_s

    sharded = replace(timed, measured_shards={"whole": 80.5, "out": 40.0}, measured_parts=2)
    cluster = reference_profile(2).cluster(2).model_copy(update={"compute_slowdown": 1.0})
    on_16 = CostContext(cluster=cluster, ranks=2, batch=16)
    assert compute_s(sharded, 0.5, on_16, "out") == pytest.approx(40.0 * 64.3 / 80.5)


def test_every_leaf_module_with_weights_is_timed_over_the_whole_batch_too():
    # GPT-2's Conv1D is a Linear by another name: timed only at the data-parallel rows, a
    # pipeline's microbatch of it was priced in proportion, losing the part of its time
    # that does not shrink with rows. A BatchNorm is left out: timing it would move its
    # running statistics.
    class Conv1D(nn.Module):  # transformers.pytorch_utils.Conv1D's shape
        def __init__(self, nf, nx):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(nx, nf) * 0.02)
            self.bias = nn.Parameter(torch.zeros(nf))

        def forward(self, x):
            return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight)

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), Conv1D(24, 32),
                          nn.LayerNorm(24))
    graph = trace_model(model, (torch.randn(8, 16),), leaf_modules=(Conv1D,), tracer="fx")
    stats = model[1].running_mean.clone()
    graph = layer_timing.profile(graph, measure=True, measure_batch=4, ranks=2)
    by_name = {layer.name: layer for layer in graph.layers}
    assert set(by_name["0"].measured_shards) == {"whole", "out", "in"}
    assert set(by_name["2"].measured_shards) == {"whole"}
    assert set(by_name["3"].measured_shards) == {"whole"}
    assert by_name["2"].shards_batch == 8
    assert not by_name["1"].measured_shards
    assert torch.equal(model[1].running_mean, stats)


def test_planning_leaves_the_users_model_as_it_was():
    # Timing runs every layer in training mode: a BatchNorm's running statistics moved
    # (27 batches counted into the user's model by one optimize()).
    import planner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 8))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    planner.optimize(model, "2xcpu", example_inputs=(torch.randn(8, 16),))
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before), [
        k for k in before if not torch.equal(before[k], after[k])]


def test_a_layers_shapes_are_timed_together_so_a_slow_spell_keeps_their_ratio(monkeypatch):
    # The solver weighs a layer's strategies against each other: its data-parallel rows
    # against its tensor-parallel shards. Timed one after another, a slow spell of the
    # machine during one of them moved that ratio by 19% between two plannings of the
    # FC-heavy CNN; timed in rounds of one call each, the spell falls on both alike.
    now, calls = [0.0], [0]

    def step_of(cost):
        def step():
            calls[0] += 1
            now[0] += cost * (3.0 if 10 <= calls[0] < 40 else 1.0)  # a slow spell
        return step

    monkeypatch.setattr(layer_timing, "layer_clock", lambda: (lambda: now[0]))
    t = layer_timing.timed_together({"rows": step_of(1e-3), "out": step_of(0.5e-3)})
    assert t["out"] / t["rows"] == pytest.approx(0.5)
    # and the shards join the window the layer's own data-parallel timing was taken in
    shards = {"a": {"rows": 1.0, "whole": 3.0, "out": 1.5}, "b": {"whole": 4.0}}
    assert layer_timing.in_the_layers_window({"a": 2.0, "b": 2.0}, shards) == {
        "a": {"whole": 6.0, "out": 3.0}, "b": {"whole": 2.0}}
