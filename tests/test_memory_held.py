"""A plan's predicted memory per device is not below what a rank holds: the 1-D plan kinds
of a 19 M-parameter MLP on 2 gloo ranks, measured by torch's MemTracker over one AdamW
step after a warm-up step (benchmarks/memory.py), each prediction at least 95% of the
largest rank's peak (issue 36: never below by more than 5%) and at most 15% above it."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

BELOW, ABOVE = 0.05, 0.15


@pytest.mark.slow
def test_predicted_memory_holds_on_two_ranks():
    from memory import run

    rows = run(ranks_list=(2,), cases=("mlp19m",), kinds=("ddp", "fsdp", "tensor"))
    for name, kind, ranks, predicted, measured, note in rows:
        assert measured is not None, f"{name}/{kind}: {note}"
        error = (predicted - measured) / measured
        assert -BELOW <= error <= ABOVE, (
            f"{name}/{kind} on {ranks} ranks: predicted {predicted:.1f} MiB, measured "
            f"{measured:.1f} MiB ({100 * error:+.1f}%)")


@pytest.mark.parametrize("limit_mb", [30, 40, 50, 60, 90])
def test_a_plan_fits_its_limit_with_what_the_step_holds_or_is_refused(limit_mb):
    """The integer program sums the layers; the step also holds DDP's buckets and the
    optimizer's temporaries. Under any limit the plan's memory, both together, is within
    it, or optimize says the model does not fit."""
    import torch
    from torch import nn

    import planner

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 2048), nn.ReLU(),
                          nn.Linear(2048, 10))
    limit = limit_mb * 2**20
    try:
        plan = planner.optimize(model, "2xV100", example_inputs=(torch.randn(64, 512),),
                                optimizer="adamw", memory_limit_bytes=limit, precision="fp32",
                                prefer_standard=0)
    except planner.PlanDoesNotFit:
        return
    assert max(plan.predicted.memory_bytes) <= limit, plan.explain()
