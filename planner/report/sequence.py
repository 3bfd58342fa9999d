"""The plan's sequence-parallel layers in one line, for explain(): which, and what they buy."""

from __future__ import annotations

from planner.plan import Plan
from strategies.catalog import OPTIMIZER_STATE_FACTOR


def _names(names: list[str]) -> str:
    return ", ".join(names if len(names) <= 6 else names[:3] + ["..."] + names[-2:])


def _mb(nbytes: float) -> str:
    if nbytes < 1e5:
        return f"{nbytes / 1e3:.1f} KB"
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def sequence_lines(plan: Plan) -> list[str]:
    """One line naming the layers that run on their share of the tokens (none if no layer
    does), and why: the activations they keep and the compute they do drop to 1/P, for the
    same bytes sent (a reduce-scatter and an all-gather where tensor parallelism
    all-reduces)."""
    layers = [l for l in plan.layers if l.strategy == "sequence_parallel"]
    if not layers:
        return []
    ranks = plan.mesh.size("tp") if plan.is_mesh_3d else plan.num_devices
    per_weight = plan.training_precision.weights_bytes(
        1.0, OPTIMIZER_STATE_FACTOR.get(plan.optimizer, 2), sharded=False)
    kept = sum(l.memory_bytes - l.param_bytes * per_weight for l in layers)
    compute_s = sum(l.compute_s for l in layers)
    return [f"Sequence parallel: {len(layers)} layers ({_names([l.name for l in layers])}) run "
            f"on 1/{ranks} of the tokens, between row-parallel layers that reduce-scatter and "
            f"column-parallel ones that all-gather (the bytes of the all-reduces they replace): "
            f"{_mb(kept)} of activations per device instead of {_mb(kept * ranks)}, "
            f"{_ms(compute_s)} of compute per step instead of ~{_ms(compute_s * ranks)}"]
