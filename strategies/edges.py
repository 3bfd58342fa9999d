"""The cost of changing an activation's layout between two layers.

An edge carries the producer's output (its global size is `nbytes`) to a consumer that may
need another layout. Forward runs the collective that turns the producer's layout into the
consumer's; backward runs the one that turns the consumer's gradient into the producer's,
unless the producer is a model input (no gradient flows back to it).
"""

from __future__ import annotations

import numpy as np

from strategies.collectives import collective_bytes, collective_s
from strategies.layouts import Layout, edge_collectives
from strategies.devices import LinkSpec


def reshard_s(src: Layout, dst: Layout, nbytes: float, ranks: int, link: LinkSpec,
              backward: bool = True) -> float:
    """Forward plus (if `backward`) backward time of turning layout `src` into `dst`."""
    fwd, bwd = edge_collectives(src, dst)
    time = collective_s(fwd, nbytes, ranks, link)
    if backward:
        time += collective_s(bwd, nbytes, ranks, link)
    return time


def reshard_bytes(src: Layout, dst: Layout, nbytes: float, ranks: int,
                  backward: bool = True) -> float:
    """Bytes each rank sends turning layout `src` into `dst`, forward plus (if `backward`)
    backward: the volume of the collectives `reshard_s` prices."""
    fwd, bwd = edge_collectives(src, dst)
    sent = collective_bytes(fwd, nbytes, ranks)
    if backward:
        sent += collective_bytes(bwd, nbytes, ranks)
    return sent


def edge_matrix(gives: list[Layout], takes: list[Layout], nbytes: float, ranks: int,
                link: LinkSpec, backward: bool = True, reshard_overhead_s: float = 0.0,
                own_style: list[bool] | None = None) -> np.ndarray:
    """cost[i, j]: the producer's option i gives gives[i], the consumer's option j takes
    takes[j]. A layout change costs `reshard_overhead_s` more (DTensor's redistribute)
    unless the consumer option j changes its input itself (`own_style[j]`: a parallel
    style, whose fixed cost the strategy already counts)."""
    own_style = own_style or [False] * len(takes)
    return np.array([[reshard_s(g, t, nbytes, ranks, link, backward)
                      + (reshard_overhead_s if changes(g, t, backward) and not own else 0.0)
                      for t, own in zip(takes, own_style)]
                     for g in gives])


def changes(src: Layout, dst: Layout, backward: bool = True) -> bool:
    """Does the edge change anything? Two layouts that differ only in how a gradient is
    held change nothing for a value that has no gradient (a mask, token ids)."""
    return src.forward != dst.forward or (backward and src.grad != dst.grad)
