"""What the plan's memory levers save and cost, for explain(): tensor splits, sharded data
parallelism (fsdp) and recomputation, each against that layer run plainly data-parallel."""

from __future__ import annotations

from planner.plan import Plan
from strategies.catalog import OPTIMIZER_STATE_FACTOR


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms"


def lever_lines(plan: Plan) -> list[str]:
    """One line per lever: how many layers use it, the memory per device it saves, the
    time per step it costs (from the plan's own per-layer costs)."""
    if plan.num_devices == 1 or plan.is_mesh_3d:
        return []
    ranks = plan.num_devices
    # bytes per byte of fp32 weights: weights, gradients, state (and autocast's copy)
    per_weight = plan.training_precision.weights_bytes(
        1.0, OPTIMIZER_STATE_FACTOR.get(plan.optimizer, 2), sharded=False)
    split = [l for l in plan.layers if l.model_parallel]
    sharded = [l for l in plan.layers if l.strategy == "fsdp"]
    recomputed = [l for l in plan.layers if l.recompute]
    split_saved = sum(l.param_bytes * per_weight * (1 - 1 / ranks) for l in split)
    split_s = sum(l.communication_s + l.reshard_in_s for l in split)
    return [
        "Memory levers (per device, each against the same layers run plainly data-parallel):",
        f"  tensor split: {len(split)} layers, {_gb(split_saved)} of weights, gradients and "
        f"optimizer state saved; their collectives and layout changes {_ms(split_s)}/step",
        f"  sharded data parallel (fsdp): {len(sharded)} layers, "
        f"{_gb(sum(l.saved_bytes - l.recompute_saved_bytes for l in sharded))} saved; "
        f"parameter all-gathers in forward and backward cost "
        f"{_ms(sum(l.lever_s - l.recompute_s for l in sharded))}/step more than an all-reduce",
        f"  recompute (activation checkpointing): {len(recomputed)} layers, "
        f"{_gb(sum(l.recompute_saved_bytes for l in recomputed))} of activations saved; "
        f"{_ms(sum(l.recompute_s for l in recomputed))}/step of extra forward",
    ]
