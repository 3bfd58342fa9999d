"""A plan's predicted memory per device is not below what a rank holds: the 1-D plan kinds
and a pipeline of a 19 M-parameter MLP on 2 gloo ranks, measured by torch's MemTracker
over the second of two AdamW steps (benchmarks/memory.py), each rank's prediction at least
95% of its peak (issue 36: never below by more than 5%) and at most 15% above it; and what
the step holds beside the layers is added to 3-D plans by the same rule as to 1-D ones."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

BELOW, ABOVE = 0.05, 0.15


@pytest.mark.slow
def test_predicted_memory_holds_on_two_ranks():
    from memory import run

    rows = run(ranks_list=(2,), cases=("mlp19m",), kinds=("ddp", "fsdp", "tensor", "pipeline"))
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
    if max(plan.predicted.memory_bytes) > limit:
        assert plan.solver.note.startswith("does not fit by"), plan.explain()
        assert "does not fit" in plan.explain()


def test_a_3d_plan_adds_what_each_pipeline_rank_holds():
    """Each device's memory is its breakdown (the stage problem's per-layer sum) plus
    strategies.step_memory.step_held_bytes of the layers its pipeline rank runs: the rule
    1-D plans follow (planner.pipeline.stage_held.held_beside_stages), here the for-loop AdamW's two
    temporaries of the rank's largest layer, the buffers of the cut, and on the last stage
    the loss and the buffers torch.distributed.pipelining receives into."""
    import math

    import torch
    from torch import nn

    from planner.pipeline.stage_held import stage_loss_bytes
    from planner.plan3d import optimize_3d
    from planner.search import Shape

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 64))
    plan = optimize_3d(model, "2xcpu", (torch.randn(32, 64),), optimizer="adamw",
                       measure=False, only=[Shape(2, 1, 1, 2, "1F1B")], time_limit_s=10)
    pp = plan.mesh.shape[0]
    assert pp == 2 and plan.microbatches == 2
    by_node = {l.node: l for l in plan.layers}
    # a tensor crossing the cut: a receive buffer per microbatch on stage 1, one for its
    # gradient on stage 0 (strategies.step_memory.pipeline_buffer_bytes)
    crossing = sum(4 * math.prod(by_node[n].output_shape) for l in plan.layers
                   if l.stage == 1 for n in l.inputs if n in by_node
                   and by_node[n].stage == 0)
    assert crossing > 0
    last = plan.layers[-1]
    numel = math.prod(last.output_shape) // plan.microbatches  # one microbatch's
    # every rank holds the global batch and its rows' copy (stage_held.batch_held_bytes)
    batch = 4 * 32 * 64 * 2
    for device, (total, b) in enumerate(zip(plan.predicted.memory_bytes,
                                            plan.predicted.memory_breakdown)):
        mine = [l for l in plan.layers if l.stage == device]
        held = 2 * max((l.param_bytes for l in mine), default=0.0) + crossing
        if last.stage == device:
            held = crossing + max(held - crossing, stage_loss_bytes(numel))
        # the sum, less what the schedule never holds together (a pipeline rank's take
        # back: strategies.step_memory.schedule_not_together_bytes), which is at most the
        # activations and leaves every gradient beside the weights and optimizer state
        assert total <= b.total_bytes + held + batch + 1e-6, (device, plan.explain())
        assert total >= b.total_bytes + held + batch - b.activations_bytes - 1e-6
        assert total >= (b.parameters_bytes + b.gradients_bytes + b.optimizer_state_bytes
                         + crossing + batch)


def test_a_pipeline_rank_holds_its_gradients_beside_later_activations():
    """planner.pipeline.stage_held.together_bytes on hand-made orders: a full backward
    frees each layer's activations as its gradient is made, a split one's W only at its
    end; the gradients stay after a stage's first backward, beside the activations of the
    forwards after it."""
    from planner.pipeline.schedules import Act
    from planner.pipeline.stage_held import together_bytes
    from strategies.step_memory import schedule_not_together_bytes

    # one stage of two layers: gradients 4 and 1, activations per microbatch 2 and 3
    layers = {0: [(4.0, 2.0), (1.0, 3.0)]}
    one_f_one_b = [Act(0, "F", 0), Act(0, "F", 1), Act(0, "B", 0), Act(0, "F", 2),
                   Act(0, "B", 1), Act(0, "B", 2)]
    # B(0): the other microbatch's 5 beside at most 5 of this one's (gradients made,
    # activations left: 3, then 5): 10; F(2): two microbatches' 10 and the gradients' 5
    assert together_bytes(one_f_one_b, layers) == 15.0
    split = [Act(0, "F", 0), Act(0, "F", 1), Act(0, "I", 0), Act(0, "W", 0),
             Act(0, "I", 1), Act(0, "W", 1)]
    # W(0) frees nothing before its end: 10 of activations and 5 of gradients
    assert together_bytes(split, layers) == 15.0
    gpipe = [Act(0, "F", 0), Act(0, "F", 1), Act(0, "B", 0), Act(0, "B", 1)]
    # B(0): max(10, 5 + (1 + 2), 5 + 5) = 10
    assert together_bytes(gpipe, layers) == 10.0
    # the sum prices 5 of gradients + 10 of activations + max(2, 0); the rank holds
    # max(5 + 2, 10 + 0)
    assert schedule_not_together_bytes(5.0, 10.0, 10.0, 2.0, 0.0) == 7.0


@pytest.mark.parametrize("limit_mb", [1.2, 1.6, 2.0, 2.6])
def test_a_3d_plan_fits_its_limit_with_what_the_step_holds_or_says_it_does_not(limit_mb):
    """The stage problem sums the layers; a 3-D plan whose step holds more than the limit
    allows has its shape solved again with the limit lowered (planner.plan3d.plan_3d);
    where that finds nothing, the plan says by how much it does not fit, or the search
    finds no plan at all and refuses."""
    import torch
    from torch import nn

    import planner
    from planner.plan3d import optimize_3d

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(),
                          nn.Linear(256, 64))
    limit = limit_mb * 1e6
    try:
        plan = optimize_3d(model, "2xcpu", (torch.randn(32, 64),), optimizer="adamw",
                           measure=False, memory_limit_bytes=limit, time_limit_s=10)
    except planner.PlanDoesNotFit:
        return
    if max(plan.predicted.memory_bytes) > limit:
        assert plan.solver.note.startswith("does not fit by"), plan.explain()
        assert "does not fit" in plan.explain()
