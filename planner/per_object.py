"""Work done once per distinct array, not once per layer.

A transformer's blocks are alike: planner.search.build gives identical layers one array
of each figure (times, memory rows), so what reads those arrays later (the recomputed
variants of planner.pipeline.block_recompute, the bounds' tables of
planner.pipeline.stages) can tell them apart by identity and do a layer's work once per
block kind. On a 405 B Llama (1,260 layers in 126 alike blocks) that took the ranking of
884 shapes from 17-19 s to 11 s. DeepSeek-V3 (7,342 layers in 61 blocks, 1,032 shapes)
took that further: the search prices each kind of layer once per shape (planner.search's
CostCache.kinds), block_recompute makes each distinct block's recomputed figures once,
the bounds' tables and planner.reasons read each distinct array once, and what is the
same on every shape (the edges' readers, the values each cut sends, which blocks enter
from where) is made once per graph: its ranking went from some 62 s to some 38 s of CPU.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def once_per_object(fn: Callable[..., T]) -> Callable[..., T]:
    """`fn(value, *rest, **kwargs)` made once per `value` object (by identity: each kept
    alive by the memo, so that an id is not reused while it lives) and `rest` (hashable,
    by value); keyword arguments ride along unkeyed: what `value` determines."""
    made: dict[tuple, tuple] = {}

    def call(value, *rest, **kwargs) -> T:
        key = (id(value), *rest)
        hit = made.get(key)
        if hit is None:
            hit = made[key] = (fn(value, *rest, **kwargs), value)
        return hit[0]

    return call
