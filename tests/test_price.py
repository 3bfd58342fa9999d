"""One price list (planner.price): a 1-D plan is the 3-D shape pp = 1, dp = 1, tp = N, and
both planners price it alike, layer by layer, edge by edge and as a whole; mesh="auto"
compares two prices that agree on the shape both can express."""

import functools
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

import planner
from planner.choices import layer_choices
from planner.ilp import solve
from planner.plan3d import optimize_3d
from planner.profiled import profiled_graph
from planner.price import tp_context
from planner.search import CostCache, Shape, build
from planner.pipeline.stages import solve_stages
from zoo import SEQ, VOCAB, ZOO

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

# calibrated-looking fixed costs, so that the rules that add them are exercised
OVERHEADS = {"dtensor_reshard_overhead_s": 2e-4, "dtensor_layer_overhead_s": 1e-4,
             "step_overhead_s": 3e-3}


@functools.lru_cache(maxsize=None)
def _llama():
    """One instance, traced once for every device count (planner.profiled)."""
    return ZOO["llama"].make()


@functools.lru_cache(maxsize=None)
def _profiled(model: str, devices: str):
    if model == "gpt":  # torch.fx
        torch.manual_seed(0)
        m, inputs, _ = gpt.build(8, "cpu", layers=2, width=32, heads=2, seq=16, vocab=64)
        graph, cluster = profiled_graph(m, devices, inputs, measure=False)
    else:  # a tiny LlamaConfig, random init, torch.export; rows 16, not SEQ: a [SEQ, ...]
        # position table would be taken for rows (planner.price.batch_free_takes)
        ids = torch.randint(0, VOCAB, (16, SEQ), generator=torch.Generator().manual_seed(0))
        graph, cluster = profiled_graph(_llama(), devices, (ids,),
                                        {"use_cache": False}, measure=False)
    return graph, cluster.model_copy(update=OVERHEADS)


@pytest.mark.parametrize("model,devices", [("gpt", "4xcpu"), ("gpt", "2x4xcpu"),
                                           ("llama", "2xcpu"), ("llama", "2x4xcpu")])
def test_a_1d_plan_is_priced_as_the_3d_shape_pp1_dp1_tpN(model, devices):
    graph, cluster = _profiled(model, devices)
    n = cluster.num_devices
    one = layer_choices(graph, cluster, "adam", None, levers=False)
    three = build(CostCache(graph, cluster, "adam"), 1, 1, n, graph.batch_size)
    tied = {node for group in graph.tied_groups() for node in group}
    compared = 0
    for i, (row, node, opts) in enumerate(zip(one.layers, one.problem.nodes,
                                              three.problem.layers)):
        assert node.name == opts.name
        if row.layer.node in tied:  # a shared weight: each planner its own rule (ties)
            continue
        # the same options in the same order (one name may give several layouts)
        assert [o.strategy for o in node.options] == list(opts.strategies), row.layer.name
        assert [s.gives for s in row.strategies] == [s.gives for s in three.strategies[i]]
        for j, o in enumerate(node.options):
            assert opts.microbatch_s[j] + opts.step_s[j] == pytest.approx(o.time_s, rel=1e-12), (
                row.layer.name, o.strategy)
            assert opts.weight_bytes[j] + opts.activation_bytes[j] == pytest.approx(
                o.memory_bytes, rel=1e-12), (row.layer.name, o.strategy)
            compared += 1
    assert compared > len(graph.layers)  # more than one option per layer on average
    # the edges: the reshard overhead, the batch-free rule, the export rules, alike
    assert len(one.problem.edges) == len(three.problem.edges)
    for a, b in zip(one.problem.edges, three.problem.edges):
        assert (a.src, a.dst) == (b.src, b.dst)
        np.testing.assert_allclose(a.cost_s, b.cost_s, rtol=1e-12)
    # and so the optimum: the 1-D program and the stage program of that shape agree
    if not tied:
        flat_best = solve(one.problem, 60).objective_s
        staged = solve_stages(three.problem, 1, 1, "1F1B", None, 60, 1e-9)
        assert staged.times.step_s == pytest.approx(flat_best, rel=1e-6)


def test_auto_compares_two_prices_that_agree_on_the_shape_both_express():
    _, cluster = _profiled("gpt", "4xcpu")
    torch.manual_seed(0)
    m, inputs, _ = gpt.build(8, "cpu", layers=2, width=32, heads=2, seq=16, vocab=64)
    one = planner.optimize(m, cluster, inputs, measure=False, prefer_standard=0)
    # no memory pressure: the 1-D levers (fsdp, recompute) cost time and are not taken, so
    # the 1-D optimum is the optimum of its shape: pp 1, dp 1, tp 4, one microbatch
    assert not any(l.recompute or l.strategy == "fsdp" for l in one.layers)
    same = optimize_3d(m, cluster, inputs, measure=False, only=[Shape(1, 1, 4, 1, "1F1B")])
    t1 = one.predicted.step_time_s
    assert same.predicted.step_time_s == pytest.approx(t1, rel=1e-6)
    assert same.predicted.fixed_s == one.predicted.fixed_s == OVERHEADS["step_overhead_s"]
    # so "auto" weighs the 1-D plan against 3-D plans priced the same way
    auto = planner.optimize(m, cluster, inputs, measure=False, prefer_standard=0, mesh="auto")
    best3 = min(c.step_time_s for c in auto.search.best_per_shape if c.step_time_s)
    if auto.is_mesh_3d:
        assert auto.predicted.step_time_s == pytest.approx(best3) and best3 < 0.99 * t1
    else:
        assert auto.predicted.step_time_s == pytest.approx(t1) and best3 >= 0.99 * t1


def test_llamas_mlp_under_tp_runs_on_feature_shards_without_a_gather():
    """Llama's `down_proj(act_fn(gate_proj(x)) * up_proj(x))` under tensor parallelism, as
    torchtitan runs it: gate and up column-parallel, the SiLU and the product on each
    rank's feature shard, down row-parallel. The edges between them are priced free (no
    all-gather at the product), and the search takes that route."""
    graph, cluster = _profiled("llama", "2xcpu")
    built = build(CostCache(graph, cluster, "sgd"), 1, 1, 2, 1)  # one row per microbatch
    names = [l.name for l in built.problem.layers]
    mlp = "model.layers.0.mlp."
    node = {l.name: l.node for l in graph.layers}
    product = next(l for l in graph.layers if l.kind == "mul" and set(l.inputs) == {
        node[mlp + "act_fn"], node[mlp + "up_proj"]})
    assert product.attrs["between_modules"]
    route = [(mlp + "gate_proj", "column_parallel", mlp + "act_fn", "feature_parallel"),
             (mlp + "act_fn", "feature_parallel", product.name, "feature_parallel"),
             (mlp + "up_proj", "column_parallel", product.name, "feature_parallel"),
             (product.name, "feature_parallel", mlp + "down_proj", "row_parallel")]
    for src, s, dst, d in route:
        i, j = names.index(src), names.index(dst)
        edge = next(e for e in built.problem.edges if (e.src, e.dst) == (i, j))
        a, b = (list(built.problem.layers[k].strategies).index(x) for k, x in ((i, s), (j, d)))
        assert edge.cost_s[a, b] == 0.0, (src, dst)
        if built.problem.layers[j].strategies.count("replicate"):  # whole: a gather
            assert edge.cost_s[a, built.problem.layers[j].strategies.index("replicate")] > 0
    pin = {mlp + "gate_proj": "column_parallel", mlp + "up_proj": "column_parallel",
           mlp + "down_proj": "row_parallel"}
    plan = optimize_3d(_llama(), cluster, (torch.randint(0, VOCAB, (16, SEQ)),),
                       {"use_cache": False}, measure=False, only=[Shape(1, 1, 2, 16, "1F1B")],
                       pin=pin)
    chosen = {l.name: l.strategy for l in plan.layers}
    assert chosen[mlp + "act_fn"] == chosen[product.name] == "feature_parallel"


def test_blocking_collectives_are_priced_at_the_rhythm_of_the_models_layers():
    # planner.price.in_rhythm: with a measured gap curve, the links of a tp group carry the
    # compute between two blocking collectives (the layers' compute at 1/tp over those with
    # weights, for the rows priced); every 1-D option that issues them pays its latency
    # scaled by the curve there, DDP's options (bucketed gradient sync) do not move; no
    # curve, tp 1 or a core per process: no change. (This link has no fits: FSDP falls
    # back to all-gathers, blocking.)
    from planner.price import in_rhythm
    from strategies.catalog import compute_s
    from strategies.devices import GapCurve

    graph, flat = _profiled("gpt", "2xcpu")
    # 2 processes on 1 core: they time-share it
    flat = flat.model_copy(update={"cores": 1, "intra_node": flat.intra_node.model_copy(
        update={"latency_s": 5e-3, "collectives": {}})})
    # a fifth of the fits' latency right after a layer, the fits' own at their 6 ms
    curve = GapCurve(gaps_s=(1e-5, 6e-3), seconds=(0.2e-3, 1e-3))
    curved = flat.model_copy(update={"intra_node": flat.intra_node.model_copy(
        update={"gap_curve": curve})})
    assert in_rhythm(curved, graph, 1, graph.batch_size, "adam") is curved
    assert in_rhythm(flat, graph, 2, graph.batch_size, "adam") is flat
    own_cores = curved.model_copy(update={"cores": 2})
    assert in_rhythm(own_cores, graph, 2, graph.batch_size, "adam") is own_cores
    ctx = tp_context(curved, 2, graph.batch_size, "adam")
    layers = [layer for layer in graph.layers if not layer.is_input]
    gap = (sum(compute_s(layer, 0.5, ctx) for layer in layers)
           / sum(layer.param_bytes > 0 for layer in layers))
    for rows in (graph.batch_size, graph.batch_size // 2):
        paced = in_rhythm(curved, graph, 2, rows, "adam")
        assert paced.intra_node.blocking_gap_s == pytest.approx(gap * rows / graph.batch_size)
    before, after = (layer_choices(graph, c, "adam", None) for c in (flat, curved))
    cheaper = 0
    for old, new in zip(before.layers, after.layers):
        for strategy, a, b in zip(old.strategies, old.prices, new.prices):
            if strategy.name in ("data_parallel", "replicate"):
                assert b.time_s == a.time_s
            assert b.time_s <= a.time_s + 1e-12
            cheaper += b.time_s < a.time_s - 1e-6
    assert cheaper > 0
    assert any(s.name == "data_parallel" for row in before.layers for s in row.strategies)


def test_a_modules_output_is_handed_on_once_however_many_layers_read_it():
    # executor.modules changes a module's output to the rows its readers see in one forward
    # hook, whose backward runs once on their summed gradients: k readers of a replicated
    # output pay one change between them, not k (Llama's norms paid 2-3)
    from planner.price import EdgeKind, edge_cost
    from strategies.layouts import Layout

    graph, cluster = _profiled("llama", "2xcpu")
    one = layer_choices(graph, cluster, "adam", None, levers=False)
    cluster = one.context.cluster  # at the plans' rhythm, as the edges were priced
    rows = {r.layer.node: (i, r) for i, r in enumerate(one.layers)}
    checked = 0
    for node, (src, row) in rows.items():
        layer = row.layer
        gives = [i for i, s in enumerate(row.strategies) if s.gives == Layout.REPLICATE]
        if (layer.op != "call_module" or graph.readers(node) < 2 or not gives
                or not graph.carries_gradient(node)):
            continue
        edges = [e for e in one.problem.edges if e.src == src and e.dst < len(one.layers)]
        takes = [next((j for j, s in enumerate(one.layers[e.dst].strategies)
                       if s.takes == Layout.BATCH), None) for e in edges]
        if len(edges) != graph.readers(node) or None in takes:
            continue
        total = sum(e.cost_s[gives[0], j] for e, j in zip(edges, takes))
        alone = EdgeKind((Layout.REPLICATE,), (Layout.BATCH,), (False,), layer.output.nbytes,
                         2, graph.batch_size, True, "through_rows", True, readers=1)
        assert total == pytest.approx(edge_cost(alone, cluster)[0, 0]), layer.name
        assert total > 0
        checked += 1
    assert checked >= 2
