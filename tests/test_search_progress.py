"""A long search tells its progress, and Ctrl-C (a real SIGINT) hands back the best plan
found so far with its gap instead of a traceback."""

from __future__ import annotations

import signal

import pytest
import torch
from torch import nn

from planner.plan3d import optimize_3d
from planner.progress import listening


@pytest.fixture(autouse=True)
def default_sigint():
    """Ctrl-C as a terminal delivers it to a fresh Python process: its default handler.
    In the whole suite an earlier test (or a library it loads) left another handler in
    place, under which a SIGINT never reached the search (the two Ctrl-C tests failed
    there and passed alone)."""
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


def _model():
    return nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                         nn.Linear(256, 64))


def test_progress_counts_up_to_every_candidate():
    seen = []
    with listening(seen.append):
        plan = optimize_3d(_model(), "2x2xV100", (torch.randn(32, 64),), measure=False)
    assert seen, "the search told nothing"
    settled = [p.settled for p in seen]
    assert settled == sorted(settled)  # never goes back
    last = seen[-1]
    assert last.candidates == plan.search.candidates
    assert last.solved == plan.search.solved
    assert last.best_s == pytest.approx(plan.predicted.step_time_s)
    if last.bound_s is not None:
        assert last.bound_s <= last.best_s * (1 + 1e-9)


def test_ctrl_c_returns_the_best_plan_with_its_gap():
    def interrupt_after_first_incumbent(p):
        if p.best_s is not None and not p.current:
            signal.raise_signal(signal.SIGINT)  # as the terminal sends it

    with listening(interrupt_after_first_incumbent):
        plan = optimize_3d(_model(), "2x2xV100", (torch.randn(32, 64),), measure=False)
    assert plan.solver.status == "interrupted"
    assert plan.solver.bound_s <= plan.solver.objective_s
    assert plan.predicted.step_time_s == plan.solver.objective_s
    assert "Solver: interrupted" in plan.explain()
    outcomes = {c.outcome for c in plan.search.best_per_shape}
    assert "best" in outcomes


def test_ctrl_c_before_any_plan_is_a_keyboard_interrupt():
    def interrupt_at_once(p):
        signal.raise_signal(signal.SIGINT)

    with listening(interrupt_at_once), pytest.raises(KeyboardInterrupt):
        optimize_3d(_model(), "2x2xV100", (torch.randn(32, 64),), measure=False)


def test_a_search_time_budget_hands_back_the_first_plan_with_its_gap():
    # no time at all: no solve runs; the best quick plan (planner.search._Search.fallback) is the
    # plan, the rest "skipped" and open
    plan = optimize_3d(_model(), "2x2xV100", (torch.randn(32, 64),), measure=False,
                       search_time_s=0.0)
    whole = optimize_3d(_model(), "2x2xV100", (torch.randn(32, 64),), measure=False)
    assert plan.search.solved >= 1
    assert plan.solver.status == "feasible" and "quick plan" in plan.solver.note
    assert plan.predicted.step_time_s >= whole.predicted.step_time_s * (1 - 1e-9)
    assert plan.solver.bound_s <= whole.predicted.step_time_s * (1 + 1e-9)
    assert plan.solver.status in ("feasible", "optimal")
    skipped = [c for c in plan.search.best_per_shape if c.outcome == "skipped"]
    assert skipped and all("ran out" in c.note for c in skipped)
