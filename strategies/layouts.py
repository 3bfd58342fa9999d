"""How an activation tensor lies across the devices of a layer's group, in forward and backward.

A layout is a pair of DTensor placements: where the forward value lives, and how the
gradient that flows back into it is held. The pair matters because the same forward
layout can be fed by two different backward conventions: a column-parallel Linear takes
its input replicated but hands back a *partial* input gradient (each rank has summed only
its own output features), so the edge into it costs a reduce-scatter in backward, not an
all-reduce of a replicated gradient.

`redistribution_collectives` says which collectives turn one layout into another, the same
ones `DTensor.redistribute` issues; the cost model prices them and the executor runs them.
"""

from __future__ import annotations

from enum import Enum


class Placement(str, Enum):
    """One tensor's placement over a 1-D group, as DTensor names them."""

    SHARD_BATCH = "shard(batch)"  # Shard(0): each rank holds its rows
    SHARD_FEATURE = "shard(feature)"  # Shard(1) for NCHW maps, Shard(-1) otherwise
    SHARD_SEQUENCE = "shard(sequence)"  # Shard(1) of [batch, seq, hidden]: its tokens
    REPLICATE = "replicate"
    PARTIAL = "partial"  # each rank holds a summand of the value


class Layout(str, Enum):
    """An activation's layout: forward placement and the placement of its gradient."""

    BATCH = "batch"  # rows split, as data parallelism keeps them
    FEATURE = "feature"  # features (or channels) split, as a column-parallel output
    REPLICATE = "replicate"  # every rank has the whole tensor and the whole gradient
    REPLICATE_PARTIAL_GRAD = "replicate/partial-grad"  # what a model-parallel layer takes
    SEQUENCE = "sequence"  # tokens split (dim 1), as Megatron-SP keeps norms and dropout

    @property
    def forward(self) -> Placement:
        return _FORWARD[self]

    @property
    def grad(self) -> Placement:
        return _GRAD[self]


_FORWARD = {
    Layout.BATCH: Placement.SHARD_BATCH,
    Layout.FEATURE: Placement.SHARD_FEATURE,
    Layout.REPLICATE: Placement.REPLICATE,
    Layout.REPLICATE_PARTIAL_GRAD: Placement.REPLICATE,
    Layout.SEQUENCE: Placement.SHARD_SEQUENCE,
}
_GRAD = {
    Layout.BATCH: Placement.SHARD_BATCH,
    Layout.FEATURE: Placement.SHARD_FEATURE,
    Layout.REPLICATE: Placement.REPLICATE,
    Layout.REPLICATE_PARTIAL_GRAD: Placement.PARTIAL,
    Layout.SEQUENCE: Placement.SHARD_SEQUENCE,
}


def sequence_splits(layer, batch: int, ranks: int) -> bool:
    """A layer's output the sequence layout can split: [batch, seq, hidden] with seq a
    multiple of the ranks (torch's SequenceParallel shards dim 1), whose sizes no code reads
    (`b, t, c = x.size()` would read each rank's seq/P and shape a whole tensor by it)."""
    shape = layer.output.shape
    return (len(shape) == 3 and shape[0] == batch and shape[1] % ranks == 0
            and not layer.attrs.get("shape_read", False))


def redistribution(src: Placement, dst: Placement) -> str | None:
    """The collective that turns placement `src` into `dst` (None when it is local).

    Mirrors DTensor's redistribute: gather a shard, sum a partial, scatter a partial,
    swap one sharded dim for another; slicing a replicated tensor is free.
    """
    if src == dst:
        return None
    if dst == Placement.PARTIAL:
        return None  # a full or sharded value is a valid summand (zeros elsewhere)
    if src == Placement.REPLICATE:
        return None  # take this rank's slice
    if src == Placement.PARTIAL:
        return "all_reduce" if dst == Placement.REPLICATE else "reduce_scatter"
    if dst == Placement.REPLICATE:
        return "all_gather"
    return "all_to_all"


def edge_collectives(src: Layout, dst: Layout) -> tuple[str | None, str | None]:
    """(forward, backward) collectives on an edge whose producer gives `src` and whose
    consumer takes `dst`. Backward moves the consumer's gradient back to the producer's."""
    return redistribution(src.forward, dst.forward), redistribution(dst.grad, src.grad)
