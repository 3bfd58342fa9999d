"""Attention run on meta tensors, saving for backward what a device's kernel saves.

What autograd keeps follows the kernel the device picks. On meta,
`aten.scaled_dot_product_attention` has no fused kernel to pick and takes its math path,
which saves the whole score matrix: a 405 B Llama's attention kept 18 GB a layer at
8,192 tokens, where a GPU (or a CPU) runs a fused kernel that keeps q, k, v, its output
and a row statistic. A model too large for memory is built on meta (profiler.presets), so
an exported graph of it is run for its saved bytes (profiler.export_trace) with this
module's `run_node`, which runs each such call as the memory-efficient kernel: the one
torch picks on a GPU for a call with a mask, and whose saves (q, k, v, output,
log-sum-exp, the mask as a bias) match the flash kernel's but for that bias. The fx
path does the same by running meta modules on fake CPU tensors (profiler.trace._on_cpu);
an exported graph cannot, its device assertions say meta.
"""

from __future__ import annotations

import torch
from torch import fx

SDPA = torch.ops.aten.scaled_dot_product_attention.default


def run_node(interp: fx.Interpreter, node: fx.Node):
    """Run `node` as `interp` would, but a scaled_dot_product_attention on meta tensors as
    the memory-efficient kernel (the module docstring); for profiler.saved.run_recorded."""
    if node.op == "call_function" and node.target is SDPA:
        args, kwargs = interp.fetch_args_kwargs_from_env(node)
        if args[0].is_meta:
            biases = interp.__dict__.setdefault("_attention_biases", {})
            return efficient_attention(*args, biases=biases, **kwargs)
    return fx.Interpreter.run_node(interp, node)


def efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                        scale=None, enable_gqa=False, biases=None):
    """scaled_dot_product_attention's output, computed by the memory-efficient kernel
    (grouped-query heads repeated to the query's, as the math path does; a boolean mask as
    an additive bias of its last two dims broadcast over batch rows and heads, made once
    per mask in `biases` as the model's one mask serves every layer). On meta only shapes
    and storages exist, which is all the saved bytes read: no value is computed."""
    if enable_gqa and key.size(-3) != query.size(-3):
        repeat = query.size(-3) // key.size(-3)
        key = key.repeat_interleave(repeat, dim=-3)
        value = value.repeat_interleave(repeat, dim=-3)
    bias = attn_mask
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # keyed by the mask kept alive beside its bias, so that no other mask takes its id
        _, cached = (None, None) if biases is None else biases.get(id(attn_mask), (None, None))
        if cached is None:
            square = attn_mask[(0,) * (attn_mask.dim() - 2)]  # the mask's last two dims
            cached = torch.zeros(square.shape, dtype=query.dtype, device=query.device)
            cached = cached.masked_fill(square.logical_not(), float("-inf"))
            cached = cached.expand(attn_mask.shape)
            if biases is not None:
                biases[id(attn_mask)] = (attn_mask, cached)
        bias = cached
    out, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale)
    return out
