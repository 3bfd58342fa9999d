"""Alpha-beta costs of the collectives a plan issues, for ring algorithms.

`n` is always the size in bytes of the whole (global) tensor the collective works on, so a
caller never has to remember which side of a gather a size refers to. With P ranks, link
bandwidth β (bytes/s per rank, one direction) and latency α per message:

    all_reduce      2(P-1)·α + 2(P-1)/P · n/β       (reduce-scatter then all-gather)
    all_gather      (P-1)·α  +  (P-1)/P · n/β       (n = the gathered output)
    reduce_scatter  (P-1)·α  +  (P-1)/P · n/β       (n = the input being reduced)
    all_to_all      (P-1)·α  +  (P-1)/P² · n/β      (each rank keeps 1/P of its n/P)
    send_recv       α + n/β
"""

from __future__ import annotations

from strategies.devices import LinkSpec


def all_reduce_s(n: float, ranks: int, link: LinkSpec) -> float:
    if ranks <= 1 or n <= 0:
        return 0.0
    return 2 * (ranks - 1) * (link.latency_s + n / ranks / link.bandwidth_bytes_per_s)


def all_gather_s(n: float, ranks: int, link: LinkSpec) -> float:
    if ranks <= 1 or n <= 0:
        return 0.0
    return (ranks - 1) * (link.latency_s + n / ranks / link.bandwidth_bytes_per_s)


reduce_scatter_s = all_gather_s


def all_to_all_s(n: float, ranks: int, link: LinkSpec) -> float:
    if ranks <= 1 or n <= 0:
        return 0.0
    return (ranks - 1) * (link.latency_s + n / ranks**2 / link.bandwidth_bytes_per_s)


def send_recv_s(n: float, link: LinkSpec) -> float:
    if n <= 0:
        return 0.0
    return link.latency_s + n / link.bandwidth_bytes_per_s


COLLECTIVES = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


def collective_s(name: str | None, n: float, ranks: int, link: LinkSpec) -> float:
    """Time of the collective `name` (None: nothing to do) over `n` bytes."""
    return 0.0 if name is None else COLLECTIVES[name](n, ranks, link)
