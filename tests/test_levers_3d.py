"""The memory levers inside the 3-D search: FSDP over the dp group as a per-layer option.

Pricing: the sharded variant of an option keeps 1/dp of its weights, gradients and optimizer
state, trades the per-step all-reduce for a reduce-scatter and two all-gathers per
microbatch (planner.dp_shard). Execution: FSDP2 beside DTensor tensor parallelism (dp x tp)
and inside a pipeline (pp x dp) after 3 SGD steps equals one process."""

import pytest
import torch

import models
from planner.search import CostCache, Shape, build, group_link
from profiler import profile, trace
from strategies.catalog import CostContext, weights_memory
from strategies.memory import fsdp_copies_s
from strategies.overlap import exposed_s, forward_share
from strategies.parse import parse_devices
from strategies.collectives import all_gather_s, collective_bytes, reduce_scatter_s
from test_pipeline_equivalence import _check


def _built(dp, tp, rows=8):
    graph = profile(trace(models.mlp(), (torch.randn(16, 16),)), measure=False)
    cluster = parse_devices(f"{dp * tp}xA100-80GB")
    cache = CostCache(graph, cluster, "adam")
    # the cluster as the search priced it: on GPUs with the graph's overlap cover
    return build(cache, 1, dp, tp, rows), cache.rhythm(tp, rows), graph


def test_sharded_option_keeps_one_dp_th_of_the_weights_and_reduce_scatters():
    built, cluster, graph = _built(dp=4, tp=1)
    i = next(i for i, l in enumerate(built.problem.layers) if l.name == "2")
    layer = built.problem.layers[i]  # Linear(32, 32)
    base = layer.strategies.index("data_parallel")
    sharded = layer.strategies.index("data_parallel+fsdp")
    source = next(l for l in graph.layers if l.name == "2")
    param = source.param_bytes
    link = group_link(cluster, 4)
    ctx = CostContext(cluster=cluster, ranks=1, batch=8, optimizer="adam")
    # weights, gradients and optimizer state: 1/dp; on a GPU with foreach AdamW, the
    # step's fp32 temporary of each local parameter beside them (summed_temp_bytes)
    assert built.local_param_bytes[i][sharded] == pytest.approx(param / 4)
    assert layer.weight_bytes[base] == pytest.approx(weights_memory(param, ctx) + param)
    # FSDP2 keeps no low-precision copy of the weights beside the fp32 shard
    assert layer.weight_bytes[sharded] == pytest.approx(
        weights_memory(param / 4, ctx, sharded=True) + param / 4)
    assert layer.weight_bytes[sharded] <= layer.weight_bytes[base] / 4
    # per microbatch: + 2 all-gathers + a reduce-scatter of the weights over dp
    # (gathered in the compute dtype, reduced in the gradient dtype: strategies.precision),
    # on a GPU what they take past the layer's compute beside them (strategies.overlap)
    gather = all_gather_s(ctx.precision.gather_bytes(param), 4, link)
    scatter = reduce_scatter_s(ctx.precision.reduce_bytes(param), 4, link)
    assert cluster.overlap_cover is not None
    extra = (exposed_s(gather, gather + scatter, layer.microbatch_s[base],
                       forward_share(source.fwd_flops, source.bwd_flops),
                       cluster.overlap_cover)
             + fsdp_copies_s(param, 4, link, ctx))
    assert fsdp_copies_s(param, 4, link, ctx) < extra <= 2 * gather + scatter + fsdp_copies_s(
        param, 4, link, ctx)
    assert layer.microbatch_s[sharded] - layer.microbatch_s[base] == pytest.approx(extra)
    # per step: no all-reduce left; a reduce-scatter sends half an all-reduce's bytes
    assert layer.step_s[sharded] < layer.step_s[base]
    assert collective_bytes("reduce_scatter", param, 4) == pytest.approx(
        collective_bytes("all_reduce", param, 4) / 2)
    assert built.sharded[i][sharded] and not built.sharded[i][base]


def test_no_sharded_option_without_a_dp_group_or_for_rows_split_over_tp():
    built, _, _ = _built(dp=1, tp=4, rows=16)
    assert not any(n.endswith("+fsdp") for l in built.problem.layers for n in l.strategies)
    built, _, _ = _built(dp=2, tp=2)
    names = next(l for l in built.problem.layers if l.name == "2").strategies
    assert "column_parallel+fsdp" in names and "row_parallel+fsdp" in names
    assert "data_parallel+fsdp" not in names  # its gradients are summed over dp x tp


def test_fsdp_beside_tensor_parallel_equals_single_process():
    plan = _check("mlp", Shape(1, 2, 2, 2, "1F1B"),
                  pin={"0": "column_parallel+fsdp", "2": "row_parallel+fsdp",
                       "4": "replicate+fsdp"})
    sharded = {l.name for l in plan.layers if l.dp_shard}
    assert sharded == {"0", "2", "4"}
    assert "column_parallel +fsdp" in plan.explain()  # the dry run shows the lever


def test_fsdp_inside_a_pipeline_equals_single_process():
    plan = _check("mlp", Shape(2, 2, 1, 2, "1F1B"),
                  pin={"0": "data_parallel+fsdp", "4": "data_parallel+fsdp",
                       "2": "data_parallel"})
    assert {l.name for l in plan.layers if l.dp_shard} == {"0", "4"}
    assert plan.pipeline is not None
