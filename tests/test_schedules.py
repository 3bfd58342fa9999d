"""Schedules as data: torch's action lists are complete and placed as the planner assumes,
the simulation gives the textbook bubbles, and the timeline draws the bubble the plan
priced (pure data; no processes)."""

import pytest

import models
from planner.plan3d import optimize_3d
from planner.report.plot import bubble_s, timeline_from_plan
from planner.pipeline.schedules import (
    SCHEDULES, actions, chunks_allowed, in_flight, placement, refusal, simulate,
    uniform_bubble,
)
from planner.search import Shape


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("pp,m", [(2, 4), (4, 8)])
def test_every_microbatch_runs_forward_and_backward_once_on_its_rank(schedule, pp, m):
    for v in chunks_allowed(schedule, pp):
        if refusal(schedule, pp, v, m):
            continue
        ranks = placement(schedule, pp, v) if v > 1 else tuple(range(pp))
        seen = {}
        for r, order in enumerate(actions(schedule, pp, v, m)):
            for a in order:
                assert ranks[a.stage] == r, (schedule, a)
                seen.setdefault((a.stage, a.microbatch), []).append(a.kind)
        assert len(seen) == pp * v * m
        for kinds in seen.values():
            assert sorted(kinds) in (["B", "F"], ["F", "I", "W"]), (schedule, kinds)


def test_placements_are_looped_and_v_shaped():
    assert placement("Interleaved1F1B", 2, 2) == (0, 1, 0, 1)
    assert placement("ZBVZeroBubble", 4, 2) == (0, 1, 2, 3, 3, 2, 1, 0)


def test_uniform_bubbles_are_the_published_ones():
    # 1F1B and GPipe: pp - 1 stage times; interleaved 1F1B: pp - 1 chunk times (a v-th);
    # the zero-bubble schedules fill most of it with weight gradients
    assert uniform_bubble("1F1B", 4, 1, 8) == pytest.approx(3.0)
    assert uniform_bubble("GPipe", 4, 1, 8) == pytest.approx(3.0)
    assert uniform_bubble("Interleaved1F1B", 4, 2, 8) == pytest.approx(3.0)
    for zb in ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV"):
        assert uniform_bubble(zb, 4, 2, 8) < 3.0 / 2


def test_simulated_gpipe_is_the_closed_form():
    f, i, w = [0.1, 0.3, 0.2], [0.2, 0.1, 0.4], [0.2, 0.5, 0.1]
    sim = simulate("GPipe", 3, 1, 5, f, i, w)
    total = [a + b + c for a, b, c in zip(f, i, w)]
    assert sim.makespan_s == pytest.approx(sum(total) + 4 * max(total))


def test_in_flight_counts_the_order():
    assert in_flight("1F1B", 4, 1, 8) == (4, 3, 2, 1)
    assert in_flight("GPipe", 2, 1, 8) == (8, 8)
    # ZBV: rank 0 holds the first and the last stage
    assert in_flight("ZBVZeroBubble", 2, 2, 8) == (4, 3, 2, 1)


@pytest.mark.parametrize("shape", [Shape(2, 1, 1, 8, "ZBVZeroBubble", 2),
                                   Shape(2, 1, 1, 8, "Interleaved1F1B", 2),
                                   Shape(2, 1, 1, 8, "1F1B")])
def test_drawn_bubble_is_the_priced_bubble(shape):
    example = models.batch("mlp", 16, 0)[0]
    plan = optimize_3d(models.build("mlp"), "2xcpu", (example,), measure=False, only=[shape])
    t = timeline_from_plan(plan)
    assert t.stages == 2 and t.chunks == shape.chunks
    assert bubble_s(t) == pytest.approx(plan.predicted.bubble_s, rel=1e-9, abs=1e-15)
    assert plan.pipeline.why.startswith(("ZBV", "interleaved", "1F1B"))


@pytest.mark.parametrize("schedule", SCHEDULES)
def test_a_stages_time_is_split_by_the_models_forward_share(schedule):
    # On this CPU a small CNN's first stage spent about as long forward as back (5.2 and
    # 4.7 ms a microbatch), which a third (3.8 and 7.7) put the next stage's start late
    # by; the share is measured per model (profiler.whole_step.forward_share).
    from planner.pipeline.schedules import parts, price

    pp, m = 2, 4
    v = max(chunks_allowed(schedule, pp))
    times = [1.0 + 0.5 * k for k in range(pp * v)]
    for forward in (1 / 3, 0.5):
        share = parts(forward)
        assert share["F"] + share["B"] == pytest.approx(1.0)
        assert share["I"] + share["W"] == pytest.approx(share["B"])
        for a in price(schedule, pp, v, m, times, forward=forward).actions:
            if a.microbatch is not None:
                assert a.end_s - a.start_s == pytest.approx(share[a.kind] * times[a.stage])
