"""One reason per layer for every plan kind (planner.reasons): a 1-D plan's and a 3-D
plan's layers are told in the same sentence, from the same per-step numbers: each option's
own time (m microbatches and the once-a-step part) and its edges with the neighbours held
as chosen, against the cheapest alternative of the other kind."""

import random
import re

import models
import numpy as np
import pytest
import torch
from torch import nn

from planner.plan3d import optimize_3d
from planner.problem import Edge
from planner.reasons import Options, Weighed, of_built, reasons
from planner.search import CostCache, Shape, build
from profiler import profile, trace
from strategies.catalog import ColumnParallel, DataParallel
from strategies.parse import parse_devices


def _graph():
    return profile(trace(models.mlp(), (torch.randn(16, 16),)), measure=False)


def _seconds(text: str) -> float:
    value, unit = text.split()
    return float(value) * (1e-3 if unit == "ms" else 1e-6)


def _added(sentence: str) -> tuple[str, float]:
    """(the alternative's label, the seconds per step the sentence says it would add: less
    than 0 where it says the alternative would save them, but not fit)."""
    found = re.search(r"; (.+) would (add|save) ([\d.]+ (?:ms|µs)) per step", sentence)
    assert found, sentence
    sign = 1 if found.group(2) == "add" else -1
    return found.group(1), sign * _seconds(found.group(3))


def _tolerance(seconds: float) -> float:
    return 0.05e-3 if abs(seconds) >= 1e-4 else 0.5e-6  # what _ms rounds away


def test_hand_solved_layer_names_the_other_kind_and_its_extra_time():
    layer = next(l for l in _graph().layers if l.name == "2")  # Linear(32, 32)
    ms = 1e-3
    # column-parallel: 1 ms of its own, 0.5 of it activation traffic, and a 0.2 ms layout
    # change from its producer; data-parallel: 3 ms, 1.5 of it the gradient all-reduce
    # (2 ms run alone), and no layout change
    row = Options(layer, (DataParallel(), ColumnParallel()), ("data_parallel", "column_parallel"),
                  time_s=(3 * ms, 1 * ms), traffic_s=(0.0, 0.5 * ms),
                  sync_s=(1.5 * ms, 0.0), sync_serial_s=(2 * ms, 0.0),
                  gather_s=(0.0, 0.0), gather_serial_s=(0.0, 0.0), stage=1)
    producer = Options(layer, (DataParallel(),), ("data_parallel",), (0.0,), (0.0,), (0.0,),
                       (0.0,), (0.0,), (0.0,), stage=0)
    edge = Edge(0, 1, np.array([[0.0, 0.2 * ms]]))
    why = reasons(Weighed((producer, row), (edge,), dp=1), [0, 1])
    kb = f"{layer.param_bytes / 1e3:.0f} KB"
    assert why[1] == (
        "stage 1: model-parallel (column_parallel): activation traffic 0.7 ms; data-parallel "
        f"would add 1.8 ms per step (all-reduce of its {kb} of gradients 1.5 ms (0.5 ms more "
        "beside compute))")
    assert why[0] == "stage 0: data-parallel: the only strategy that applies here"


@pytest.mark.parametrize("dp,tp,rows", [(2, 2, 4), (4, 1, 2), (1, 4, 8)])
def test_stated_extra_time_is_the_whole_step_change_of_that_one_layer(dp, tp, rows):
    """For random assignments of a 3-D shape: the time a reason says the alternative adds
    is what the per-step sum (every layer's m microbatches and once-a-step time, every edge
    m times) gains when that layer alone switches to it, and no other option of the other
    kind (replicate aside) would add less."""
    graph = _graph()
    cluster = parse_devices(f"{dp * tp}xA100-80GB")
    built = build(CostCache(graph, cluster, "adam"), 1, dp, tp, rows)
    m = graph.batch_size // (dp * rows)
    problem = built.problem

    def step_s(choice) -> float:
        own = sum(m * float(l.microbatch_s[c]) + float(l.step_s[c])
                  for l, c in zip(problem.layers, choice))
        return own + sum(m * float(e.cost_s[choice[e.src], choice[e.dst]])
                         for e in problem.edges)

    weighed = of_built(built, m, dp)
    rng = random.Random(dp * 100 + tp)
    for _ in range(5):
        choice = [rng.randrange(len(l.strategies)) for l in problem.layers]
        if not np.isfinite(step_s(choice)):
            continue
        for i, sentence in enumerate(reasons(weighed, choice)):
            row = weighed.layers[i]
            if len(row.names) == 1 or row.layer.is_input:
                continue
            label, said = _added(sentence)
            chosen = row.strategies[choice[i]]
            extra = {}
            for j in range(len(row.names)):
                if j != choice[i]:
                    switched = list(choice)
                    switched[i] = j
                    extra[j] = step_s(switched) - step_s(choice)
            named = [j for j in extra if label.endswith(f"({row.names[j]})")
                     or label == row.names[j].replace("_", "-")]
            assert any(abs(extra[j] - said) <= _tolerance(said) + 1e-9 for j in named), (
                sentence, {row.names[j]: extra[j] for j in extra})
            other = [j for j in extra if row.strategies[j].model_parallel != chosen.model_parallel
                     and row.strategies[j].name != "replicate"]
            assert all(extra[j] >= said - _tolerance(said) - 1e-9 for j in other), sentence


def test_pipelined_plan_tells_each_layer_in_the_one_sentence():
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(),
                          nn.Linear(256, 64))
    shape = Shape(pp=2, dp=2, tp=1, microbatches=4, schedule="1F1B")
    plan = optimize_3d(model, "2x2xV100", (torch.randn(32, 64),), measure=False,
                       only=[shape])
    assert plan.pipeline is not None and plan.microbatches == 4
    for layer in plan.layers:
        assert layer.reason.startswith(f"stage {layer.stage}: "), layer.reason
        assert "edges decide the rest" not in layer.reason
        if "the only strategy" not in layer.reason:
            label, _ = _added(layer.reason)
            assert label
    weighted = [l for l in plan.layers if l.param_bytes and "would add" in l.reason]
    assert weighted and all(re.search(r"(gradients|weights|activation traffic)", l.reason)
                            for l in weighted)
    assert f"{plan.layers[0].name}: {plan.layers[0].reason}" in plan.explain()
