"""Alpha-beta costs of the collectives a plan issues, for ring algorithms.

`n` is always the size in bytes of the whole (global) tensor the collective works on, so a
caller never has to remember which side of a gather a size refers to. With P ranks, link
bandwidth β (bytes/s per rank, one direction) and latency α per message:

    all_reduce      2(P-1)·α + 2(P-1)/P · n/β       (reduce-scatter then all-gather)
    all_gather      (P-1)·α  +  (P-1)/P · n/β       (n = the gathered output)
    reduce_scatter  (P-1)·α  +  (P-1)/P · n/β       (n = the input being reduced)
    all_to_all      (P-1)·α  +  (P-1)/P² · n/β      (each rank keeps 1/P of its n/P)
    send_recv       α + n/β

`bucket_all_reduce` is DDP's gradient all-reduce, one per bucket: the formula of
all_reduce, but every rank issues it at the same point of backward, so it meets no peer
that is still computing. `hyplan calibrate` times it that way (ranks started together),
apart from the blocking collectives of tensor-parallel layers and layout changes (timed
after a burst of compute, as a step meets them); uncalibrated links price both alike.
How long that burst is matters on gloo: a process that computed longer pays more to wake
into the collective, and a chain of small model-parallel layers issues one every ~0.3-1.5
ms, not after the ~8 ms the fits were timed behind (gpt_tiny's and the small Hugging Face
models' tensor plans priced +32-38%: the measured steps imply ~0.7-0.9 ms per message
against the fits' 1.2). Where the link has a measured `GapCurve` and the planner set the
plans' rhythm (`LinkSpec.blocking_gap_s`, planner.price.in_rhythm: only where processes
outnumber cores, since with a core each the plans ran at their fits), a blocking collective
(`BLOCKING`) pays its own fit's latency scaled by the curve at that gap over the curve at
the gap the fits were timed behind, where that is below 1; its bandwidth term stays.

Expert parallelism (strategies.experts) moves every (token, expert) pair by all_to_all, n
the whole batch's pairs (each rank sends (P-1)/P of its n/P). On CPU, `hyplan calibrate`
times `all_to_all_single` itself on gloo (profiler.calibrate; before, its figure was a copy
of the all-gather's samples, what DTensor's shard-to-shard redistribute runs there). A
link without an all_to_all fit prices it from its own latency and bandwidth, as it does an
uncalibrated all_gather; so do the GPU links of strategies.devices, whose figures hold for
an all-to-all as published by nccl-tests, whose alltoall "bus bandwidth" is algbw x (P-1)/P
(S. Jeaugey, NVIDIA/nccl-tests #130), the β of the formula above:
- inside an H100 node (NVLink 4, priced at 370 GB/s): alltoall_perf on 4 H100 SXM at 500 MB
  read busbw 335-338 GB/s (NVIDIA/nccl #2169, NCCL 2.30, ring), 9% under the link's 370;
- across nodes (NDR, priced at 46 GB/s per GPU): an all-to-all cannot aggregate a node's
  NICs, each GPU's traffic goes through its own, "the performance of a single NIC" (S.
  Jeaugey), 48-49 GB/s for a CX-7 at NDR (D. Addison), NVIDIA/nccl-tests #267 (6 H100
  nodes); on N nodes busbw is N/(N-1) x a GPU's NIC bandwidth, the intra-node part not
  being the bottleneck (#130): 46 GB/s is the many-node end, 2x pessimistic on 2 nodes.

Every formula is `a(P)·α + b(P)·n/β`; `COEFFICIENTS` holds (a, b), which is also what
`strategies.calibrated` fits measured timings against. α and β come from the link, per
collective and size range where `hyplan calibrate` measured them (see LinkSpec.alpha_beta).

`b(P)·n` is also what each rank sends over the link: `collective_bytes` reports that volume
from the same coefficients, so bytes and seconds never disagree about a collective.
"""

from __future__ import annotations

from collections.abc import Callable

from strategies.devices import LinkSpec

COEFFICIENTS: dict[str, Callable[[int], tuple[float, float]]] = {
    "all_reduce": lambda p: (2 * (p - 1), 2 * (p - 1) / p),
    "all_gather": lambda p: (p - 1, (p - 1) / p),
    "reduce_scatter": lambda p: (p - 1, (p - 1) / p),
    "all_to_all": lambda p: (p - 1, (p - 1) / p**2),
    "send_recv": lambda p: (1, 1),
}
COEFFICIENTS["bucket_all_reduce"] = COEFFICIENTS["all_reduce"]
# one layer under FSDP2 for one step of one microbatch, measured end to end by `hyplan
# calibrate` (fsdp_layer_s): two all-gathers and a reduce-scatter of its weights' bytes
COEFFICIENTS["fsdp_layer"] = lambda p: (3 * (p - 1), 3 * (p - 1) / p)
# what DTensor costs one tensor-parallel Linear beyond its local math and collectives, per
# step of one microbatch, over `n` = its whole weight's bytes (each rank holds n/P), measured
# by `hyplan calibrate` as column/row pairs (strategies.calibrated.tp_layer_fit)
COEFFICIENTS["tp_layer"] = lambda p: (1, 1 / p)
# issued in a step's critical path by a layer or a layout change, each rank waiting for its
# peers (DDP's bucket all-reduces, FSDP's layers and send/recv are priced by their own fits)
BLOCKING = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all")


def collective_time_s(name: str, n: float, ranks: int, link: LinkSpec) -> float:
    """a(P)·α + b(P)·n/β for the collective `name` over `n` bytes on `ranks` ranks; a
    blocking one at the link's rhythm where it has one (`rhythm_latency_s`)."""
    if n <= 0 or (ranks <= 1 and name != "send_recv"):
        return 0.0
    alpha, beta = link.alpha_beta(name, n)
    if name in BLOCKING:
        alpha = rhythm_latency_s(link, alpha)
    a, b = COEFFICIENTS[name](ranks)
    return a * alpha + b * n / beta


def rhythm_latency_s(link: LinkSpec, default_s: float) -> float:
    """The latency per message of a blocking collective issued `link.blocking_gap_s` of
    compute after the previous one: `default_s`, its fit's (timed behind
    `GapCurve.fits_gap_s` of compute), times the gap curve's all-reduce at that gap over
    the curve at the fits' gap, at most 1 (a longer gap than the fits' did not cost more
    in measurements: a 16 KB all-reduce read 2.2-3.0 ms after 15-30 ms, 2.8-5.3 after 6).
    Not the curve's all-reduce over its 2(P-1) messages in place of the fit, as before:
    that priced a 512 KB reduce-scatter and all-gather on 2 processes 1.5 and 1.8 ms after
    15 ms of compute, where they measured 2-4 ms each (their fits, 3.0 and 2.8 ms), and
    the FC-heavy CNN's hybrid plan ran 8-11% over its prediction. `default_s` where the
    link has no curve or no rhythm was set."""
    curve = link.gap_curve
    if curve is None or link.blocking_gap_s is None:
        return default_s
    at_fits = curve.seconds_at(curve.fits_gap_s)
    if at_fits <= 0:
        return default_s
    return default_s * min(1.0, curve.seconds_at(link.blocking_gap_s) / at_fits)


# DistributedDataParallel's first bucket (later ones hold up to bucket_cap_mb, 25 MB)
DDP_BUCKET_BYTES = 2**20
DDP_BUCKET_CAP_BYTES = 25 * 2**20


def bucketed_all_reduce_s(n: float, ranks: int, link: LinkSpec) -> float:
    """A layer's share of DDP's gradient all-reduces over `n` bytes of its gradients. DDP
    packs gradients into buckets (1 MB first, then 25 MB) and issues one all-reduce per
    bucket, so a layer pays the bandwidth term for its own bytes and the per-message
    latency in proportion to the bucket it fills, at most once. The 1 MB figure counts the
    few buckets of a small model right and charges a mid-sized layer (1-25 MB) a whole
    latency it may share."""
    if ranks <= 1 or n <= 0:
        return 0.0
    a, b = COEFFICIENTS["all_reduce"](ranks)
    # the bucket's size picks the regime; a layer's weight larger than a bucket is its own
    alpha, beta = link.alpha_beta("bucket_all_reduce", n)
    return a * alpha * min(1.0, n / DDP_BUCKET_BYTES) + b * n / beta


def collective_bytes(name: str | None, n: float, ranks: int) -> float:
    """Bytes each rank sends in the collective `name` (None: nothing) over `n` bytes: the
    b(P)·n of its ring formula, e.g. 2(P-1)/P·n for an all-reduce."""
    if name is None or n <= 0 or (ranks <= 1 and name != "send_recv"):
        return 0.0
    return COEFFICIENTS[name](ranks)[1] * n


def all_reduce_s(n: float, ranks: int, link: LinkSpec) -> float:
    return collective_time_s("all_reduce", n, ranks, link)


def all_gather_s(n: float, ranks: int, link: LinkSpec) -> float:
    return collective_time_s("all_gather", n, ranks, link)


def reduce_scatter_s(n: float, ranks: int, link: LinkSpec) -> float:
    return collective_time_s("reduce_scatter", n, ranks, link)


def fsdp_layer_s(gather_bytes: float, reduce_bytes: float, ranks: int,
                 link: LinkSpec) -> tuple[float, float]:
    """(the two all-gathers, the reduce-scatter) FSDP2 costs one layer per microbatch:
    weights gathered in forward and again in backward, gradients reduce-scattered. Where
    `hyplan calibrate` timed whole FSDP2 layers on this link ("fsdp_layer": collectives,
    flat-buffer copies and hooks together), that fit prices them, shared between the two
    parts as the three collectives' own prices are; else the collectives alone."""
    gathers = 2 * all_gather_s(gather_bytes, ranks, link)
    scatter = reduce_scatter_s(reduce_bytes, ranks, link)
    if "fsdp_layer" not in link.collectives or ranks <= 1 or gathers + scatter <= 0:
        return gathers, scatter
    whole = collective_time_s("fsdp_layer", (2 * gather_bytes + reduce_bytes) / 3, ranks, link)
    return whole * gathers / (gathers + scatter), whole * scatter / (gathers + scatter)


def all_to_all_s(n: float, ranks: int, link: LinkSpec) -> float:
    return collective_time_s("all_to_all", n, ranks, link)


def send_recv_s(n: float, link: LinkSpec) -> float:
    return collective_time_s("send_recv", n, 2, link)


COLLECTIVES = {
    "all_reduce": all_reduce_s,
    "all_gather": all_gather_s,
    "reduce_scatter": reduce_scatter_s,
    "all_to_all": all_to_all_s,
}


def collective_s(name: str | None, n: float, ranks: int, link: LinkSpec) -> float:
    """Time of the collective `name` (None: nothing to do) over `n` bytes."""
    return 0.0 if name is None else COLLECTIVES[name](n, ranks, link)
