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

A context-parallel plan (planner.context_plan, the "cp" baseline) runs over one group of
cp x dp ranks: `ContextParallel(degree=cp)` on each attention block, `TokenShard` on every
other layer (the model's own code on the rank's tokens), and their `+fsdp` variants where
FSDP2 shards the weights over the whole group. `context_parallel_cost(layer, cp, ctx)`
prices one block on a group of cp ranks alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

from profiler.graph import Layer
from strategies.catalog import (
    Cost,
    CostContext,
    DataParallel,
    Replicate,
    Strategy,
    compute_s,
    gradient_sync,
    update_s,
    weights_memory,
)
from strategies.collectives import all_gather_s, collective_bytes, reduce_scatter_s
from strategies.layouts import Layout
from strategies.memory import ShardedDataParallel

FSDP_SUFFIX = "+fsdp"  # a variant whose weights FSDP2 shards over the whole group
# the strategies whose weights see only their rank's tokens: gradients summed over every
# rank of the group (planner.dp_shard.SUMMED_OVER_TP, strategies.step_memory)
TOKEN_SPLIT = ("context_parallel", "token_shard")


@dataclass(frozen=True)
class ContextParallel(Strategy):
    """A transformer block (or its attention) on this rank's balanced chunks of every
    sequence (takes and gives the sequence layout), attention's K/V gathered over the cp
    group. `degree`: cp, the group's ranks split into dp = ranks / cp replicas of the
    rows (cp consecutive ranks each, the mesh ("dp", "cp")); 0: cp is every rank."""

    name: ClassVar[str] = "context_parallel"
    takes: Layout = Layout.SEQUENCE
    gives: Layout = Layout.SEQUENCE
    degree: int = 0

    def split(self, ctx: CostContext) -> tuple[int, int]:
        """(cp, dp) of this strategy on `ctx`'s group."""
        cp = self.degree or ctx.ranks
        return cp, ctx.ranks // cp

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        cp, dp = self.split(ctx)
        shape = layer.output.shape
        # degree 1 (asked for): every sequence whole, the family's data-parallel end
        return ((self.degree > 0 or cp > 1) and ctx.ranks % cp == 0 and len(shape) == 3
                and shape[0] % dp == 0
                and shape[1] % (2 * cp) == 0)

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        cp, dp = self.split(ctx)
        link = ctx.cluster.link(cp)  # the cp group: consecutive ranks
        kv = kv_bytes(layer) / dp  # one replica's rows
        gather, scatter = all_gather_s(kv, cp, link), reduce_scatter_s(kv, cp, link)
        sent = collective_bytes("all_gather", kv, cp) + collective_bytes("reduce_scatter", kv, cp)
        # the gathered copy is the extra: one process's keys and values are among its
        # activations already
        kept = layer.activation_bytes / ctx.ranks + (kv if cp > 1 else 0.0)
        sync = gradient_sync(layer.param_bytes, ctx.ranks, ctx.link, ctx)
        # every rank's work is 1/(cp·dp) of the batch's: 1/cp of its replica's rows
        return Cost(compute_s(layer, 1 / ctx.ranks, ctx), gather + scatter,
                    weights_memory(layer.param_bytes, ctx) + kept,
                    update_s(layer.param_bytes, ctx),
                    {"kv_bytes": kv, "kv_all_gather_s": gather, "kv_reduce_scatter_s": scatter,
                     "kv_sent_bytes": sent, "communication_bytes": sent + sync.sent_bytes,
                     "gradient_bytes": layer.param_bytes,
                     "gradient_all_reduce_s": sync.all_reduce_s,
                     "gradient_sent_bytes": sync.sent_bytes, "cp": cp})


@dataclass(frozen=True)
class ShardedContextParallel(ContextParallel):
    """ContextParallel with the block's weights, gradients and optimizer state fully
    sharded over the whole group (FSDP2 over cp x dp, as torchtitan runs long context):
    its price is ContextParallel's compute and K/V traffic with ShardedDataParallel's
    weights and their gathers and reduce-scatter over the group."""

    name: ClassVar[str] = "context_parallel" + FSDP_SUFFIX
    shards_weights: ClassVar[bool] = True

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        return layer.param_bytes > 0 and layer.op == "call_module" and super().applies(layer, ctx)

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        return _sharded(super().cost(layer, ctx), layer, ctx)


@dataclass(frozen=True)
class TokenShard(DataParallel):
    """Any layer but attention under context parallelism: the model's own code on this
    rank's tokens (1/cp of its replica's rows: 1/ranks of the batch's tokens, the work of a
    data-parallel rank), weights whole, gradients summed over cp x dp. A layer whose output
    holds no rows (a position table, a rotary cache) runs whole on every rank."""

    name: ClassVar[str] = "token_shard"
    takes: Layout = Layout.SEQUENCE
    gives: Layout = Layout.SEQUENCE

    def applies(self, layer, ctx):
        return ctx.ranks > 1

    def cost(self, layer, ctx):
        if layer.output.has_rows(ctx.batch):
            return super().cost(layer, ctx)
        whole = Replicate().cost(layer, ctx)
        sync = gradient_sync(layer.param_bytes, ctx.ranks, ctx.link, ctx)
        return replace(whole, notes={"gradient_bytes": layer.param_bytes,
                                     "gradient_all_reduce_s": sync.all_reduce_s,
                                     "communication_bytes": sync.sent_bytes})


@dataclass(frozen=True)
class ShardedTokenShard(TokenShard):
    """TokenShard with the layer's weights fully sharded over the group (FSDP2)."""

    name: ClassVar[str] = "token_shard" + FSDP_SUFFIX
    shards_weights: ClassVar[bool] = True

    def applies(self, layer, ctx):
        return layer.param_bytes > 0 and layer.op == "call_module" and ctx.ranks > 1

    def cost(self, layer, ctx):
        return _sharded(super().cost(layer, ctx), layer, ctx)


def _sharded(plain: Cost, layer: Layer, ctx: CostContext) -> Cost:
    """`plain` (weights replicated) with the weights as ShardedDataParallel prices them over
    the group: 1/ranks of weights, gradients and optimizer state, their all-gathers and
    reduce-scatter in place of the all-reduce."""
    fsdp = ShardedDataParallel().cost(layer, ctx)
    weights = weights_memory(layer.param_bytes, ctx)
    sharded = weights_memory(layer.param_bytes / ctx.ranks, ctx, sharded=True)
    notes = {k: v for k, v in plain.notes.items()
             if k not in ("gradient_all_reduce_s", "gradient_sent_bytes")}
    notes.update(fsdp.notes)
    # the K/V traffic stays; the gradients' all-reduce gives way to FSDP's collectives
    notes["communication_bytes"] = (plain.notes.get("kv_sent_bytes", 0.0)
                                    + fsdp.notes["communication_bytes"])
    return Cost(plain.compute_s, plain.communication_s + fsdp.communication_s,
                plain.memory_bytes - weights + sharded, fsdp.update_s, notes)


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
