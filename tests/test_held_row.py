"""The second memory row (planner.pipeline.held_row): the search's bounds that read it stay
below every plan that fits both rows (brute force on small problems), and raise the bound
where FSDP's backward is what does not fit; and the busiest rank's dynamic program with
each rank's memory row (stage_loads.busiest_rank_bound)."""

import itertools
import math

import numpy as np
import pytest

from planner.pipeline import held_row
from planner.pipeline.schedules import refusal
from planner.pipeline.stage_loads import busiest_rank_bound, memory_bound
from planner.pipeline.stage_paths import relaxed_path_bound
from planner.pipeline.stages import (
    LayerOptions,
    StageProblem,
    evaluate,
    in_flight,
    lower_bound,
    stage_ranks,
)
from planner.problem import Edge


def _random_problem(rng, units: int = 5, layers: int = 6, max_choices: int = 150):
    """A small stage problem whose options carry optimizer temporaries inside their weights
    and, for some, an FSDP group's gathered bytes as large as a few layers' weights."""
    unit_of = np.minimum(np.sort(rng.integers(0, units, size=layers)), np.arange(layers))
    unit_of = np.searchsorted(np.unique(unit_of), unit_of).tolist()
    opts, choices = [], 1
    for i in range(layers):
        k = max(1, min(int(rng.integers(1, 4)), max_choices // choices))
        choices *= k
        weights = rng.uniform(1e8, 1e9, k)
        gathered = np.where(rng.random(k) < 0.5, rng.uniform(1e8, 2e9, k), 0.0)
        opts.append(LayerOptions(f"l{i}", unit_of[i], tuple(f"s{j}" for j in range(k)),
                                 rng.uniform(0.1, 1.0, k), rng.uniform(0.0, 0.3, k),
                                 weights, rng.uniform(1e7, 4e8, k),
                                 temp_bytes=weights * rng.uniform(0.0, 0.3, k),
                                 gathered_bytes=gathered))
    edges = [Edge(d - 1, d, rng.uniform(0, 0.5, (len(opts[d - 1].strategies),
                                                 len(opts[d].strategies))))
             for d in range(1, layers)]
    n_units = max(unit_of) + 1
    return StageProblem(tuple(opts), tuple(edges), tuple(f"u{u}" for u in range(n_units)),
                        tuple(float(x) for x in rng.uniform(0, 0.2, n_units)),
                        forward_share=float(rng.choice((1 / 3, 0.25, 0.55))))


def _plans(p: StageProblem, pp: int, m: int, schedule: str, chunks: int):
    """(step, the fullest rank by the stage rows, by the second row) of every cut and
    choice."""
    S = pp * chunks
    ranks = stage_ranks(schedule, pp, chunks)
    flights = [in_flight(schedule, pp, m, k, chunks) for k in range(S)]
    for cuts in itertools.combinations(range(1, len(p.units)), S - 1):
        starts = (0, *cuts, len(p.units))
        stage_of_unit = [k for k in range(S) for _ in range(starts[k], starts[k + 1])]
        stage = [stage_of_unit[l.unit] for l in p.layers]
        for choice in itertools.product(*(range(len(l.strategies)) for l in p.layers)):
            t = evaluate(p, starts[:-1], choice, m, schedule, chunks)
            second = max(held_row.rank_bytes(
                p, choice, [i for i in range(len(p.layers)) if ranks[stage[i]] == r],
                [flights[k] for k in stage]) for r in range(pp))
            yield t.step_s, max(t.memory_bytes), second


SHAPES = [(1, "1F1B", 1, 1), (1, "1F1B", 1, 3), (2, "1F1B", 1, 2), (2, "1F1B", 1, 4),
          (2, "GPipe", 1, 2), (2, "Interleaved1F1B", 2, 2), (2, "ZBVZeroBubble", 2, 4),
          (2, "DualPipeV", 2, 2)]


@pytest.mark.parametrize("seed", range(3))
def test_bounds_stay_below_every_plan_that_fits_both_rows(seed):
    rng = np.random.default_rng(900 + seed)
    p = _random_problem(rng)
    for pp, schedule, chunks, m in SHAPES:
        if pp * chunks > len(p.units) or (chunks > 1 and refusal(schedule, pp, chunks, m)):
            continue
        plans = list(_plans(p, pp, m, schedule, chunks))
        flights = [in_flight(schedule, pp, m, k, chunks) for k in range(pp * chunks)]
        for share in (0.1, 0.3, 0.6, 0.9):
            budget = sorted(max(a, b) for _, a, b in plans)[int(share * len(plans))]
            fitting = min(s for s, a, b in plans if a <= budget and b <= budget)
            bound = lower_bound(p, pp, m, schedule, chunks, budget)
            assert bound <= fitting * (1 + 1e-9), (pp, schedule, chunks, m, share)
            if chunks > 1:
                bound = memory_bound(p, pp, m, schedule, chunks, budget, flights)
                assert bound <= fitting * (1 + 1e-9), (pp, schedule, chunks, m, share)
                bound = busiest_rank_bound(p, pp, m, schedule, chunks, 0.0, 2 * fitting,
                                           1e-6, budget, flights)
                assert bound <= fitting * (1 + 1e-5), (pp, schedule, chunks, m, share)
            if pp > 1:  # the one-chunk schedules' action graphs too (search.chunk_pass)
                bound = relaxed_path_bound(p, pp, m, schedule, chunks, budget, flights)
                assert bound <= fitting * (1 + 1e-9), (pp, schedule, chunks, m, share)


def _fsdp_or_whole(gathered: float | None) -> StageProblem:
    """Three alike layers, each whole (2 s, 30 GB of weights) or FSDP-sharded (1 s, 3 GB,
    gathering `gathered` bytes in its backward)."""
    two = np.array
    layers = tuple(LayerOptions(
        f"l{u}", u, ("whole", "fsdp"), two([2.0, 1.0]), two([0.0, 0.0]), two([30e9, 3e9]),
        two([1e9, 1e9]), temp_bytes=two([0.0, 0.0]),
        gathered_bytes=None if gathered is None else two([0.0, gathered])) for u in range(3))
    return StageProblem(layers, (), ("u0", "u1", "u2"), (0.0, 0.0, 0.0))


def test_the_bound_sees_what_fsdp_backward_holds():
    """One stage, 80 GB: three FSDP layers take 9 GB of weights and 3 GB of activations by
    the stage rows, but their backward holds 4 x 20 GB beside them, which only whole
    layers (90 GB) could avoid: none fits, and the bound says so; without the gathered
    bytes the rows alone fit at 3 s."""
    budget = 80e9
    assert lower_bound(_fsdp_or_whole(None), 1, 1, "1F1B", 1, budget) == pytest.approx(3.0)
    assert lower_bound(_fsdp_or_whole(20e9), 1, 1, "1F1B", 1, budget) == math.inf
    # a smaller group fits: 12 GB + 4 x 10 GB
    assert lower_bound(_fsdp_or_whole(10e9), 1, 1, "1F1B", 1, budget) == pytest.approx(3.0)


def test_levels_round_down_and_keep_zero():
    """The gathered sizes the bounds try are at most the true ones, 0 among them."""
    p = _random_problem(np.random.default_rng(5))
    rounded, taus = held_row.levels(p.tables)
    assert taus[0] == 0.0 and len(taus) <= held_row.LEVELS + 1
    assert (rounded <= p.tables.gathered_bytes * (1 + 1e-9)).all()
    kept = rounded > 0
    assert (rounded[kept] >= p.tables.gathered_bytes[kept] / held_row.STEP * (1 - 1e-9)).all()


def test_the_busiest_rank_bound_reads_each_ranks_memory():
    """Six alike units, each fast (1 s a microbatch, 10 GB) or slow (2 s, 1 GB), over 2
    ranks of 2 stages (ZBV, 2 microbatches), 25 GB a rank: the work alone would put three
    fast units on each rank; each rank's memory row keeps it to two and a slow one: the
    bound rises, and stays below the best plan that fits."""
    two = np.array
    p = StageProblem(tuple(LayerOptions(
        f"l{u}", u, ("fast", "slow"), two([1.0, 2.0]), two([0.0, 0.0]), two([10e9, 1e9]),
        two([0.0, 0.0])) for u in range(6)), (), tuple(f"u{u}" for u in range(6)), (0.0,) * 6)
    schedule, m, budget = "ZBVZeroBubble", 2, 25e9
    flights = [in_flight(schedule, 2, m, k, 2) for k in range(4)]
    fitting = min(s for s, a, b in _plans(p, 2, m, schedule, 2) if a <= budget)
    alone = busiest_rank_bound(p, 2, m, schedule, 2, 0.0, 100.0, 1e-6)
    bound = busiest_rank_bound(p, 2, m, schedule, 2, 0.0, 100.0, 1e-6, budget, flights)
    assert alone + 0.5 < bound <= fitting * (1 + 1e-6), (alone, bound, fitting)


@pytest.mark.parametrize("schedule", ["ZBVZeroBubble", "Interleaved1F1B"])
def test_the_relaxed_path_bound_reads_fsdp_backward(schedule):
    """The same six units, the slow option FSDP-sharded and gathering 4 GB in its
    backward: each rank's second memory row (its τ a choice in the program) raises the
    relaxed path bound past what the stage rows alone give, below the best plan that fits
    both rows."""
    two = np.array

    def problem(gathered):
        return StageProblem(tuple(LayerOptions(
            f"l{u}", u, ("fast", "slow"), two([1.0, 2.0]), two([0.0, 0.0]),
            two([10e9, 1e9]), two([0.0, 0.0]), temp_bytes=two([0.0, 0.0]),
            gathered_bytes=two([0.0, gathered])) for u in range(6)), (),
            tuple(f"u{u}" for u in range(6)), (0.0,) * 6)

    m, budget = 2, 25e9
    flights = [in_flight(schedule, 2, m, k, 2) for k in range(4)]
    rows = relaxed_path_bound(problem(0.0), 2, m, schedule, 2, budget, flights)
    p = problem(4e9)
    fitting = min(s for s, a, b in _plans(p, 2, m, schedule, 2) if a <= budget and b <= budget)
    bound = relaxed_path_bound(p, 2, m, schedule, 2, budget, flights)
    assert rows + 1.0 < bound <= fitting * (1 + 1e-9), (rows, bound, fitting)
