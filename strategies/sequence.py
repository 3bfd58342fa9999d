"""Sequence parallelism: norms, dropout and residual adds on 1/P of the tokens, inside a
tensor-parallel region (Megatron-SP, Korthikanti et al. 2022; torch's `SequenceParallel`).

Plain tensor parallelism all-reduces a row-parallel layer's output, and every rank then
runs the LayerNorm, dropout and residual add on the whole [batch, seq, hidden] activation
and keeps it for backward. Sequence parallelism reduce-scatters it on the sequence dim
instead (each rank gets seq/P tokens), runs those ops on its tokens, and all-gathers before
the next column-parallel layer, whose input gradient comes back reduce-scattered. A ring
all-reduce is a reduce-scatter then an all-gather, so the bytes sent are the same; those
ops' compute and the activations they keep drop to 1/P. Unlike the batch-row split
(`gives=BATCH`), it needs no rows: a replica of one 8,192-token sequence splits as well.

Here: the layout is `Layout.SEQUENCE` (Shard(1)); `SequenceParallel` is the strategy of
the ops between (takes and gives it); the row-parallel layers' `gives=SEQUENCE` variants
reduce-scatter into it (strategies.catalog, strategies.transformer); the edge into a
column-parallel layer prices the all-gather (strategies.edges). Only offered on outputs
shaped [batch, seq, hidden] with seq a multiple of P whose sizes no code reads
(layouts.sequence_splits). Executed with torch's ColwiseParallel(input_layouts=Shard(1))
and RowwiseParallel(output_layouts=Shard(1)); the ops between run on each rank's tokens
as they are (executor.styles says why not torch's SequenceParallel). fx-traced models
only: torch.export plans hand every module output to the model's own code split by rows
(executor.modules), which would undo it, so planner.offers leaves it out there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from profiler.graph import Layer
from strategies.catalog import DataParallel, Strategy, matches, offer_everywhere, register
from strategies.layouts import Layout, sequence_splits
from strategies.rowwise import ELEMENTWISE

# module types that treat each token on its own (norms over the hidden dim, dropout)
_SEQUENCEWISE: set[type | str] = {nn.LayerNorm, nn.RMSNorm, nn.Dropout}
# element-wise ops that make a tensor from sizes: on a rank's tokens they would use the
# whole sequence's
_FACTORIES = {"arange", "zeros", "ones", "full", "empty", "new_full", "new_empty",
              "new_ones", "new_zeros", "scalar_tensor", "fill", "lift_fresh_copy",
              "_assert_tensor_metadata"}


def register_sequencewise(module_type: type | str) -> None:
    """Say that `module_type` (a class or its qualified name) treats each token on its own,
    so it may run sequence-parallel, e.g. an RMSNorm written in plain ops (traced as one
    layer from then on, as torch's own norms are; its rows stay independent too)::

        register_sequencewise("my_library.MyRMSNorm")
    """
    _SEQUENCEWISE.add(module_type)
    register(module_type, rowwise=True, leaf=True)


def _tokenwise(layer: Layer) -> bool:
    """Each output token depends on the same token of its inputs only."""
    if layer.module_type is not None:
        known = any(matches(layer.module_type, key) for key in _SEQUENCEWISE)
        return known and layer.attrs.get("normalized_dims", 1) == 1
    shapes = [tuple(s) for s in layer.attrs.get("in_shapes", ())]
    # element-wise over inputs all of the output's shape (dim 0 aside: the 3-D search scales
    # the output to a microbatch, not the inputs): a broadcast operand (a bias, a [seq,
    # hidden] position table) would need its own split
    out = layer.output.shape
    return (layer.kind in ELEMENTWISE and layer.kind not in _FACTORIES and not layer.params
            and bool(shapes) and len({s[:1] for s in shapes}) == 1
            and all(len(s) == len(out) and s[1:] == out[1:] for s in shapes))


@dataclass(frozen=True)
class SequenceParallel(Strategy):
    """A norm, dropout or element-wise op run on this rank's seq/P tokens, its weights
    replicated and their gradients summed over the ranks in data parallelism's buckets
    (as Megatron-SP does): takes and gives the sequence layout."""

    name: ClassVar[str] = "sequence_parallel"
    takes: Layout = Layout.SEQUENCE
    gives: Layout = Layout.SEQUENCE

    def applies(self, layer, ctx):
        if ctx.ranks < 2 or layer.is_input or not sequence_splits(layer, ctx.batch, ctx.ranks):
            return False
        if layer.module_type is not None and layer.op != "call_module":
            return False
        return _tokenwise(layer)

    def cost(self, layer, ctx):
        # 1/P of the work and of the activation, the weights' gradients summed with the
        # data-parallel ones: data parallelism's price, split by tokens instead of rows
        return DataParallel().cost(layer, ctx)


offer_everywhere(SequenceParallel())
register_sequencewise("transformers.models.llama.modeling_llama.LlamaRMSNorm")
