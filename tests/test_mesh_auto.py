"""planner.optimize(mesh=...): "1d" is today's plan, "auto" keeps it unless the 3-D search
predicts a faster one, "3d" is the search's plan."""

import sys
from pathlib import Path

import pytest

import planner

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import mlp  # noqa: E402


def test_auto_keeps_the_1d_plan_when_3d_is_no_faster():
    model, inputs, _ = mlp.build(64)
    one = planner.optimize(model, "2xV100", inputs)
    auto = planner.optimize(model, "2xV100", inputs, mesh="auto")
    three = planner.optimize(model, "2xV100", inputs, mesh="3d")
    assert not auto.is_mesh_3d and auto.mesh_choice.startswith("auto: 1-D")
    assert auto.predicted.step_time_s == pytest.approx(one.predicted.step_time_s)
    assert [l.strategy for l in auto.layers] == [l.strategy for l in one.layers]
    assert three.is_mesh_3d and three.predicted.step_time_s >= 0.99 * one.predicted.step_time_s
    assert auto.search is not None and "Mesh choice: auto: 1-D" in auto.explain()


def test_bad_mesh_is_one_line_naming_the_field():
    model, inputs, _ = mlp.build(8)
    with pytest.raises(ValueError, match="^mesh: 'pp' is not one of"):
        planner.optimize(model, "2xV100", inputs, mesh="pp")
