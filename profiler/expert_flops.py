"""FLOPs of grouped matmuls, which torch.utils.flop_counter does not count.

transformers 5.x runs a mixture of experts' routed experts as grouped matmuls (its
`grouped_mm` experts implementation, the default): the (token, expert) pairs sorted by
expert, then one `torch._grouped_mm` (on a GPU) or `torch.ops.transformers.
grouped_mm_fallback` (on CPU and meta, where a model is traced) per projection, each pair's
row multiplied by its own expert's weight. FlopCounterMode has no formula for either, so
every routed experts layer was counted at 0 FLOPs: compute priced at nothing, and the
tokens' k experts missing from each MoE layer's time. `register()` adds one formula for
both: input [S, K] x weights [E, K, N] -> 2·S·K·N (each of the S pairs through one
expert); the other layouts grouped_mm takes are counted the same way (2-D x 2-D, the
weight gradient's [K, S] x [S, N] -> [E, K, N]: 2·K·S·N; 3-D x 3-D, batched: 2·B·M·K·N).
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula


def grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    """FLOPs of a grouped matmul of `a` by `b`, whatever the grouping (see above)."""
    if len(a_shape) == 2 and len(b_shape) == 3:  # pairs x experts' weights
        return 2 * a_shape[0] * a_shape[1] * b_shape[2]
    if len(a_shape) == 2 and len(b_shape) == 2:  # groups along the shared dim
        return 2 * a_shape[0] * a_shape[1] * b_shape[1]
    if len(a_shape) == 3 and len(b_shape) == 3:  # batched
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[2]
    if len(a_shape) == 3 and len(b_shape) == 2:  # per-group inputs x one shared weight
        return 2 * a_shape[0] * a_shape[1] * a_shape[2] * b_shape[1]
    return 0


def _targets() -> list:
    found = []
    if hasattr(torch.ops.aten, "_grouped_mm"):
        found.append(torch.ops.aten._grouped_mm)
    transformers_ops = getattr(torch.ops, "transformers", None)
    try:
        found.append(transformers_ops.grouped_mm_fallback)
    except (AttributeError, RuntimeError):  # transformers' MoE integration not imported
        pass
    return found


def register() -> None:
    """Give FlopCounterMode a formula for each grouped matmul op loaded now (idempotent:
    call it before counting, once transformers' MoE integration may have defined its op)."""
    todo = [t for t in _targets() if t not in flop_registry]
    if todo:
        register_flop_formula(todo)(grouped_mm_flops)
