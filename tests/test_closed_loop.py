"""The closed loop of a training run: the first steps are timed per layer against the
plan's prediction and, off by more than 15%, the drift is reported by term with the
re-planned plan's predicted gain; `hyplan train --replan` also writes that plan."""

import json

import pytest
from torch import nn

import executor
import models
import planner
from distributed import run_ranks
from executor.data import synthetic_dataset
from test_train_cli import MODEL, _plan, train_here  # noqa: F401 - a fixture

ROWS = 16


def _dataset():
    x = models.batch("mlp", ROWS, 0)[0]
    return synthetic_dataset(models.build("mlp"), (x,), nn.CrossEntropyLoss(), 8 * ROWS, seed=1)


def _wrong(plan: planner.Plan, factor: float) -> planner.Plan:
    """The plan with every predicted time multiplied by `factor`: a deliberately wrong
    prediction, the strategies unchanged."""
    layers = [l.model_copy(update={"compute_s": l.compute_s * factor,
                                   "communication_s": l.communication_s * factor,
                                   "reshard_in_s": l.reshard_in_s * factor})
              for l in plan.layers]
    p = plan.predicted
    predicted = p.model_copy(update={key: getattr(p, key) * factor for key in (
        "step_time_s", "compute_s", "communication_s", "other_s", "fixed_s")})
    return plan.model_copy(update={"layers": layers, "predicted": predicted})


def _train(rank, world, plan_json):
    plan = planner.Plan.from_json(plan_json)
    lines = []
    x = models.batch("mlp", ROWS, 0)[0]
    result = executor.train(
        models.build("mlp"), plan, _dataset(), nn.CrossEntropyLoss(), steps=5, lr=0.01,
        report=lines.append,
        on_drift=lambda drift: [drift.replan_report(models.build("mlp"), (x,),
                                                    measure=False)[1]])
    return lines, result.drift.ratio, [t for t, _, _ in result.drift.terms()]


def test_a_wrong_prediction_is_reported_by_term_with_the_replanned_gain():
    x = models.batch("mlp", ROWS, 0)[0]
    plan = planner.optimize(models.build("mlp"), "2xcpu", example_inputs=(x,),
                            optimizer="sgd", measure=False)
    (lines, ratio, terms), (_, other_ratio, _) = run_ranks(
        _train, 2, _wrong(plan, 0.01).to_json())
    assert ratio > 1.15 and other_ratio > 1.15  # every rank timed; rank 0 reports
    text = "\n".join(lines)
    assert f"against predicted" in text and "median of" in text
    assert terms == ["layers (compute)", "layout changes", "optimizer update",
                     "gradient sync and rest"]
    for term in terms:
        assert term in text
    # each term's line: predicted, measured, and the drift between them, all in ms (the
    # drift was printed in seconds, "+0.0 ms", under a "ms" label)
    for line in text.splitlines():
        if line.strip().startswith(tuple(terms)):
            predicted, measured, drift = (float(part.split()[-1])
                                          for part in line.split("ms")[:3])
            assert drift == pytest.approx(measured - predicted, abs=0.15), line
    assert "hyplan: re-planned on the measured figures" in text


def test_hyplan_train_reports_drift_and_writes_the_replanned_plan(tmp_path, train_here):
    path = _plan(tmp_path, "2xcpu")
    plan = planner.Plan.load(path)
    _wrong(plan, 0.01).save(path)
    out = train_here(path, MODEL, "--steps", "4", "--nproc-per-node", "2", "--replan")
    assert "layers (compute)" in out and "re-planned on the measured figures" in out, out
    written = tmp_path / "plan-2xcpu.replanned.json"
    assert f"re-planned plan written to {written}" in out
    assert json.loads(written.read_text())["fingerprint"] == plan.fingerprint
