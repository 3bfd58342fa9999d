"""Llama 4's mixture of experts run sparsely: each token through its top-k experts only.

transformers' `Llama4TextMoe` routes densely: it tiles every token once per expert
(`hidden_states.repeat(num_experts, 1)`), scales each copy by its router score (0 for the
experts not chosen: the sigmoid of -inf) and runs all 16 experts on all tokens with two
`bmm`s. Traced as written, Llama 4 Scout's MoE block was priced at what that runs:
16/1 = 16 times its routed experts' FLOPs (1.4e14 forward FLOPs a layer at 32,768 tokens,
where 1 expert a token and the shared one make 1.6e13) and 47 GB of activations a layer
kept for backward (the [16 x tokens, 2 x 8192] gate/up product and the rest), about 2.3 TB
over its 48 layers at batch 8 x 4096; with the batch (8) smaller than the ranks, every
block ran replicated in the 1-D program, which asked for 4,826 GB per device on every
cluster, and no 3-D shape held it either.

`route_sparsely(model)` gives each such block the forward Meta's own and torchtitan's
MoE run: the (token, expert) pairs of its top-k sorted by expert, each pair's input scaled
by its score (Llama 4 scales the input, not the output), the experts run as grouped
matmuls on their own pairs (transformers' `_grouped_mm`: torch's grouped_mm kernel on a
GPU, its fallback on CPU and meta), the outputs summed back per token beside the shared
expert's. The same function of the same weights: an expert not chosen got a zero input
in the dense form and gives zero (no biases; act(0)·0 = 0), and the router's gradient
flows through the same sigmoid of the same top-k logits. tests/test_moe_pricing.py checks
outputs and gradients against transformers' forward.

profiler.presets builds every preset and config.json model through it, so the model the
planner traces and the one the executor runs are the same; a user building a Llama 4
model of their own calls it before `planner.optimize` and before `executor.parallelize`.
"""

from __future__ import annotations

import types

import torch
from torch import nn


def _is_dense_llama4(module: nn.Module) -> bool:
    experts = getattr(module, "experts", None)
    return (all(hasattr(module, a) for a in ("router", "shared_expert", "top_k"))
            and isinstance(getattr(module, "router", None), nn.Linear)
            and experts is not None
            and all(hasattr(experts, a) for a in ("gate_up_proj", "down_proj", "act_fn"))
            and experts.gate_up_proj.dim() == 3
            and experts.gate_up_proj.shape[1] == experts.down_proj.shape[2])  # [E, H, 2I]


def sparse_forward(self, hidden_states: torch.Tensor):
    """Llama4TextMoe.forward, (output, router logits), with each token through its top-k
    experts only (see the module docstring)."""
    from transformers.integrations.moe import _grouped_mm

    experts = self.experts
    hidden = experts.gate_up_proj.shape[1]
    x = hidden_states.reshape(-1, hidden)
    logits = nn.functional.linear(x, self.router.weight, self.router.bias)
    top_value, top_index = torch.topk(logits, self.top_k, dim=1)
    scores = torch.sigmoid(top_value.float()).to(logits.dtype)
    expert_ids, order = torch.sort(top_index.reshape(-1), stable=True)
    token = order // self.top_k
    pairs = x[token] * scores.reshape(-1)[order].unsqueeze(-1)
    count = experts.gate_up_proj.shape[0]
    # histc: CPU counts floats only, CUDA integers only (as transformers' grouped forward)
    ids = expert_ids.float() if x.device.type in ("cpu", "mps") else expert_ids.int()
    offsets = torch.cumsum(torch.histc(ids, bins=count, min=0, max=count - 1), dim=0,
                           dtype=torch.int32)
    gate, up = _grouped_mm(pairs, experts.gate_up_proj, offsets).chunk(2, dim=-1)
    routed = _grouped_mm(up * experts.act_fn(gate), experts.down_proj, offsets)
    out = self.shared_expert(x)
    out = out.index_add(0, token, routed.to(out.dtype))
    return out, logits


def route_sparsely(model: nn.Module) -> int:
    """Give every dense-routed Llama 4 MoE block of `model` the sparse forward (in place,
    on the instance); the number of blocks changed. Idempotent."""
    changed = 0
    for module in model.modules():
        if _is_dense_llama4(module) and getattr(module.forward, "__func__", None) is not sparse_forward:
            module.forward = types.MethodType(sparse_forward, module)
            changed += 1
    return changed
