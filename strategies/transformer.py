"""Transformer strategies, as Megatron-LM shards a transformer block over tensor-parallel ranks.

- Attention split by heads (`HeadParallel`): the q, k, v projections are split by output
  columns so each rank holds whole heads, attention runs on those heads alone, and the
  output projection is split by input rows; its partial sums are reduced once at the end,
  by an all-reduce (output replicated) or a reduce-scatter (output split by rows). One
  layer in the plan: the attention module, traced as a leaf.
- MLP column-then-row: `ColumnParallel` and `RowParallel` of the catalog on the two Linears,
  with the activation between them `feature_parallel`.
- Vocabulary-parallel embedding (`VocabParallel`): the table split by rows (tokens), each
  rank looks up the ids it owns and the partial outputs are summed. The LM head is a
  Linear over the vocabulary: its column split gives vocabulary-sharded logits.
- Sequence parallelism (strategies.sequence): the same reduction as a reduce-scatter on
  the sequence dim (`gives=SEQUENCE`), norms, dropout and residual adds on 1/P of the
  tokens, an all-gather into the next column split, as Megatron-SP and torchtitan run it.
  The `gives=BATCH` variants do the same on the batch's rows, where a replica has P rows.

Hugging Face's layer types are registered by qualified name, so nothing here imports
transformers: GPT-2's `Conv1D` (a Linear with its weight transposed), GPT-2's and Llama's
attention, their activations. `register_attention` does the same for a user's own
attention module.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from profiler.graph import Layer
from strategies.catalog import (
    ColumnParallel, Cost, RowParallel, Strategy, register, split_compute_s, update_s,
    weights_memory,
)
from strategies.collectives import all_gather_s, all_reduce_s, collective_bytes, reduce_scatter_s
from strategies.layouts import Layout, sequence_splits


@dataclass(frozen=True)
class AttentionSpec:
    """Where an attention module keeps its projections, for the executor.

    qkv: the name of one fused projection ("c_attn"), or the names of the q, k and v
    projections. out: the output projection. divide: integer attributes that count the
    module's own heads or width and must become per-rank values (GPT-2's "split_size").
    """

    qkv: str | tuple[str, str, str]
    out: str
    divide: tuple[str, ...] = ()


ATTENTION: dict[type | str, AttentionSpec] = {}


def attention_spec(module: nn.Module) -> AttentionSpec | None:
    from strategies.catalog import matches

    for key, spec in ATTENTION.items():
        if matches(type(module), key):
            return spec
    return None


def _heads(layer: Layer) -> tuple[int, int]:
    """(query heads, key/value heads) of an attention layer, from its traced attributes."""
    a = layer.attrs
    q = a.get("num_heads", a.get("heads", a.get("n_head", a.get("num_attention_heads", 0))))
    return q, a.get("num_key_value_heads", q)


def _output_reduction(layer: Layer, gives: Layout, ctx) -> tuple[float, float, float]:
    """(time, bytes kept, bytes sent per rank) of summing a row-split layer's partial
    outputs into `gives` (and its gradient back); kept: the layer's activations
    (Layer.activation_bytes), split as its output is."""
    n, kept = layer.output.nbytes, layer.activation_bytes
    if gives in (Layout.BATCH, Layout.SEQUENCE):
        return (reduce_scatter_s(n, ctx.ranks, ctx.link) + all_gather_s(n, ctx.ranks, ctx.link),
                kept / ctx.ranks, (collective_bytes("reduce_scatter", n, ctx.ranks)
                    + collective_bytes("all_gather", n, ctx.ranks)))
    return (all_reduce_s(n, ctx.ranks, ctx.link), kept,
            collective_bytes("all_reduce", n, ctx.ranks))


def _tokens_ok(gives: Layout, layer: Layer, ctx) -> bool:
    """A reduce-scatter into the sequence layout needs an output it can split by tokens."""
    return gives != Layout.SEQUENCE or sequence_splits(layer, ctx.batch, ctx.ranks)


def _head_parallel_kept(layer: Layer, gives: Layout, ctx) -> float:
    """What a head-parallel attention keeps for backward on one rank: its heads' share of
    what the whole layer was measured to keep (Layer.activation_bytes: q, k, v, the
    attention output, the softmax's statistics; GPT-2's: 4.27 outputs' worth); unmeasured,
    q, k, v and the attention output of its heads (four outputs' worth over the ranks)
    beside its reduced output, whole or split as `gives` has it."""
    if layer.saved_per_output is not None:
        return layer.activation_bytes / ctx.ranks
    n = layer.output.nbytes
    out = n / ctx.ranks if gives in (Layout.BATCH, Layout.SEQUENCE) else n
    return out + 4 * n / ctx.ranks


@dataclass(frozen=True)
class HeadParallel(Strategy):
    """Attention with its heads split across the ranks (Megatron's attention split): takes
    the hidden states replicated (their gradient comes back partial), gives the output
    replicated (all-reduce) or split by rows or tokens (reduce-scatter)."""

    name: ClassVar[str] = "head_parallel"
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.REPLICATE_PARTIAL_GRAD
    gives: Layout = Layout.REPLICATE

    def applies(self, layer, ctx):
        q, kv = _heads(layer)
        rows_ok = self.gives != Layout.BATCH or ctx.batch % ctx.ranks == 0
        return (q > 0 and q % ctx.ranks == 0 and kv % ctx.ranks == 0 and rows_ok
                and _tokens_ok(self.gives, layer, ctx))

    def cost(self, layer, ctx):
        comm, _, sent = _output_reduction(layer, self.gives, ctx)
        local = layer.param_bytes / ctx.ranks
        memory = weights_memory(local, ctx) + _head_parallel_kept(layer, self.gives, ctx)
        # the executor's style runs DTensor as a row-parallel layer does (its input made
        # whole from a DTensor, its output reduced as one), and its weights are DTensors;
        # a rank's share of the heads, and of the weights' traffic (autocast's casts, the
        # gradient): "shard", not "batch", where the weights are whole on every rank
        return Cost(split_compute_s(layer, ctx, "shard"), comm, memory, update_s(local, ctx),
                    {"output_reduction_s": comm, "output_bytes": layer.output.nbytes,
                     "communication_bytes": sent})


@dataclass(frozen=True)
class VocabParallel(Strategy):
    """An embedding table split by rows (token ids): each rank looks up the ids it owns,
    zeros elsewhere, and the partial outputs are summed (all-reduce, or reduce-scatter to
    split rows). Takes the ids whole (they carry no gradient)."""

    name: ClassVar[str] = "vocab_parallel"
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.REPLICATE
    gives: Layout = Layout.REPLICATE

    def applies(self, layer, ctx):
        rows_ok = self.gives != Layout.BATCH or ctx.batch % ctx.ranks == 0
        return layer.attrs.get("num_embeddings", 0) % ctx.ranks == 0 and rows_ok \
            and layer.output.has_rows(ctx.batch) \
            and _tokens_ok(self.gives, layer, ctx)

    def cost(self, layer, ctx):
        comm, kept, sent = _output_reduction(layer, self.gives, ctx)
        local = layer.param_bytes / ctx.ranks
        # torch's RowwiseParallel on the embedding: a row-parallel layer's DTensor cost;
        # the rank's rows of the table ("shard": its gradient and casts too)
        return Cost(split_compute_s(layer, ctx, "shard"), comm,
                    weights_memory(local, ctx) + kept, update_s(local, ctx),
                    {"output_reduction_s": comm, "output_bytes": layer.output.nbytes,
                     "communication_bytes": sent})


@dataclass(frozen=True)
class Conv1DColumnParallel(ColumnParallel):
    """Column split of GPT-2's Conv1D (weight [in, out]): the weight's dim 1 is split."""

    name: ClassVar[str] = "column_parallel"

    def applies(self, layer, ctx):
        return layer.attrs.get("nf", 0) % ctx.ranks == 0


@dataclass(frozen=True)
class Conv1DRowParallel(RowParallel):
    """Row split of GPT-2's Conv1D: the weight's dim 0 (its input features) is split."""

    name: ClassVar[str] = "row_parallel"

    def applies(self, layer, ctx):
        ok = layer.attrs.get("nx", 0) % ctx.ranks == 0
        return ok and (self.gives != Layout.BATCH or ctx.batch % ctx.ranks == 0) \
            and _tokens_ok(self.gives, layer, ctx)


def register_attention(module_type: type | str, qkv: str | tuple[str, str, str], out: str,
                       divide: tuple[str, ...] = ()) -> None:
    """Make an attention module type head-parallel: traced as one layer, and offered
    `head_parallel` (output all-reduced or reduce-scattered) besides data parallelism::

        register_attention(CausalSelfAttention, qkv="qkv", out="proj")

    Its forward must read the head count from the projections' output size (view(...,
    -1, head_dim), chunk(3)), or name the attributes to divide by the ranks in `divide`.
    """
    ATTENTION[module_type] = AttentionSpec(qkv, out, tuple(divide))
    register(module_type, HeadParallel(), HeadParallel(gives=Layout.BATCH),
             HeadParallel(gives=Layout.SEQUENCE), rowwise=True, leaf=True)


_HF = "transformers.models."
register(nn.Embedding, VocabParallel(), VocabParallel(gives=Layout.BATCH),
         VocabParallel(gives=Layout.SEQUENCE))
register("transformers.pytorch_utils.Conv1D", Conv1DColumnParallel(), Conv1DRowParallel(),
         Conv1DRowParallel(gives=Layout.BATCH), Conv1DRowParallel(gives=Layout.SEQUENCE),
         rowwise=True)
for _act in ("NewGELUActivation", "GELUActivation", "FastGELUActivation", "QuickGELUActivation",
             "GELUTanh", "SiLUActivation", "PytorchGELUTanh", "ClassInstantier"):
    register(f"transformers.activations.{_act}", rowwise=True, featurewise=True)
register_attention(_HF + "gpt2.modeling_gpt2.GPT2Attention", qkv="c_attn", out="c_proj",
                   divide=("split_size", "num_heads", "embed_dim"))
register_attention(_HF + "llama.modeling_llama.LlamaAttention",
                   qkv=("q_proj", "k_proj", "v_proj"), out="o_proj")
for _norm in ("llama.modeling_llama.LlamaRMSNorm",):
    register(_HF + _norm, rowwise=True)
register(nn.RMSNorm, rowwise=True)
# A mixture of experts' experts modules are found by their shape and kept whole
# (strategies.experts); the router and shared experts around them are layers like any.
