"""HSDP in the 3-D search: a layer's weights sharded over the dp ranks of one node and
replicated across nodes (planner.dp_shard). Pricing: offered only where the dp group spans
nodes with more than one of its ranks in each; it keeps more than fsdp and less than plain
data parallelism, gathers and scatters over the fast link per microbatch and all-reduces
its gradient shard across nodes once per step. Execution: FSDP2 on the 2-D
(dp_replicate, dp_shard) mesh, 4 gloo ranks as 2 nodes of 2, equals one process after 3
SGD steps, with one cross-node all-reduce per HSDP layer per step."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import executor
import models
from distributed import run_ranks
from planner import dp_shard
from planner.plan import Plan
from planner.plan3d import optimize_3d
from planner.search import CostCache, Shape, build, group_link
from profiler import profile, trace
from strategies.catalog import CostContext, update_s, weights_memory
from strategies.collectives import all_gather_s, all_reduce_s, reduce_scatter_s
from strategies.memory import fsdp_copies_s
from strategies.overlap import exposed_s, forward_share
from strategies.parse import parse_devices
from test_pipeline_equivalence import LR, ROWS, STEPS, _full, _train_single


def _names(devices: str, dp: int, tp: int) -> list[str]:
    graph = profile(trace(models.mlp(), (torch.randn(16, 16),)), measure=False)
    built = build(CostCache(graph, parse_devices(devices), "adam"), 1, dp, tp, 16 // dp)
    return next(l for l in built.problem.layers if l.name == "2").strategies


def test_hsdp_offered_only_where_the_dp_group_spans_nodes_with_several_ranks_in_each():
    assert "data_parallel+hsdp" in _names("2x2xV100", dp=4, tp=1)
    assert "data_parallel+hsdp" not in _names("2x2xV100", dp=2, tp=1)  # inside one node
    assert "data_parallel+hsdp" not in _names("4xV100", dp=4, tp=1)  # one node
    # one dp rank per node (tp fills it): a shard group of one is plain data parallelism
    assert not any(n.endswith("+hsdp") for n in _names("2x2xV100", dp=2, tp=2))
    assert dp_shard.hsdp_split(8, 1, 4) == (2, 4)
    assert dp_shard.hsdp_split(4, 2, 4) == (2, 2)
    assert dp_shard.hsdp_split(4, 1, 4) is None and dp_shard.hsdp_split(6, 1, 4) is None


def test_hsdp_price_lies_between_fsdp_and_data_parallel():
    """8 devices as 2 nodes of 4 (NVLink inside, InfiniBand across), dp = 8: HSDP shards
    over the 4 ranks of a node and all-reduces over the 2 nodes."""
    graph = profile(trace(models.mlp(), (torch.randn(16, 16),)), measure=False)
    cluster = parse_devices("2x4xA100-80GB")
    cache = CostCache(graph, cluster, "adam")
    built = build(cache, 1, 8, 1, 2)
    i = next(i for i, l in enumerate(built.problem.layers) if l.name == "2")
    layer = built.problem.layers[i]
    ddp, fsdp, hsdp = (layer.strategies.index(n) for n in
                       ("data_parallel", "data_parallel+fsdp", "data_parallel+hsdp"))
    source = next(l for l in graph.layers if l.name == "2")
    param = source.param_bytes
    # on GPUs what runs past the compute beside it (strategies.overlap): the layer's own
    # compute (data parallel's microbatch) at the graph's cover
    cover = cache.rhythm(1, 2).overlap_cover
    compute, share = layer.microbatch_s[ddp], forward_share(source.fwd_flops, source.bwd_flops)
    ctx = CostContext(cluster=cluster, ranks=1, batch=2, optimizer="adam")
    p = ctx.precision
    inside, across = cluster.intra_node, cluster.inter_node
    assert group_link(cluster, 8) == across and group_link(cluster, 4) == inside
    # per microbatch: two gathers and a scatter over the 4 ranks of a node
    gather = all_gather_s(p.gather_bytes(param), 4, inside)
    extra = (exposed_s(gather, gather + reduce_scatter_s(p.reduce_bytes(param), 4, inside),
                       compute, share, cover)
             + fsdp_copies_s(param, 4, inside, ctx))
    assert layer.microbatch_s[hsdp] - layer.microbatch_s[ddp] == pytest.approx(extra)
    # per step: the optimizer on a quarter, one all-reduce of the quarter over the 2 nodes
    assert layer.step_s[hsdp] == pytest.approx(update_s(param / 4, ctx) + exposed_s(
        0.0, all_reduce_s(p.reduce_bytes(param / 4), 2, across), compute, share, cover))
    assert built.local_param_bytes[i][hsdp] == pytest.approx(param / 4)
    # its quarter's weights, gradients, optimizer state and foreach AdamW's temporary of it
    # (a GPU's: strategies.step_memory.summed_temp_bytes)
    assert layer.weight_bytes[hsdp] == pytest.approx(
        weights_memory(param / 4, ctx, sharded=True) + param / 4)
    # between the two: memory and per-step sync; per microbatch cheaper than fsdp's
    # gathers over InfiniBand
    assert layer.weight_bytes[fsdp] < layer.weight_bytes[hsdp] < layer.weight_bytes[ddp]
    # per step: more than fsdp (its cross-node all-reduce); DDP's sync of a layer this
    # small is cheaper still, since its bucketed all-reduce shares one latency with the
    # bucket's other layers (planner.price), where FSDP2 all-reduces each module alone
    assert layer.step_s[fsdp] < layer.step_s[hsdp]
    assert layer.microbatch_s[ddp] < layer.microbatch_s[hsdp] < layer.microbatch_s[fsdp]
    assert built.sharded[i][hsdp] == "+hsdp" and built.sharded[i][fsdp] == "+fsdp"


PIN = {"0": "data_parallel+hsdp", "2": "data_parallel+fsdp", "4": "data_parallel+hsdp"}


def _train_counting(rank, world, plan_json):
    """This rank's whole parameters, its losses, and per step the all-reduces FSDP2 issued
    over the cross-node (dp_replicate) group."""
    plan = Plan.from_json(plan_json)
    model = executor.parallelize(models.mlp(), plan)
    across = model.mesh["dp_replicate"].get_group()
    seen = []
    real = dist.all_reduce

    def counted(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        seen.append(group is across)
        return real(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = counted  # an observer: every call goes through to gloo
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    losses, per_step = [], []
    for step in range(STEPS):
        seen.clear()
        losses.append(executor.train_step(model, plan, models.batch("mlp", ROWS, step),
                                          F.cross_entropy, opt))
        per_step.append(sum(seen))
    dist.all_reduce = real
    return _full(model), losses, per_step


def test_hsdp_on_two_nodes_of_two_equals_single_process():
    plan = optimize_3d(models.mlp(), "2x2xcpu", (models.batch("mlp", ROWS, 0)[0],),
                       measure=False, only=[Shape(1, 4, 1, 2, "1F1B")], pin=PIN)
    assert {l.name: (l.dp_shard, l.hsdp) for l in plan.layers if l.dp_shard} == {
        "0": (True, True), "2": (True, False), "4": (True, True)}
    assert plan.mesh.dp_shard_ranks == 2 and plan.microbatches == 2
    assert Plan.from_json(plan.to_json()) == plan
    assert "data_parallel +hsdp" in plan.explain()
    expected, expected_losses = _train_single("mlp")
    for rank, (params, losses, per_step) in enumerate(
            run_ranks(_train_counting, 4, plan.to_json())):
        assert losses == pytest.approx(expected_losses, rel=1e-5), f"rank {rank}"
        assert params.keys() == expected.keys()
        for key, value in params.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
        # one cross-node all-reduce per HSDP layer per step, not one per microbatch
        assert per_step == [2] * STEPS, f"rank {rank}"
