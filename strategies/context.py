"""The price of context parallelism for one transformer block (or its attention): the
sequence split over a cp group with the head-tail balance, keys and values all-gathered
inside attention, as executor.context_parallel runs it (and Llama 3's training did).

Per microbatch, on each rank of the cp group:
- compute: 1/cp of the block's work. Everything but attention's scores is per token; the
  scores under a causal mask are balanced by the head-tail split (rank r's chunks r and
  2cp-1-r see 2cp+1 chunks of keys together, whatever r), so they divide by cp too. (The
  executor's explicit mask makes each rank compute its queries' dense scores, 1/cp of the
  one-process dense scores, which is what the CPU and math kernels compute; a GPU kernel
  that skips masked blocks needs torch's ring attention to keep its saving.)
- communication: an all-gather of K and V (n = both, whole sequence, in the activation
  dtype: 2 · batch · seq · kv_heads · head_dim elements) in forward, and its backward, a
  reduce-scatter of their gradients over the same n (strategies.collectives).
- memory: the weights whole (replicated over cp), 1/cp of the activations, and the
  gathered keys and values attention keeps for backward (grouped-query heads as they are:
  SDPA's `enable_gqa` shares them).
- gradient sync: the weights' gradients all-reduced over the cp group, as data
  parallelism's are (each rank's weights saw only its tokens); like DataParallel's, in the
  notes, since the planner charges the sync once a step over every replica.

Not offered to the search yet: `context_parallel_cost(layer, cp, ctx)` is what a search
calls per block.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from profiler.graph import Layer
from strategies.catalog import (
    Cost,
    CostContext,
    Strategy,
    compute_s,
    gradient_sync,
    update_s,
    weights_memory,
)
from strategies.collectives import all_gather_s, collective_bytes, reduce_scatter_s
from strategies.layouts import Layout


@dataclass(frozen=True)
class ContextParallel(Strategy):
    """A transformer block on this rank's balanced chunks of every sequence (takes and
    gives the sequence layout), attention's K/V gathered over the cp group (ctx.ranks)."""

    name: ClassVar[str] = "context_parallel"
    takes: Layout = Layout.SEQUENCE
    gives: Layout = Layout.SEQUENCE

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        shape = layer.output.shape
        return ctx.ranks > 1 and len(shape) == 3 and shape[1] % (2 * ctx.ranks) == 0

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        cp = ctx.ranks
        kv = kv_bytes(layer)
        gather, scatter = all_gather_s(kv, cp, ctx.link), reduce_scatter_s(kv, cp, ctx.link)
        sent = collective_bytes("all_gather", kv, cp) + collective_bytes("reduce_scatter", kv, cp)
        # the gathered copy is the extra: one process's keys and values are among its
        # activations already
        kept = layer.activation_bytes / cp + (kv if cp > 1 else 0.0)
        sync = gradient_sync(layer.param_bytes, cp, ctx.link, ctx)
        return Cost(compute_s(layer, 1 / cp, ctx), gather + scatter,
                    weights_memory(layer.param_bytes, ctx) + kept,
                    update_s(layer.param_bytes, ctx),
                    {"kv_bytes": kv, "kv_all_gather_s": gather, "kv_reduce_scatter_s": scatter,
                     "communication_bytes": sent, "gradient_bytes": layer.param_bytes,
                     "gradient_all_reduce_s": sync.all_reduce_s,
                     "gradient_sent_bytes": sync.sent_bytes})


def heads(layer: Layer) -> tuple[int, int]:
    """(query heads, key/value heads) from the traced attributes (a Hugging Face block's
    config, an attention module's own); (1, 1) where none were traced: K and V as wide as
    the hidden state."""
    a = layer.attrs
    q = a.get("num_heads") or a.get("heads") or a.get("n_head") or a.get("num_attention_heads")
    q = q or 1
    return q, a.get("num_key_value_heads") or q


def kv_bytes(layer: Layer) -> float:
    """Bytes of the whole sequence's keys and values, together, for the layer's
    [batch, seq, hidden] output: 2 x its bytes x kv_heads / q_heads (head_dim x q_heads
    = hidden, or `head_dim` where the layer traced one)."""
    shape = layer.output.shape
    q_heads, kv_heads = heads(layer)
    head_dim = layer.attrs.get("head_dim") or shape[-1] / q_heads
    element = layer.output.nbytes / math.prod(shape)
    return 2 * math.prod(shape[:-1]) * kv_heads * head_dim * element


def context_parallel_cost(layer: Layer, cp: int, ctx: CostContext) -> Cost:
    """The price of running `layer` (a transformer block, [batch, seq, hidden] out) under
    context parallelism of degree `cp`, the microbatch's rows `ctx.batch` whole on the
    group; raises where the sequence does not split into 2·cp balanced chunks."""
    at = replace(ctx, ranks=cp)
    if cp > 1 and not ContextParallel().applies(layer, at):
        raise ValueError(f"context parallel: {layer.name}'s output {layer.output.shape} is "
                         f"not [batch, seq, hidden] with seq a multiple of 2·cp = {2 * cp}; "
                         f"choose a cp that divides seq / 2")
    return ContextParallel().cost(layer, at)
