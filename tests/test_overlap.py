"""Data-parallel collectives beside compute on GPUs (strategies.overlap): FSDP's gathers and
scatters and DDP's bucket all-reduces cost a step only what they take beyond the compute
that runs beside them; on a CPU (gloo, calibrated in whole steps) all of it. Checked as
properties of the formula over random instances, then through planner.price on real
traced layers: the cover the graph sets, an FSDP layer whose compute hides its collectives
entirely, one whose compute hides little of them, and the 1-D and 3-D searches pricing alike
on a GPU cluster."""

import random

import pytest
import torch

import models
from planner.choices import layer_choices
from planner.plan3d import to_plan
from planner.price import group_link, in_rhythm, price
from planner.search import CostCache, Shape, build, search
from profiler import profile, trace
from strategies.catalog import CostContext, candidates, compute_s, update_s
from strategies.collectives import bucketed_all_reduce_s, fsdp_layer_s
from strategies.memory import fsdp_copies_s
from strategies.overlap import exposed_s, forward_share
from strategies.parse import parse_devices


def test_exposed_is_what_runs_past_the_compute_beside_it_random_instances():
    rng = random.Random(0)
    for _ in range(2000):
        fwd, bwd = rng.expovariate(1e3), rng.expovariate(1e3)
        compute, share = rng.expovariate(1e3), rng.uniform(0.05, 0.95)
        cover = rng.choice([None, 1.0, rng.uniform(1, 4)])
        waited = exposed_s(fwd, bwd, compute, share, cover)
        if cover is None:
            assert waited == fwd + bwd
            continue
        # never more than in the step's path, never less than what compute cannot hide
        assert max(0.0, fwd + bwd - cover * compute) - 1e-15 <= waited <= fwd + bwd
        # each side hides only behind its own pass: forward's slack does not cover backward
        assert waited >= max(0.0, bwd - cover * (1 - share) * compute) - 1e-15
        # more compute beside it never costs more
        assert exposed_s(fwd, bwd, 2 * compute, share, cover) <= waited + 1e-15
    assert forward_share(2, 4) == pytest.approx(1 / 3) and forward_share(0, 0) == pytest.approx(1 / 3)


def _mlp_graph(rows: int):
    return profile(trace(models.mlp(), (torch.randn(rows, 16),)), measure=False)


def test_the_cover_is_all_compute_over_the_weighted_layers_compute_on_gpus_only():
    graph = _mlp_graph(16)
    gpu = parse_devices("8xA100-80GB")
    covered = in_rhythm(gpu, graph, 1, 16, "adam")
    ctx = CostContext(cluster=gpu, ranks=1, batch=16, optimizer="adam")
    layers = [l for l in graph.layers if not l.is_input]
    total = sum(compute_s(l, 1.0, ctx) for l in layers)
    weighted = sum(compute_s(l, 1.0, ctx) for l in layers if l.param_bytes)
    assert covered.overlap_cover == pytest.approx(total / weighted)
    assert covered.overlap_cover > 1.0  # the ReLUs between the Linears
    # a CPU cluster's collectives run in the step's path: gloo, timed in whole steps
    assert in_rhythm(parse_devices("2xcpu"), graph, 1, 16, "adam").overlap_cover is None


def _fsdp_layer(rows: int, devices: str = "8xA100-80GB"):
    """(the layer's options, the data-parallel one's index, the fsdp one's, the gathers,
    the scatter, the cover, FSDP2's buffer copies) of the mlp's middle Linear over dp = 8,
    `rows` rows per rank, in the 3-D search."""
    graph = _mlp_graph(8 * rows)
    cache = CostCache(graph, parse_devices(devices), "adam")
    built = build(cache, 1, 8, 1, rows)
    i = next(i for i, l in enumerate(built.problem.layers) if l.name == "2")
    layer = built.problem.layers[i]
    ddp, fsdp = (layer.strategies.index(n) for n in ("data_parallel", "data_parallel+fsdp"))
    cluster = cache.rhythm(1, rows)
    p = cluster.training_precision
    param = next(l for l in graph.layers if l.name == "2").param_bytes
    gathers, scatter = fsdp_layer_s(p.gather_bytes(param), p.reduce_bytes(param), 8,
                                    cluster.intra_node)
    ctx = CostContext(cluster=cluster, ranks=1, batch=rows, optimizer="adam")
    copies = fsdp_copies_s(param, 8, cluster.intra_node, ctx)
    return layer, ddp, fsdp, gathers, scatter, cluster.overlap_cover, copies


def test_fsdp_hidden_entirely_behind_a_large_microbatch_and_not_behind_a_tiny_one():
    # 64 Ki rows: the Linear's forward outlasts a gather over NVLink many times
    layer, ddp, fsdp, gathers, scatter, cover, copies = _fsdp_layer(1 << 16)
    assert cover is not None and gathers > 0
    # what is left: FSDP2's copies into and out of its flat buffers, on the compute stream
    assert layer.microbatch_s[fsdp] == pytest.approx(layer.microbatch_s[ddp] + copies,
                                                     rel=1e-12)
    # 1 row: launch-bound kernels beside them, most of it waited for, as the formula says
    layer, ddp, fsdp, gathers, scatter, cover, copies = _fsdp_layer(1)
    waited = layer.microbatch_s[fsdp] - layer.microbatch_s[ddp] - copies
    compute = layer.microbatch_s[ddp]  # data parallel: its compute alone per microbatch
    share = forward_share(*_flops("2"))
    assert waited == pytest.approx(exposed_s(gathers / 2, gathers / 2 + scatter, compute,
                                             share, cover), rel=1e-9)
    assert 0.5 * (gathers + scatter) < waited < gathers + scatter


def _flops(name: str):
    layer = next(l for l in _mlp_graph(8).layers if l.name == name)
    return layer.fwd_flops, layer.bwd_flops


def test_ddp_sync_on_a_gpu_waits_only_past_the_backward_beside_it():
    rows = 4096  # per replica: a backward long enough to hide part of the all-reduce
    graph = _mlp_graph(rows)
    cluster = in_rhythm(parse_devices("2x8xA100-80GB"), graph, 1, rows, "adam")
    layer = next(l for l in graph.layers if l.name == "2")
    ctx = CostContext(cluster=cluster, ranks=1, batch=rows, optimizer="adam")
    dp = next(s for s in candidates(layer, ctx) if s.name == "data_parallel")
    on_gpu = price(layer, dp, ctx, dp=16)
    serial = price(layer, dp, CostContext(cluster=cluster.model_copy(
        update={"overlap_cover": None}), ranks=1, batch=rows, optimizer="adam"), dp=16)
    assert on_gpu.step_s < serial.step_s
    # what the backward hides: up to its compute times the cover, no more
    hidden = serial.step_s - on_gpu.step_s
    backward = on_gpu.cost.compute_s * (1 - forward_share(layer.fwd_flops, layer.bwd_flops))
    reduce = bucketed_all_reduce_s(ctx.precision.reduce_bytes(layer.param_bytes), 16,
                                   group_link(cluster, 16))
    assert hidden == pytest.approx(min(reduce, cluster.overlap_cover * backward), rel=1e-9)
    assert on_gpu.microbatch_s == serial.microbatch_s  # the sync is once a step


@pytest.mark.parametrize("devices", ["8xA100-80GB", "2x4xH100"])
def test_1d_and_3d_price_overlap_alike(devices):
    """The 1-D planner's one group of N (its fsdp lever inside the tp group) and the 3-D
    shape pp 1 x dp 1 x tp N read the same cover and so the same prices."""
    graph = _mlp_graph(64)
    cluster = parse_devices(devices)
    n = cluster.num_devices
    one = layer_choices(graph, cluster, "adam", None, levers=True)
    three = build(CostCache(graph, cluster, "adam"), 1, 1, n, graph.batch_size)
    assert in_rhythm(cluster, graph, n, 64, "adam").overlap_cover is not None
    for node, opts in zip(one.problem.nodes, three.problem.layers):
        for j, o in enumerate(node.options):
            if o.strategy in opts.strategies:
                k = opts.strategies.index(o.strategy)
                assert opts.microbatch_s[k] + opts.step_s[k] == pytest.approx(o.time_s,
                                                                              rel=1e-12)
    # the 1-D fsdp lever (ZeRO-3 over the group): its gathers and scatter beside its compute
    ctx = CostContext(cluster=in_rhythm(cluster, graph, n, 64, "adam"), ranks=n, batch=64,
                      optimizer="adam")
    p = ctx.precision
    checked = 0
    for row in one.layers:
        for s, cost in zip(row.strategies, row.costs):
            if s.name != "fsdp":
                continue
            gathers, scatter = fsdp_layer_s(p.gather_bytes(row.layer.param_bytes),
                                            p.reduce_bytes(row.layer.param_bytes), n, ctx.link)
            share = forward_share(row.layer.fwd_flops, row.layer.bwd_flops)
            assert cost.communication_s == pytest.approx(exposed_s(
                gathers / 2, gathers / 2 + scatter, cost.compute_s, share,
                ctx.cluster.overlap_cover) + fsdp_copies_s(row.layer.param_bytes, n, ctx.link,
                                                          ctx), rel=1e-12)
            assert cost.communication_s < gathers + scatter + cost.notes["buffer_copies_s"]
            checked += 1
    assert checked


def test_a_sharded_plans_terms_add_up_with_the_shards_own_optimizer_step():
    """The plan's step split (planner.plan3d.to_plan): a layer sharded over dp steps the
    optimizer on its shard only, so its update is the shard's and the rest of its per-step
    price is its sync; the step's communication is then what is left, never negative."""
    graph = _mlp_graph(64)
    cluster = parse_devices("8xA100-80GB")
    pin = {"0": "data_parallel+fsdp", "2": "data_parallel+fsdp", "4": "data_parallel+fsdp"}
    result = search(graph, cluster, "adam", None, only=[Shape(1, 8, 1, 1, "1F1B")], pin=pin)
    plan = to_plan(graph, cluster, "adam", float("inf"), result, 0.0)
    ctx = CostContext(cluster=cluster, ranks=1, batch=8, optimizer="adam")
    for name in pin:
        layer = plan.layer(name)
        assert layer.dp_shard
        assert layer.update_s == pytest.approx(update_s(layer.param_bytes / 8, ctx), rel=1e-9)
        assert layer.communication_s >= 0
    p = plan.predicted
    assert p.communication_s >= 0
    assert p.other_s == pytest.approx(sum(l.update_s for l in plan.layers), rel=1e-9)
