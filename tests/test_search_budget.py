"""Every search ends by default: mesh "3d" and "auto" stop within planner.search's
DEFAULT_SEARCH_TIME_S with their status and gap, a search with no plan by then hands back
a quick plan and says so, and search_time_s=None still proves the optimum."""

from __future__ import annotations

import inspect
import itertools
import math
import time

import numpy as np
import pytest
import torch
from torch import nn

from planner import search as search_module
from planner.cli.plan import parse_search_time
from planner.optimize import optimize
from planner.plan3d import optimize_3d
from planner.problem import Edge
from planner.pipeline.schedules import refusal
from planner.search import DEFAULT_SEARCH_TIME_S, FALLBACK_NOTE
from planner.pipeline.stage_loads import memory_bound
from planner.pipeline.stage_paths import relaxed_path_bound
from planner.pipeline.stages import (LayerOptions, StageProblem, evaluate, in_flight, lower_bound,
                            quick_plan)

DEVICES = "4x4xV100"


def _model():
    layers = [nn.Linear(64, 256), nn.ReLU()]
    for _ in range(8):
        layers += [nn.Linear(256, 256), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(256, 64))


def _inputs():
    return (torch.randn(64, 64),)


@pytest.fixture
def default_budget(monkeypatch):
    """Set the default budget of optimize() and optimize_3d() as the constant would."""
    def set_to(seconds: float) -> None:
        for entry in (optimize, optimize_3d):
            monkeypatch.setitem(entry.__wrapped__.__kwdefaults__, "search_time_s", seconds)
    return set_to


def test_searches_are_bounded_by_default():
    assert math.isfinite(DEFAULT_SEARCH_TIME_S) and DEFAULT_SEARCH_TIME_S > 0
    for entry in (optimize, optimize_3d):
        default = inspect.signature(entry).parameters["search_time_s"].default
        assert default == DEFAULT_SEARCH_TIME_S


@pytest.mark.parametrize("mesh", ["3d", "auto"])
def test_a_default_search_ends_within_its_budget_with_status_and_gap(default_budget, mesh):
    budget_s = 0.3  # the whole search here takes about 1 s on 2 cores
    default_budget(budget_s)
    started = time.perf_counter()
    plan = optimize(_model(), DEVICES, _inputs(), measure=False, mesh=mesh)
    seconds = time.perf_counter() - started
    # the budget, then at most the quick plans' time and the plan's own assembly
    assert seconds < budget_s + search_module.FALLBACK_S + 10
    s = plan.solver
    assert s.status in ("optimal", "feasible")
    assert s.bound_s <= s.objective_s * (1 + 1e-9)
    assert 0.0 <= s.gap < 1.0
    if s.status == "feasible":
        assert "search_time_s=None" in s.note
        assert f"gap {s.gap:.1%}" in plan.explain()


def test_no_plan_by_the_deadline_hands_back_a_quick_plan(default_budget):
    default_budget(0.0)  # out of time before the first solve
    plan = optimize_3d(_model(), DEVICES, _inputs(), measure=False)
    proven = optimize_3d(_model(), DEVICES, _inputs(), measure=False, search_time_s=None)
    assert plan.solver.status == "feasible"
    assert "quick plan" in plan.solver.note
    assert plan.solver.bound_s <= proven.predicted.step_time_s * (1 + 1e-9)
    assert plan.predicted.step_time_s >= proven.predicted.step_time_s * (1 - 1e-9)
    best = [c for c in plan.search.best_per_shape if c.outcome == "best"]
    assert best and best[0].note == FALLBACK_NOTE
    assert "Solver: feasible" in plan.explain()


def test_search_time_none_proves_the_optimum():
    plan = optimize_3d(_model(), DEVICES, _inputs(), measure=False, search_time_s=None)
    assert plan.solver.status == "optimal"
    assert plan.solver.gap == 0.0 or plan.solver.bound_s == pytest.approx(
        plan.solver.objective_s, rel=1e-6)
    assert plan.solver.note == ""
    auto = optimize(_model(), DEVICES, _inputs(), measure=False, mesh="auto",
                    search_time_s=None)
    assert auto.solver.status == "optimal"


def test_the_command_line_takes_seconds_or_prove():
    assert parse_search_time("prove") is None
    assert parse_search_time("45") == 45.0
    with pytest.raises(Exception, match="neither"):
        parse_search_time("soon")


def _random_problem(rng, units: int = 6, layers: int = 7, max_choices: int = 200):
    """A small stage problem: 1-3 options per layer (at most `max_choices` choices in
    all), random times, memory and layout changes."""
    unit_of = np.minimum(np.sort(rng.integers(0, units, size=layers)), np.arange(layers))
    unit_of = np.searchsorted(np.unique(unit_of), unit_of).tolist()
    opts, choices = [], 1
    for i in range(layers):
        k = max(1, min(int(rng.integers(1, 4)), max_choices // choices))
        choices *= k
        opts.append(LayerOptions(f"l{i}", unit_of[i], tuple(f"s{j}" for j in range(k)),
                                 rng.uniform(0.1, 1.0, k), rng.uniform(0.0, 0.3, k),
                                 rng.uniform(1e8, 1e9, k), rng.uniform(1e7, 4e8, k)))
    edges = [Edge(d - 1, d, rng.uniform(0, 0.5, (len(opts[d - 1].strategies),
                                                 len(opts[d].strategies))))
             for d in range(1, layers)]
    n_units = max(unit_of) + 1
    return StageProblem(tuple(opts), tuple(edges), tuple(f"u{u}" for u in range(n_units)),
                        tuple(float(x) for x in rng.uniform(0, 0.2, n_units)),
                        forward_share=float(rng.choice((1 / 3, 0.25, 0.55))))


@pytest.mark.parametrize("seed", range(3))
def test_chunked_bounds_below_every_simulated_step_that_fits(seed):
    """stage_loads.memory_bound (each rank's work where it must fit) and
    stage_paths.relaxed_path_bound (the schedule's actions with the stage times free) are
    below the simulated step of every cut and choice (that fits the budget)."""
    rng = np.random.default_rng(700 + seed)
    p = _random_problem(rng)
    pp, v = 2, 2
    for schedule in ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
                     "DualPipeV"):
        for m in (2, 4):
            if refusal(schedule, pp, v, m) is not None:
                continue
            steps = [(t.step_s, max(t.memory_bytes))
                     for cuts in itertools.combinations(range(1, len(p.units)), pp * v - 1)
                     for choice in itertools.product(*(range(len(l.strategies))
                                                       for l in p.layers))
                     for t in [evaluate(p, (0, *cuts), choice, m, schedule, v)]]
            least = min(s for s, _ in steps)
            assert relaxed_path_bound(p, pp, m, schedule, v) <= least * (1 + 1e-9)
            flights = [in_flight(schedule, pp, m, k, v) for k in range(pp * v)]
            for share in (0.05, 0.3, 0.7):
                budget = sorted(mem for _, mem in steps)[int(share * len(steps))]
                fitting = min(s for s, mem in steps if mem <= budget)
                bound = memory_bound(p, pp, m, schedule, v, budget, flights)
                assert bound <= fitting * (1 + 1e-9), (schedule, m, share, bound, fitting)
                bound = relaxed_path_bound(p, pp, m, schedule, v, budget, flights)
                assert bound <= fitting * (1 + 1e-9), (schedule, m, share, bound, fitting)


def test_the_memory_bound_sees_what_a_rank_must_keep():
    """Four units, each fast (1 s, 1 GB of activations per microbatch) or slow (2 s,
    0.25 GB); interleaved 1F1B on 2 ranks of 2 chunks keeps 4, 3, 2 and 1 microbatches at
    stages 0-3, so rank 0 keeps at least 2 of each of its units, rank 1 at least 1. In
    2 GB a rank runs at most about one fast unit: the least step that fits is 16 s, the
    memory bound finds most of that, the shared one-microbatch bound only the work (8 s)."""
    two = lambda *xs: np.array(xs, float)
    layers = tuple(LayerOptions(f"l{u}", u, ("fast", "slow"), two(1.0, 2.0), two(0.0, 0.0),
                                two(0.0, 0.0), two(1e9, 0.25e9)) for u in range(4))
    p = StageProblem(layers, (), tuple(f"u{u}" for u in range(4)), (0.0,) * 4)
    pp, v, m, schedule, budget = 2, 2, 4, "Interleaved1F1B", 2e9
    flights = [in_flight(schedule, pp, m, k, v) for k in range(pp * v)]
    assert flights == [4, 3, 2, 1]
    fitting = min(t.step_s for choice in itertools.product((0, 1), repeat=4)
                  for t in [evaluate(p, (0, 1, 2, 3), choice, m, schedule, v)]
                  if max(t.memory_bytes) <= budget)
    assert fitting == pytest.approx(16.0)
    assert lower_bound(p, pp, m, schedule, v, budget) == pytest.approx(8.0)
    assert 12.0 <= memory_bound(p, pp, m, schedule, v, budget, flights) <= fitting
    # the schedule's actions with each rank's memory row: the slow units it forces enter
    # the bound of the bubble
    assert relaxed_path_bound(p, pp, m, schedule, v) == pytest.approx(9.0)
    assert 12.0 <= relaxed_path_bound(p, pp, m, schedule, v, budget, flights) <= fitting


def _with_blocks_recomputed(rng, p: StageProblem) -> StageProblem:
    """p with every unit of two or more layers a block recomputed whole
    (planner.pipeline.block_recompute's shape): each of its layers offers each option again,
    slower by a forward and keeping a fraction of its activations, and the block's layers
    take those all together or none (StageProblem.consistent)."""
    units = [u for u, members in enumerate(p.unit_layers()) if len(members) >= 2]
    layers = []
    for l in p.layers:
        if l.unit not in units:
            layers.append(l)
            continue
        n = len(l.strategies)
        layers.append(LayerOptions(
            l.name, l.unit, l.strategies * 2,
            np.concatenate([l.microbatch_s, l.microbatch_s * rng.uniform(1.2, 1.5)]),
            np.concatenate([l.step_s, l.step_s]),
            np.concatenate([l.weight_bytes, l.weight_bytes]),
            np.concatenate([l.activation_bytes, l.activation_bytes * rng.uniform(0, 0.3)]),
            recomputed=np.repeat([False, True], n)))
    edges = tuple(Edge(e.src, e.dst, np.tile(e.cost_s, (
        2 if layers[e.src].recomputed is not None else 1,
        2 if layers[e.dst].recomputed is not None else 1))) for e in p.edges)
    return StageProblem(tuple(layers), edges, p.units, p.cut_s,
                        forward_share=p.forward_share)


@pytest.mark.parametrize("seed", range(3))
def test_bounds_price_a_block_recomputed_whole_below_every_plan_that_fits(seed):
    """The Lagrangian bounds take a block recomputed whole as one choice (the lesser of
    its layers all plain and all recomputed, stages._Tables.least_by_unit), never a
    layer's apart: below the simulated step of every consistent plan that fits, one
    stage per rank and chunked. The quick plan, every block recomputed and then some run
    plain again where memory allows (stages._fewer_recomputed), stays consistent and fits."""
    rng = np.random.default_rng(900 + seed)
    p = _with_blocks_recomputed(rng, _random_problem(rng, units=5, layers=7, max_choices=40))
    assert p.linked_units()
    for pp, v, schedule, m in ((2, 1, "1F1B", 2), (2, 1, "1F1B", 4), (2, 2, "Interleaved1F1B", 2),
                               (2, 2, "ZBVZeroBubble", 4)):
        if refusal(schedule, pp, v, m) is not None or pp * v > len(p.units):
            continue
        steps = [(t.step_s, max(t.memory_bytes))
                 for cuts in itertools.combinations(range(1, len(p.units)), pp * v - 1)
                 for choice in itertools.product(*(range(len(l.strategies)) for l in p.layers))
                 if p.consistent(choice)
                 for t in [evaluate(p, (0, *cuts), choice, m, schedule, v)]]
        flights = [in_flight(schedule, pp, m, k, v) for k in range(pp * v)]
        for share in (0.05, 0.3, 0.7):
            budget = sorted(mem for _, mem in steps)[int(share * len(steps))]
            fitting = min(s for s, mem in steps if mem <= budget)
            bounds = [lower_bound(p, pp, m, schedule, v, budget)]
            if v > 1:
                bounds += [memory_bound(p, pp, m, schedule, v, budget, flights),
                           relaxed_path_bound(p, pp, m, schedule, v, budget, flights)]
            for bound in bounds:
                assert bound <= fitting * (1 + 1e-9), (schedule, m, share, bounds, fitting)
            quick = quick_plan(p, pp, m, schedule, budget, v)
            if quick is not None:
                assert p.consistent(quick.choice)
                assert max(quick.times.memory_bytes) <= budget * (1 + 1e-9)
                assert quick.times.step_s >= fitting * (1 - 1e-9)
