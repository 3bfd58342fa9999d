"""A 1,000-layer model on meta plans in seconds with an optimality certificate."""

import time

import torch
from torch import nn

import planner


def test_thousand_layer_chain_plans_optimal_in_seconds():
    with torch.device("meta"):
        model = nn.Sequential(*[m for _ in range(500) for m in (nn.Linear(256, 256), nn.ReLU())])
    start = time.perf_counter()
    plan = planner.optimize(model, "8xA100-80GB", example_inputs=(torch.empty(64, 256, device="meta"),))
    seconds = time.perf_counter() - start
    assert len(plan.layers) == 1000
    assert plan.solver.status == "optimal"
    assert abs(plan.solver.objective_s - plan.solver.bound_s) <= 1e-9 * plan.solver.objective_s
    assert seconds < 60  # about 5 s on an idle 2-core machine
