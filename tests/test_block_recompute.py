"""Whole-block activation checkpointing of a decoder's pipeline (planner.pipeline.block_recompute):
priced as keeping each block's input and running its forward again, chosen by the 3-D
search only where memory binds, and run by executor.hf_stages under
torch.utils.checkpoint with the same training result as one process."""

import json
import time

import numpy as np
import pytest
import torch

import executor
from distributed import run_ranks
from planner.pipeline.block_recompute import recompute_blocks
from planner.plan import Plan
from planner.plan3d import plan_3d
from planner.search import CostCache, Shape, build, search
from planner.pipeline.stages import brute_force, in_flight, solve_stages
from strategies.memory import recompute_s
from test_hf_pipeline import MODELS, STEPS, LR, _assert_equal_to_one_process, _profiled

PIPELINE = Shape(2, 1, 1, 2, "1F1B")
RECOMPUTED = Shape(2, 1, 1, 2, "1F1B", recompute=True)


def test_a_block_keeps_its_input_and_runs_its_forward_again():
    graph, cluster = _profiled("llama4", 2)
    rows = graph.batch_size // 2
    plain = build(CostCache(graph, cluster, "sgd"), 2, 1, 1, rows)
    priced = recompute_blocks(plain, graph)
    hidden_bytes = rows * 8 * 32 * 4  # rows x sequence x width, fp32: the block's input
    largest = 0.0
    for u, name in enumerate(plain.problem.units):
        members = [i for i, l in enumerate(plain.problem.layers) if l.unit == u]
        # a block's layers: each plain option, then the same recomputed
        again = [len(plain.problem.layers[i].strategies) if name in graph.blocks else 0
                 for i in members]
        before = sum(float(plain.problem.layers[i].activation_bytes[0]) for i in members)
        after = sum(float(priced.problem.layers[i].activation_bytes[r])
                    for i, r in zip(members, again))
        extra_s = sum(float(priced.problem.layers[i].microbatch_s[r]
                            - plain.problem.layers[i].microbatch_s[0])
                      for i, r in zip(members, again))
        if name in graph.blocks:
            forward_s = sum(recompute_s(plain.layers[i], plain.costs[i][0].compute_s)
                            for i in members)
            assert after == hidden_bytes and before > 4 * hidden_bytes, name
            assert extra_s == pytest.approx(forward_s, rel=1e-12) and forward_s > 0
            assert all(priced.problem.layers[i].strategies[r].endswith("+recompute")
                       and priced.problem.layers[i].plain_index(r) == 0
                       for i, r in zip(members, again))
            largest = max(largest, before)
        else:  # the embeddings and the head keep theirs, with no variants
            assert after == before and extra_s == 0
            assert all(priced.problem.layers[i].recomputed is None for i in members)
    assert priced.transient_bytes == largest


def _subset_budget(graph, cluster):
    """(stage problem of pp 2, m 2 with recompute offered, a budget per device under
    which recomputing some blocks but not all is fastest)."""
    rows = graph.batch_size // 2
    problem = recompute_blocks(build(CostCache(graph, cluster, "sgd"), 2, 1, 1, rows),
                               graph).problem
    free = brute_force(problem, 2, 2, "1F1B", None)
    return problem, 0.8 * max(free[0].memory_bytes)


def test_the_solve_picks_which_blocks_to_recompute_as_brute_force():
    """4 blocks on 2 stages: every cut and every subset of blocks recomputed, by
    enumeration, against the stage program; the tight budget makes a subset fastest."""
    graph, cluster = _profiled("llama4", 2)
    problem, budget = _subset_budget(graph, cluster)
    for limit in (None, 1.1 * budget, budget, 0.9 * budget):
        expected = brute_force(problem, 2, 2, "1F1B", limit)
        solved = solve_stages(problem, 2, 2, "1F1B", limit, method="mip")
        assert problem.consistent(solved.choice)
        assert solved.times.objective_s == pytest.approx(expected[0].objective_s, rel=1e-9)
        if limit is not None:
            assert max(solved.times.memory_bytes) <= limit * (1 + 1e-9)
    expected = brute_force(problem, 2, 2, "1F1B", budget)
    assert 0 < len(problem.recomputed_units(expected[2])) < 4  # some blocks, not all
    assert brute_force(problem, 2, 2, "1F1B", None)[0].objective_s < expected[0].objective_s
    # and one stage (planner.ilp has no rows linking a block: the stage program solves it)
    whole = max(brute_force(problem, 1, 2, "1F1B", None)[0].memory_bytes)
    subsets = set()
    for limit in (0.95 * whole, 0.9 * whole, 0.85 * whole):
        expected = brute_force(problem, 1, 2, "1F1B", limit)
        solved = solve_stages(problem, 1, 2, "1F1B", limit)
        assert solved.times.objective_s == pytest.approx(expected[0].objective_s, rel=1e-9)
        assert problem.consistent(solved.choice)
        subsets.add(len(problem.recomputed_units(solved.choice)))
    assert subsets & {1, 2, 3}, subsets


def test_every_block_recomputed_is_the_brute_force_of_all_blocks_recomputed():
    """A job's "full" checkpointing (Shape.recompute_all): every block recomputed whatever
    memory needs, and the best such plan: brute force over the choices that recompute all
    four blocks, on one and two stages, by the program and the fast exact solvers."""
    graph, cluster = _profiled("llama4", 2)
    rows = graph.batch_size // 2
    plain = build(CostCache(graph, cluster, "sgd"), 2, 1, 1, rows)
    offered = recompute_blocks(plain, graph).problem
    every = recompute_blocks(plain, graph, every=True)
    assert not every.problem.linked_units()  # nothing left to link: the solve cannot choose
    for pp in (1, 2):
        free = brute_force(offered, pp, 2, "1F1B", None)
        expected = min((t for t in _all_recomputed(offered, pp)), key=lambda t: t.objective_s)
        assert free[0].objective_s < expected.objective_s  # recompute costs a forward
        for method in ("auto", "mip"):
            solved = solve_stages(every.problem, pp, 2, "1F1B", None, method=method)
            assert len(every.problem.recomputed_units(solved.choice)) == 4
            assert solved.times.objective_s == pytest.approx(expected.objective_s, rel=1e-9)
    plan = plan_3d(graph, cluster, "sgd", 1e15, time.perf_counter(),
                   only=[Shape(2, 1, 1, 2, "1F1B", recompute=True, recompute_all=True)])
    assert sorted(plan.recompute_blocks) == sorted(graph.blocks)


def _all_recomputed(problem, pp):
    """Each cut's best with every block recomputed, by enumeration."""
    import itertools

    from planner.pipeline.stages import evaluate
    options = [range(len(l.strategies)) if l.recomputed is None
               else np.flatnonzero(l.recomputed) for l in problem.layers]
    for cuts in itertools.combinations(range(1, len(problem.units)), pp - 1):
        for choice in itertools.product(*options):
            yield evaluate(problem, (0, *cuts), choice, 2, "1F1B")


def test_the_plan_counts_kept_inputs_in_flight_and_one_block_live_in_backward():
    graph, cluster = _profiled("llama4", 2)
    problem, budget = _subset_budget(graph, cluster)
    rows = graph.batch_size // 2
    built = recompute_blocks(build(CostCache(graph, cluster, "sgd"), 2, 1, 1, rows), graph)
    plan = plan_3d(graph, cluster, "sgd", budget + built.transient_bytes, time.perf_counter(),
                   only=[RECOMPUTED])
    assert 0 < len(plan.recompute_blocks) < 4, plan.recompute_blocks
    assert set(plan.recompute_blocks) <= set(graph.blocks)
    assert f"Activation checkpointing: {len(plan.recompute_blocks)} transformer blocks" \
        in plan.explain()
    stage_of = {l.name: l.stage for l in plan.layers}
    holding = {stage_of[l.name] for l, o in zip(graph.layers, built.problem.layers)
               if built.problem.units[o.unit] in plan.recompute_blocks}
    for r, memory in enumerate(plan.predicted.memory_breakdown):
        kept = sum(float(o.activation_bytes[
            1 if built.problem.units[o.unit] in plan.recompute_blocks else 0])
            * in_flight("1F1B", 2, 2, r)
            for l, o in zip(graph.layers, built.problem.layers)
            if stage_of.get(l.name, 0) == r)
        assert memory.activations_bytes == pytest.approx(
            kept + (built.transient_bytes if r in holding else 0.0))
    assert Plan.from_json(plan.to_json()).recompute_blocks == plan.recompute_blocks
    # a plan file from before: true was every block
    old = Plan.from_json(json.dumps({**json.loads(plan.to_json()), "recompute_blocks": True}))
    assert all(old.recomputes_block(b) for b in graph.blocks)


def test_the_search_checkpoints_blocks_only_where_memory_binds():
    graph, cluster = _profiled("llama4", 2)
    free = search(graph, cluster, "sgd", None, time_limit_s=20)
    assert not free.best.shape.recompute  # one more forward, and nothing to save memory for
    assert any(c.shape.recompute for c in free.candidates)
    plain = free.built
    fastest_bytes = max(free.best.solution.times.memory_bytes)
    # below the plain plans' memory at pp 2, m 2: checkpointing is the way to fit there
    pinned = search(graph, cluster, "sgd", None, only=[PIPELINE], time_limit_s=20)
    budget = 0.8 * max(pinned.best.solution.times.memory_bytes)
    tight = search(graph, cluster, "sgd", budget, time_limit_s=20)
    best = tight.best
    assert best.shape.recompute, best.shape
    assert tight.built.problem.recomputed_units(best.solution.choice)
    assert max(best.solution.times.memory_bytes) + tight.built.transient_bytes <= budget
    assert budget < fastest_bytes and plain.transient_bytes == 0
    for c in tight.candidates:  # every plain shape does not fit, or is slower
        if not c.shape.recompute and c.solution is not None:
            assert c.solution.times.step_s >= best.solution.times.step_s


def _train_recomputed(rank, world, plan_json):
    """This rank's parameters, losses, and how many of its modules run checkpointed."""
    plan = Plan.from_json(plan_json)
    entry = MODELS["llama4"]
    model = executor.parallelize(entry.make(), plan)
    opt = torch.optim.SGD(list(model.parameters()), lr=LR, foreach=False)
    losses = [executor.train_step(model, plan, entry.batch(step), entry.loss, opt)
              for step in range(STEPS)]
    checkpointed = sum(getattr(m.forward, "__name__", "") == "recomputed"
                       for chunk in model.chunks for m in chunk.modules())
    return ({k: p.detach().clone() for k, p in model.stage.named_parameters()}, losses,
            checkpointed)


def test_checkpointed_blocks_in_two_stages_train_as_one_process():
    """The plan of the brute-force instance above: some blocks checkpointed, not all."""
    graph, cluster = _profiled("llama4", 2)
    problem, budget = _subset_budget(graph, cluster)
    transient = recompute_blocks(build(CostCache(graph, cluster, "sgd"), 2, 1, 1,
                                       graph.batch_size // 2), graph).transient_bytes
    plan = plan_3d(graph, cluster, "sgd", budget + transient, time.perf_counter(),
                   only=[RECOMPUTED])
    results = run_ranks(_train_recomputed, 2, plan.to_json())
    blocks = [sum(m in plan.recompute_blocks for m in s.modules) for s in plan.pipeline.stages]
    assert 0 < sum(blocks) < 4
    assert [checkpointed for _, _, checkpointed in results] == blocks
    _assert_equal_to_one_process("llama4", plan, [(p, l) for p, l, _ in results])


def test_the_stage_programs_start_is_the_fastest_fitting_cut_by_brute_force():
    """planner.pipeline.stages.balanced_cut, the start that lets deep pipelines under a tight budget
    (Llama 3 70B at pp 32) find a plan: the cut of least slowest-stage time that fits."""
    import itertools

    from planner.pipeline.stages import balanced_cut
    graph, cluster = _profiled("llama4", 2)
    problem = recompute_blocks(build(CostCache(graph, cluster, "sgd"), 3, 1, 1, 1),
                               graph).problem
    U, pp, m = len(problem.units), 3, 3
    per_unit = [[0.0, 0.0, 0.0] for _ in range(U)]  # time, weights, activations
    for layer in problem.layers:
        memory = layer.weight_bytes + layer.activation_bytes
        if layer.recomputed is not None:  # a block: the start recomputes it whole
            memory = np.where(layer.recomputed, memory, np.inf)
        c = int(memory.argmin())
        for j, v in enumerate((layer.microbatch_s, layer.weight_bytes, layer.activation_bytes)):
            per_unit[layer.unit][j] += float(v[c])

    def priced(starts):
        bounds = [*starts, U]
        spans = [per_unit[bounds[k]:bounds[k + 1]] for k in range(pp)]
        memory = max(sum(w for _, w, _ in s) + in_flight("1F1B", pp, m, k) *
                     sum(a for _, _, a in s) for k, s in enumerate(spans))
        return max(sum(t for t, _, _ in s) for s in spans), memory

    cuts = [(0, *c) for c in itertools.combinations(range(1, U), pp - 1)]
    budget = sorted(priced(c)[1] for c in cuts)[len(cuts) // 3]
    fitting = [c for c in cuts if priced(c)[1] <= budget]
    starts, _ = balanced_cut(problem, pp, m, "1F1B", budget)
    assert priced(starts)[1] <= budget
    assert priced(starts)[0] == pytest.approx(min(priced(c)[0] for c in fitting), rel=1e-9)
    assert balanced_cut(problem, pp, m, "1F1B", 0.5 * min(priced(c)[1] for c in cuts)) is None
