"""The dynamic programs for one stage per rank (planner.pipeline.stage_dp, and its stage intervals
priced once: planner.pipeline.stage_intervals) find the integer program's optimum: equal objectives against brute force and against the stage MIP on
random instances (edges across units, budgets that bind, cut transfers)."""

import numpy as np
import pytest

from planner.pipeline import stage_dp, stage_intervals
from planner.problem import Edge
from planner.pipeline.stages import (
    LayerOptions, StageProblem, brute_force, brute_force_budgets, evaluate, in_flight,
    solve_stages,
)
from test_pipeline_search import _random_problem


def _repeated_problem(rng, blocks=5) -> StageProblem:
    """A head, `blocks` identical blocks of three layers (the inner Pareto set reused),
    and a tail, with edges between neighbouring blocks."""
    def options(k):
        return (rng.uniform(0.1, 1.0, k), rng.uniform(0.0, 0.3, k),
                rng.uniform(1e8, 1e9, k), rng.uniform(1e7, 4e8, k))
    block = [options(int(rng.integers(1, 4))) for _ in range(3)]
    inner = [rng.uniform(0, 0.3, (len(block[i][0]), len(block[i + 1][0]))) for i in range(2)]
    across = rng.uniform(0, 0.3, (len(block[2][0]), len(block[0][0])))
    layers = [LayerOptions("head", 0, ("a", "b"), *options(2))]
    edges = []
    for b in range(blocks):
        for j in range(3):
            layers.append(LayerOptions(f"b{b}.{j}", b + 1, tuple(f"s{i}" for i in
                                       range(len(block[j][0]))), *block[j]))
        base = 1 + 3 * b
        edges += [Edge(base, base + 1, inner[0]), Edge(base + 1, base + 2, inner[1])]
        if b:
            edges.append(Edge(base - 1, base, across))
    layers.append(LayerOptions("tail", blocks + 1, ("t",), *options(1)))
    edges.append(Edge(0, 1, rng.uniform(0, 0.3, (2, len(block[0][0])))))
    edges.append(Edge(0, len(layers) - 1, rng.uniform(0, 0.3, (2, 1))))  # skips units
    edges.append(Edge(len(layers) - 2, len(layers) - 1, rng.uniform(0, 0.3,
                                                                    (len(block[2][0]), 1))))
    cut = tuple(float(x) for x in rng.uniform(0, 0.2, blocks + 2))
    return StageProblem(tuple(layers), tuple(edges), tuple(f"u{u}" for u in range(blocks + 2)),
                        cut)


@pytest.mark.parametrize("seed", range(4))
def test_dp_equals_brute_force_random(seed):
    rng = np.random.default_rng(100 + seed)
    p = _random_problem(rng, units=5, layers=6)
    for pp in range(2, len(p.units) + 1):
        for m, schedule in [(3, "1F1B"), (pp, "1F1B"), (2, "GPipe")]:
            _check_against_brute_force(stage_dp.solve, p, pp, m, schedule)


def _check_against_brute_force(solve, p, pp: int, m: int, schedule: str, priced=False):
    """`solve`'s optimum equals brute force with no budget and two that bind; with
    `priced`, the plan it returns is priced by evaluate() at its objective and fits."""
    loose = brute_force(p, pp, m, schedule, None)
    flights = [in_flight(schedule, pp, m, k) for k in range(pp)]
    tight = [0.9 * max(loose[0].memory_bytes), 0.6 * max(loose[0].memory_bytes)]
    found = [loose, *brute_force_budgets(p, pp, m, schedule, tight)]
    for budget, expected in zip([None, *tight], found):
        got = solve(p, pp, m, flights, budget)
        if expected is None:
            assert got is None
            continue
        assert got is not None, (pp, m, schedule, budget)
        assert got.objective_s == pytest.approx(expected[0].objective_s, rel=1e-9)
        if priced:
            times = evaluate(p, got.starts, got.choice, m, schedule)
            assert times.objective_s == pytest.approx(got.objective_s, rel=1e-9)
            if budget is not None:
                assert max(times.memory_bytes) <= budget * (1 + 1e-9)


@pytest.mark.parametrize("seed", range(2))
def test_dp_equals_stage_mip_on_repeated_blocks(seed):
    """The dynamic program equals the stage MIP (SCIP), and the assignment it returns is
    priced by evaluate() at the objective it claims, within the budget."""
    rng = np.random.default_rng(200 + seed)
    p = _repeated_problem(rng)
    for pp in (2, 4):
        for m, schedule in [(4, "1F1B"), (3, "GPipe")]:
            loose = solve_stages(p, pp, m, schedule, None, method="mip")
            for budget in [None, 0.8 * max(loose.times.memory_bytes),
                           0.5 * max(loose.times.memory_bytes)]:
                mip = (loose if budget is None
                       else solve_stages(p, pp, m, schedule, budget, method="mip"))
                flights = [in_flight(schedule, pp, m, k) for k in range(pp)]
                dp = stage_dp.solve(p, pp, m, flights, budget)  # no deadline: no fallback
                if mip is None:
                    assert dp is None
                    continue
                assert mip.status == "optimal"
                assert dp.objective_s == pytest.approx(mip.times.objective_s, rel=1e-7)
                times = evaluate(p, dp.starts, dp.choice, m, schedule)
                assert times.objective_s == pytest.approx(dp.objective_s, rel=1e-9)
                if budget is not None:
                    assert max(times.memory_bytes) <= budget * (1 + 1e-9)


def test_dp_cutoff_returns_none_when_nothing_beats_it():
    rng = np.random.default_rng(7)
    p = _repeated_problem(rng)
    best = solve_stages(p, 3, 6, "1F1B", None)
    assert solve_stages(p, 3, 6, "1F1B", None, cutoff_s=best.times.step_s * 0.5) is None
    again = solve_stages(p, 3, 6, "1F1B", None, cutoff_s=best.times.step_s * 1.01)
    assert again.times.objective_s == pytest.approx(best.times.objective_s)


@pytest.mark.parametrize("seed", range(2))
def test_intervals_equal_brute_force(seed):
    """Stage intervals priced once equal brute force: random units and edges across them,
    and identical blocks (intervals shared by their signatures), budgets that bind; the
    plan returned is priced by evaluate() at its objective and fits."""
    rng = np.random.default_rng(300 + seed)
    for p in (_random_problem(rng, units=5, layers=6), _repeated_problem(rng, blocks=2)):
        for pp in range(2, min(4, len(p.units)) + 1):
            for m, schedule in [(3, "1F1B"), (2, "GPipe")]:
                _check_against_brute_force(stage_intervals.solve, p, pp, m, schedule,
                                           priced=True)


def test_intervals_equal_stage_mip_on_deeper_blocks():
    """Eight identical blocks at pp 4 (where stage_dp's labels ran out on a GPT): the
    intervals' optimum equals the stage MIP's, with a binding budget."""
    rng = np.random.default_rng(400)
    p = _repeated_problem(rng, blocks=8)
    loose = solve_stages(p, 4, 6, "1F1B", None, method="mip")
    for budget in [None, 0.7 * max(loose.times.memory_bytes)]:
        mip = loose if budget is None else solve_stages(p, 4, 6, "1F1B", budget, method="mip")
        flights = [in_flight("1F1B", 4, 6, k) for k in range(4)]
        got = stage_intervals.solve(p, 4, 6, flights, budget)
        if mip is None:
            assert got is None
            continue
        assert mip.status == "optimal"
        assert got.objective_s == pytest.approx(mip.times.objective_s, rel=1e-7)


@pytest.mark.parametrize("seed", range(2))
def test_every_solver_prices_the_stages_replay(seed):
    """A torch.export model's later stages each recompute the values that depend on
    positions alone (StageProblem.replay_s): the dynamic program, the stage intervals and
    the stage MIP (one chunk and interleaved) all equal brute force over the cuts with it,
    and evaluate() charges it to every stage but the first."""
    from dataclasses import replace

    rng = np.random.default_rng(500 + seed)
    plain = _random_problem(rng, units=5, layers=6)
    p = replace(plain, replay_s=0.4)
    for pp in (2, 3):
        for m, schedule in [(3, "1F1B"), (2, "GPipe")]:
            _check_against_brute_force(stage_dp.solve, p, pp, m, schedule, priced=True)
            _check_against_brute_force(stage_intervals.solve, p, pp, m, schedule,
                                       priced=True)
            best, starts, choice = brute_force(p, pp, m, schedule, None)
            without = evaluate(plain, starts, choice, m, schedule)
            assert best.microbatch_s[0] == pytest.approx(without.microbatch_s[0])
            assert best.microbatch_s[1:] == pytest.approx(
                [t + 0.4 for t in without.microbatch_s[1:]])
            mip = solve_stages(p, pp, m, schedule, None, method="mip")
            assert mip.status == "optimal"
            assert mip.times.objective_s == pytest.approx(best.objective_s, rel=1e-7)
    for schedule in ("Interleaved1F1B", "ZBVZeroBubble"):
        mip = solve_stages(p, 2, 4, schedule, None, method="mip", chunks=2)
        expected = brute_force(p, 2, 4, schedule, None, chunks=2)[0]
        assert mip.times.objective_s == pytest.approx(expected.objective_s, rel=1e-7)


def test_zero_bubble_schedules_price_the_split_backward():
    """StageProblem.split_backward lengthens every layer's per-microbatch time under the
    schedules that split the backward (torch's stage_backward_input, then
    stage_backward_weight), and only there: evaluate() equals it on the problem scaled by
    hand, the other schedules are priced as before, and the stage MIP equals brute force
    on it."""
    from dataclasses import replace

    rng = np.random.default_rng(600)
    plain = _random_problem(rng, units=5, layers=6)
    p = replace(plain, split_backward=1.3)
    by_hand = replace(plain, layers=tuple(replace(l, microbatch_s=l.microbatch_s * 1.3)
                                          for l in plain.layers))
    starts, choice = (0, 1, 2, 3), [0] * len(p.layers)
    for schedule in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        got = evaluate(p, starts, choice, 4, schedule, chunks=2)
        assert got.step_s == pytest.approx(evaluate(by_hand, starts, choice, 4, schedule,
                                                    chunks=2).step_s)
        assert got.step_s > evaluate(plain, starts, choice, 4, schedule, chunks=2).step_s
    for schedule in ("Interleaved1F1B",):
        assert evaluate(p, starts, choice, 4, schedule, chunks=2) == evaluate(
            plain, starts, choice, 4, schedule, chunks=2)
    mip = solve_stages(p, 2, 4, "InterleavedZeroBubble", None, method="mip", chunks=2)
    expected = brute_force(p, 2, 4, "InterleavedZeroBubble", None, chunks=2)[0]
    assert mip.times.objective_s == pytest.approx(expected.objective_s, rel=1e-7)
    assert mip.status == "optimal"
    assert mip.times.step_s == pytest.approx(evaluate(
        by_hand, mip.starts, mip.choice, 4, "InterleavedZeroBubble", chunks=2).step_s)
