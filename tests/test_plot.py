"""Pictures of a plan: the files are written, and the schedule they draw has the textbook
step time and bubble."""

import pytest

import planner
from planner.cli import main
from planner.report.plot import PipelineTimeline, simulate, stage_order, timeline_from_plan
from test_cli import MLP


def _step_and_bubble(t: PipelineTimeline) -> tuple[float, float]:
    actions = simulate(t)
    end = max(a.end_s for a in actions)
    busy = sum(a.end_s - a.start_s for a in actions)
    return end, 1 - busy / (end * t.stages)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_uniform_pipeline_has_the_textbook_bubble(schedule):
    p, m, f, b = 4, 8, 1.0, 2.0
    t = PipelineTimeline(schedule, m, [f] * p, [b] * p)
    end, bubble = _step_and_bubble(t)
    assert end == pytest.approx((m + p - 1) * (f + b))
    assert bubble == pytest.approx((p - 1) / (m + p - 1))


def test_1f1b_order_warms_up_then_alternates():
    assert stage_order("1f1b", 4, 4, 2) == [("forward", 0), ("forward", 1), ("backward", 0),
                                            ("forward", 2), ("backward", 1), ("forward", 3),
                                            ("backward", 2), ("backward", 3)]


def test_plan_and_show_write_the_pictures(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", MLP, "--devices", "2xV100", "--batch", "64", "--json", str(path),
                 "--plot", str(tmp_path / "a")]) == 0
    assert main(["show", str(path), "--plot", str(tmp_path / "b")]) == 0
    for folder in ("a", "b"):
        for name in ("strategy_map", "memory", "timeline"):
            for fmt in ("png", "svg"):
                assert (tmp_path / folder / f"{name}.{fmt}").stat().st_size > 5000
    plan = planner.Plan.load(path)
    t = timeline_from_plan(plan)  # today's plans: one stage, the plan's own step time
    assert t.stages == 1
    assert _step_and_bubble(t)[0] == pytest.approx(plan.predicted.step_time_s, rel=0.02)


def test_uniform_pipeline_bubble_is_every_stage_waiting_pp_minus_one_microbatches():
    from planner.report.plot import bubble_s

    p, m, f, b = 4, 8, 1.0, 2.0
    for schedule in ("gpipe", "1f1b"):
        assert bubble_s(PipelineTimeline(schedule, m, [f] * p, [b] * p)) == \
            pytest.approx((p - 1) * (f + b))


def test_pipelined_transformer_plan_draws_the_plans_bubble(tmp_path, capsys):
    """GPT-2 small on two nodes of two V100s with a slow link between them: `--mesh auto`
    picks two pipeline stages (tensor parallel inside each node); the pictures are written
    and the timeline's bubble is the plan's predicted bubble."""
    gpt = "examples/gpt.py"
    path = tmp_path / "plan.json"
    assert main(["plan", gpt, "--devices", "2x2xV100", "--batch", "8", "--mesh", "auto",
                 "--json", str(path), "--plot", str(tmp_path)]) == 0
    plan = planner.Plan.load(path)
    assert plan.pipeline is not None and len(plan.pipeline.stages) > 1
    for name in ("strategy_map", "memory", "timeline"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5000
    t = timeline_from_plan(plan)
    assert t.stages * t.chunks == len(plan.pipeline.stages)  # a row per rank, chunks on it
    from planner.report.plot import bubble_s, memory_by_device

    assert bubble_s(t) == pytest.approx(plan.predicted.bubble_s, rel=1e-6)
    # the planner's step (planner.pipeline.stages.evaluate): the schedule's makespan, then the largest
    # per-rank gradient sync + update; the timeline draws each rank's after its own last
    # action, which ends sooner when another rank holds the largest update (DualPipeV, v=2)
    work = [a for a in simulate(t) if a.microbatch is not None]
    once = max(s + u for s, u in zip(t.sync_s or [0.0] * t.stages, t.update_s or [0.0] * t.stages))
    assert max(a.end_s for a in work) + once == pytest.approx(plan.predicted.step_time_s,
                                                              rel=0.02)
    assert _step_and_bubble(t)[0] <= plan.predicted.step_time_s * (1 + 1e-9)
    breakdown = plan.predicted.memory_breakdown
    assert sum(r.parameters * ((r.last_device or r.device) - r.device + 1)
               for r in memory_by_device(plan)) == pytest.approx(
        sum(b.parameters_bytes for b in breakdown))
