"""Where a module call's main input is, for the hooks that reshard it."""

from __future__ import annotations

import torch


def main_input(args: tuple, kwargs: dict) -> str | int | None:
    """Where a module's main input is: the first positional argument where it is a tensor,
    or (Hugging Face layers call `attn(hidden_states=...)`) the `hidden_states` keyword, or
    the first tensor keyword. The planner's layer reads its first input from there. (Pegasus
    calls its positions `embed_positions((batch, seq), 0, position_ids=...)`: the tensor
    the trace saw is the keyword.)"""
    if args and isinstance(args[0], torch.Tensor):
        return 0
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return "hidden_states"
    return next((k for k, v in kwargs.items() if isinstance(v, torch.Tensor)), None)
