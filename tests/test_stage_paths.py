"""The every-cut bound of short chunked pipelines (planner.pipeline.stage_paths): the action graph's
longest path is the simulated makespan, for every schedule; the bound is below the
simulated step of every cut and choice (brute force on random problems, the replayed
prologue and the split backward included), equals the best of them where each layer has
one option, and is offered only while the cuts are few."""

import itertools
from dataclasses import replace

import numpy as np
import pytest

from planner.pipeline import schedules
from planner.pipeline.stage_paths import MAX_CUTS, cut_count, makespans, path_bound
from planner.pipeline.stages import LayerOptions, evaluate
from test_pipeline_search import _random_problem

CHUNKED = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


@pytest.mark.parametrize("schedule", CHUNKED)
def test_the_longest_path_is_the_simulated_makespan(schedule):
    rng = np.random.default_rng(7)
    for pp in (2, 3, 4):
        for m in (1, 2, 4, 6, 8):
            if schedules.refusal(schedule, pp, 2, m) is not None:
                continue
            times = rng.uniform(0.05, 2.0, (40, 2 * pp))
            times[:5] = rng.choice([0.0, 1.0], (5, 2 * pp))  # ties and empty stages
            for forward in (1 / 3, 0.5):  # the forward's share of a stage's time
                simulated = [schedules.price(schedule, pp, 2, m, row, forward=forward)
                             .makespan_s for row in times]
                np.testing.assert_allclose(makespans(schedule, pp, 2, m, times, forward),
                                           simulated, rtol=1e-12, atol=1e-12)


def _steps(problem, pp, m, schedule):
    """Every cut and choice's simulated step (evaluate: the cost model, plainly)."""
    return [evaluate(problem, (0, *cuts), choice, m, schedule, 2).step_s
            for cuts in itertools.combinations(range(1, len(problem.units)), 2 * pp - 1)
            for choice in itertools.product(*(range(len(l.strategies))
                                              for l in problem.layers))]


@pytest.mark.parametrize("seed", range(4))
def test_below_every_simulated_step_and_exact_with_one_option_per_layer(seed):
    rng = np.random.default_rng(900 + seed)
    problem = _random_problem(rng, units=6, layers=7, max_choices=250)
    problem = replace(problem, replay_s=0.05 * seed, split_backward=1.0 + 0.1 * seed)
    single = replace(problem, layers=tuple(
        LayerOptions(l.name, l.unit, l.strategies[:1], l.microbatch_s[:1], l.step_s[:1],
                     l.weight_bytes[:1], l.activation_bytes[:1]) for l in problem.layers),
        edges=tuple(replace(e, cost_s=np.asarray(e.cost_s)[:1, :1]) for e in problem.edges))
    for schedule in CHUNKED:
        for pp, m in ((2, 2), (2, 4), (3, 6)):
            if 2 * pp > len(problem.units) or schedules.refusal(schedule, pp, 2, m):
                continue
            bound = path_bound(problem, pp, m, schedule, 2)
            assert bound <= min(_steps(problem, pp, m, schedule)) * (1 + 1e-9), (schedule, pp)
            # one option per layer: the least times are the times, the bound the optimum
            assert path_bound(single, pp, m, schedule, 2) == pytest.approx(
                min(_steps(single, pp, m, schedule)), rel=1e-9), (schedule, pp, m)


def test_offered_only_while_the_cuts_are_few():
    assert cut_count(50, 4) == 18424 <= MAX_CUTS
    assert cut_count(50, 8) > MAX_CUTS
    rng = np.random.default_rng(3)
    problem = _random_problem(rng, units=4, layers=4)
    many = replace(problem, units=tuple(f"u{u}" for u in range(60)))  # counts only
    assert path_bound(many, 4, 8, "Interleaved1F1B", 2) is None
    assert path_bound(problem, 3, 6, "Interleaved1F1B", 2) == float("inf")  # 6 stages, 4 units
