"""`hyplan calibrate`'s measurements: what this machine does, in raw figures.

Three measurements, each the figure the cost model divides by (the fits that turn them into
links and devices are `strategies.calibrated`, above this package):

- compute: achieved FLOP/s of matmul and conv2d and copy bandwidth per op class, with
  `torch.utils.benchmark` (median of blocked runs), at the threads each process gets;
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over a
  real process group of P spawned ranks (gloo on CPU; NCCL timed with CUDA events where
  there are P GPUs), at sizes from 1 KB to 128 MB, each as a training step meets it:
  after a burst of compute on every rank (blocking collectives: one rank waits for the
  other), and DDP's bucket all-reduce with the ranks started together; each call timed
  from the moment its last rank arrives to the moment its last rank leaves (a rank that
  arrives early sleeps and gives its core away: that wait is the peers' compute, not the
  collective's cost);
- DTensor's costs: tensor-parallel pairs of Linears (ColwiseParallel, ReLU,
  RowwiseParallel) at a few widths as the executor runs them, against the plain ops (the
  all-reduces they issue are subtracted by `strategies.calibrated` with the fitted link);
  and a tiny DTensor redistribute by the CPU its thread spends beyond the plain op's and
  its all-gather's.
"""

from __future__ import annotations

import collections
import math
import os
import resource
import statistics
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict

from profiler.launch import RanksOtherLoad, run_ranks, wait_for_quiet
from profiler.machine import threads as thread_count
from profiler.profile import layer_clock, median_time

# Up to 128 MB. Past the shared cache gloo's copies stream from memory on every rank at
# once: a 64-128 MB all-gather took twice what a fit on sizes <= 32 MB predicts, and one
# line fitted through 128 MB overpriced every smaller message (4-process median error 8% ->
# 41%), so the fit is piecewise (fit_collective) and the sizes reach past the cache.
SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20,
         128 << 20)
# Quick: one latency-bound size (16 KB) fewer than the full set's two (1 and 16 KB): its
# calls pay for more rounds of the others (SMALL_REPEATS), which steadies the small fit;
# and no 1 MB (a third of the small messages' ~20 s), which the line through 256 KB and 8 MB
# prices
QUICK_SIZES = (1 << 10, 256 << 10, 8 << 20, 32 << 20, 64 << 20, 128 << 20)
# How long every rank computes before a collective timed as a step meets it
# (`_in_step_spans`). Past ~4 ms the cost stops growing: a 16 KB all-reduce costs the same
# 2.53 ms after 5.3 ms and after 10 ms of compute (a quick calibration's gap curve).
# Every timed call pays one, so it sets most of the calibration's minute: at 8 ms, sized by
# the fastest matmul (10 ms real), ~2,500 of them took 25 s.
BURST_S = 6e-3
# a second regime must at least halve the one line's squared relative error to be kept
MEASURED = ("all_reduce", "bucket_all_reduce", "all_gather", "reduce_scatter", "all_to_all",
            "send_recv")



class Sample(BaseModel):
    """One measured timing: `collective` over `nbytes` (the global tensor) on `ranks`."""

    model_config = ConfigDict(frozen=True)

    collective: str
    ranks: int
    nbytes: int
    seconds: float



# --- measuring, inside each rank ------------------------------------------------------------

def _span_timer(device: torch.device, clock=None):
    """span(fn) -> (start, end) of one call in seconds. On CPU the clock is the host's
    monotonic clock, which every process on the machine shares, so spans of one call on
    several ranks can be compared; on a GPU, CUDA events (start 0: durations only).
    `clock` (e.g. time.thread_time) replaces either, on any device."""
    if clock is None and device.type == "cuda":
        def span(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return 0.0, start.elapsed_time(end) / 1e3
        return span

    clock = clock or time.perf_counter

    def span(fn):
        begin = clock()
        fn()
        return begin, clock()
    return span


def _timer(device: torch.device):
    """seconds(fn): one timed call, with CUDA events on a GPU."""
    span = _span_timer(device)

    def seconds(fn):
        begin, end = span(fn)
        return end - begin
    return seconds


def _matmul_seconds(device) -> float:
    """One 256-wide matmul's seconds here: the median of 15 after 5 untimed ones (warm
    caches, as in the bursts it sizes)."""
    a = torch.randn(256, 256, device=device)
    timer = _timer(device)
    for _ in range(5):
        a @ a
    return statistics.median(timer(lambda: a @ a) for _ in range(15))


def _compute_burst(device, seconds: float = BURST_S):
    """A closure that keeps this rank computing for about `seconds` (256-wide matmuls).
    Sized by the median of 15 matmuls (`_matmul_seconds`), not the fastest of 5: by the
    fastest, bursts ran 25% past their figure (an 8 ms burst took 10 ms), and the
    calibration with them. A count, not a deadline: ranks given the same work end it
    apart, as in a step (bursts run to a shared deadline end together, and a 16 KB
    all-reduce after 4-8 ms of them cost 2.9 ms, not 1.9)."""
    a = torch.randn(256, 256, device=device)
    count = max(1, round(seconds / max(_matmul_seconds(device), 1e-6)))

    def burst():
        for _ in range(count):
            a @ a
    return burst


def _gap_bursts(device, gaps_s) -> dict:
    """{gap: a closure computing for at least `gap` seconds} (256-wide matmuls, the count
    rounded up), each burst sized by the median matmul time of the last 7 bursts. Sized
    once, as `_compute_burst` is, a gap curve's walls ran 0.66-0.78x or 1.6-2.5x the gaps
    asked for through its whole 0.7 s (and a CI run's first-use test failed on them): this
    VM's speed moves by up to 1.5x for seconds at a time, and a count taken in one spell
    ran in another."""
    a = torch.randn(256, 256, device=device)
    recent = collections.deque([_matmul_seconds(device)], maxlen=7)

    def burst_of(gap: float):
        def burst():
            count = max(1, math.ceil(gap / max(statistics.median(recent), 1e-6)))
            began = time.perf_counter()
            for _ in range(count):
                a @ a
            recent.append((time.perf_counter() - began) / count)
        return burst
    return {gap: burst_of(gap) for gap in gaps_s}


# A warm-up call that faults in fewer new pages than this (1 MB) on every rank finds the
# memory it needs already mapped (`warm_up`)
WARM_PAGES = 256
WARM_CALLS = 6


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def warm_up(fn, device, most: int = WARM_CALLS) -> int:
    """Call `fn` (a collective, or a step holding some) on every rank until a call faults
    in no new memory on any of them, at most `most` times; returns the calls made. With
    freed memory kept (profiler.allocator), glibc reuses big freed blocks only once its
    heap has room for them in one piece: a 64-128 MB gloo all-gather faulted in all its
    pages for the first 2-5 calls and cost 1.5-2.5x what it did after (on 2 processes
    59-84 ms, then 35 for 64 MB, 128-150, then 49-71 for 128 MB; 201-237, then 108-113
    for 128 MB on 4), and a 67 MB FSDP2 layer for its first 2-5 steps. A run's steps are
    warm by then; with one warm-up call a 128 MB all-gather on 4 processes was priced
    488-568 ms, warm 261 ms. Every timing helper here warms its calls this way."""
    flag = torch.zeros(1, device=device)
    for calls in range(1, most + 1):
        before = _minor_faults()
        fn()
        flag.fill_(float(_minor_faults() - before))
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)  # the ranks stop together
        if flag.item() < WARM_PAGES:
            break
    return calls


def _in_step_spans(fn, device, repeats: int) -> list[tuple[float, float]]:
    """(start, end) of each of `repeats` calls of `fn` as a training step meets it: every
    rank computes for a moment (a BURST_S burst, about a layer's time here) and then calls
    it; `_call_seconds` combines the ranks' spans of one call. How long the ranks computed
    matters: a 1 MB all-reduce took 1.6 ms after 0.5 ms bursts, 2.3 ms after 2 ms, 3.5-4.8
    ms after 8-25 ms (the gap curve, GAPS_S, prices shorter gaps).

    Why not back-to-back calls after a barrier: there the ranks arrive together and their
    communication threads are awake. In a step one rank arrives first and sleeps in the
    collective until the other's data wakes it; on this 2-core VM that costs a median 2 ms
    per collective, against 0.2-0.5 ms after a barrier (a 1 KB gloo all-reduce), which made
    tensor-parallel plans of small models look 2x faster than they ran. Calls are combined
    by the mean, not the median: such latencies are bimodal, and a step is a sum of many."""
    span = _span_timer(device)
    burst = _compute_burst(device)
    warm_up(fn, device)  # connections, buffers, the heap's room for them
    dist.barrier()
    spans = []
    for _ in range(repeats):
        burst()
        spans.append(span(fn))
    return spans


def _together_spans(fn, device, repeats: int) -> list[tuple[float, float]]:
    """(start, end) of each call of `fn` when every rank calls it at the same moment (a
    barrier first), as DDP's bucket all-reduces are issued."""
    span = _span_timer(device)
    warm_up(fn, device)
    spans = []
    for _ in range(repeats):
        dist.barrier()
        spans.append(span(fn))
    return spans


def _interleaved_spans(calls: dict, device, rounds: int, clock=None) -> dict:
    """{key: [(start, end) per round]} of `calls` ({key: (fn, together)}) timed in turn
    (by `clock` where given, as `_span_timer` takes it),
    one call of each per round: `together` ones after a barrier (`_together_spans`), the
    others after a compute burst (`_in_step_spans`). Round-robin, not one block per key:
    this VM's small-message latency switches between modes for seconds at a time (a 1 KB
    all-gather's mean over 40 back-to-back calls ranged 0.2-1.6 ms from one block to the
    next), so a block samples one mode and two calibrations disagreed by 2x. Taken in
    turn, every figure averages the same spell of the machine, as a step's collectives
    do, and a difference of two (DTensor's overhead) is not a difference of two spells."""
    span = _span_timer(device, clock)
    burst = _compute_burst(device)
    for fn, _ in calls.values():
        warm_up(fn, device)  # connections, buffers, the heap's room for them
    dist.barrier()
    spans: dict = {key: [] for key in calls}
    for _ in range(rounds):
        for key, (fn, together) in calls.items():
            if together:
                dist.barrier()
            else:
                burst()
            spans[key].append(span(fn))
    return spans


# The gap curve (strategies.devices.GapCurve): a small all-reduce after each of these gaps
# of compute, in rows of GAP_BLOCK calls at one gap (the first GAP_DROP of a row dropped:
# the rhythm changing), the gaps in turn for GAP_ROUNDS rounds: ~0.7 s on 2 processes.
# In rows because the cost follows the rhythm, not the one gap before a call: taken one
# call per gap in turn, a 16 KB all-reduce cost 0.9-1.4 ms whatever the gap; in rows
# 0.4-1.5 ms up to 2 ms and 3.0-3.6 ms at 8 ms, as benchmarks/collective_gap.py finds.
GAPS_S = (0.25e-3, 0.5e-3, 1e-3, 2e-3, 4e-3, 8e-3)
GAP_BYTES = 16 << 10
GAP_BLOCK, GAP_DROP, GAP_ROUNDS = 6, 2, 4


def _gap_spans(fn, device, gaps_s=GAPS_S, rounds: int = GAP_ROUNDS) -> dict:
    """{"spans": {gap: [(start, end) of each call kept]}, "walls": {gap: mean seconds from
    the end of one call to the start of the next}} of `fn` called after `gap` seconds of
    compute on every rank (see GAPS_S). The wall gap, what the ranks really computed
    between two calls, is the curve's abscissa."""
    span = _span_timer(device)
    bursts = _gap_bursts(device, gaps_s)
    fn()  # warm up: connections, buffers
    dist.barrier()
    spans: dict = {gap: [] for gap in gaps_s}
    walls: dict = {gap: [] for gap in gaps_s}
    for _ in range(rounds):
        for gap in gaps_s:
            ended = time.perf_counter()
            for call in range(GAP_BLOCK):
                bursts[gap]()
                timed = span(fn)
                if call >= GAP_DROP:
                    spans[gap].append(timed)
                    walls[gap].append(timed[0] - ended)
                ended = timed[1]
    return {"spans": spans, "walls": {gap: statistics.fmean(w) for gap, w in walls.items()}}


def burst_wall_s(per_rank: list[dict], asked_s: float = BURST_S) -> float:
    """The wall time a burst asked to compute `asked_s` took between two collectives (the
    ranks' mean, interpolated between the gap curve's gaps): about BURST_S where each
    rank has a core (6.2 ms here), longer where processes time-share cores (7.6 ms on 4
    processes, 2 cores)."""
    walls = {gap: statistics.fmean(r["gap"]["walls"][gap] for r in per_rank)
             for gap in per_rank[0]["gap"]["walls"]}
    gaps = sorted(walls)
    below = [g for g in gaps if g <= asked_s] or gaps[:1]
    above = [g for g in gaps if g >= asked_s] or gaps[-1:]
    lo, hi = below[-1], above[0]
    if hi == lo:
        return walls[lo] * asked_s / lo
    return walls[lo] + (walls[hi] - walls[lo]) * (asked_s - lo) / (hi - lo)


def gap_seconds(per_rank: list[dict]) -> dict[float, float]:
    """{wall gap s (the ranks' mean): the small all-reduce's cost to a step after it},
    from every rank's `_gap_spans`, each gap's calls combined as `_call_seconds` does."""
    out = {}
    for gap in per_rank[0]["gap"]["spans"]:
        wall = statistics.fmean(r["gap"]["walls"][gap] for r in per_rank)
        out[wall] = _call_seconds([r["gap"]["spans"][gap] for r in per_rank])
    return out


def _interleaved_times(steps: dict, device, rounds: int) -> dict[str, float]:
    """{key: seconds} of `steps` ({key: fn}) each as a training step meets it, timed in
    turn (`_interleaved_spans`), each round's calls on the ranks combined as
    `_call_seconds` combines a collective's: from the last rank's start to the last
    rank's end, the mean of the middle 80%; the same figure on every rank. Not each
    rank's own duration: a step that holds a collective waits in it for the ranks still
    in their burst before it, which is compute the cost model prices apart. Where 4
    processes time-share 2 cores their bursts end milliseconds apart, and each rank's own
    duration would charge that wait to the collective (several times its cost:
    benchmarks/results/HISTORY.md, "Calibration choices")."""
    spans = _interleaved_spans({key: (fn, False) for key, fn in steps.items()}, device, rounds)
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, spans)
    return {key: _call_seconds([rank[key] for rank in everyone]) for key in spans}


def _call_seconds(spans_per_rank: list[list[tuple[float, float]]]) -> float:
    """What one collective costs a step, from every rank's spans of the same calls: from
    the last rank's arrival to the last rank's exit, the mean of the middle 80% over calls.
    Time a rank spends in the call before the last one arrives is its peers still
    computing (with more processes than cores, computing on the core it gave away); the
    cost model charges that to compute. On a GPU spans start at 0: the slowest rank's
    duration."""
    per_call = zip(*spans_per_rank)
    return _trimmed_mean([max(e for _, e in call) - max(s for s, _ in call)
                          for call in per_call])


def _trimmed_mean(times: list[float]) -> float:
    times = sorted(times)
    cut = len(times) // 10
    return statistics.fmean(times[cut:len(times) - cut])


def _collective_call(name: str, nbytes: int, rank: int, world: int, device):
    """A closure running collective `name` on a tensor of `nbytes` (global) bytes."""
    elements = max(world, nbytes // 4 // world * world)
    full = torch.ones(elements, device=device)  # not randn: 0.2 s per 128 MB, per rank
    part = torch.empty(elements // world, device=device)
    if name in ("all_reduce", "bucket_all_reduce"):
        return lambda: dist.all_reduce(full)
    # torch 2.13 renamed the tensor forms (*_single); older releases have only the old names
    if name == "all_gather":
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        return lambda: gather(full, part)
    if name == "reduce_scatter":
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        return lambda: scatter(part, full)
    if name == "all_to_all":
        # each rank's n/P split in P parts, one to each rank (strategies.collectives'
        # formula): `all_to_all_single` with its split sizes given, the call expert
        # parallelism's dispatch and combine make (executor.experts: gloo's alltoallv,
        # uneven splits in a step). Before, gloo's figure was a copy of the all-gather's
        # samples (what DTensor's shard-to-shard redistribute runs there) fitted to the
        # all-to-all's coefficients: on 2 processes a 128 MB all_to_all_single took 40 ms,
        # the all-gather it was copied from 127 ms (quick calibration, loaded 2-core VM)
        mine = elements // world
        send = torch.ones(mine, device=device)
        recv = torch.empty(mine, device=device)
        splits = [mine // world + (1 if r < mine % world else 0) for r in range(world)]
        return lambda: dist.all_to_all_single(recv, send, splits, splits)
    if name == "send_recv":  # ping-pong between ranks 0 and 1, halved below
        def ping_pong():
            if rank == 0:
                dist.send(full, 1)
                dist.recv(full, 1)
            elif rank == 1:
                dist.recv(full, 0)
                dist.send(full, 0)
        return ping_pong
    raise ValueError(f"collective: unknown {name!r}; known: {', '.join(MEASURED)}")


def _dtensor_overheads(rank: int, world: int, device, repeats: int) -> dict[str, float]:
    """{"plain", "gather", "reshard": seconds of this thread's CPU} of a plain op, the
    tiny all-gather a redistribute issues, and that redistribute (Shard(0) -> Replicate,
    forward + backward), each after a compute burst in turn, medians over `repeats`
    rounds: reshard less the other two is what DTensor adds to a layout change beyond
    its collective (strategies.calibrated._reshard_overhead), its dispatch and autograd
    bookkeeping, which run on this thread while the collective's own work and wait do not.

    CPU time, not wall: the wall of a tiny collective on gloo swings 0.4-3.4 ms from
    spell to spell, more than the ~1 ms DTensor adds, which the thread's CPU reads alike
    in every spell (benchmarks/results/HISTORY.md, "Calibration choices"). A layer's own
    cost is `_tp_pairs`'."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard

    mesh = init_device_mesh(device.type, (world,))
    width, rows = 64, 8
    x = torch.randn(rows, width, device=device)

    def plain():
        x.detach().requires_grad_(True).sum().backward()

    def redistribute():
        d = DTensor.from_local(x.detach().requires_grad_(True), mesh, [Shard(0)],
                               run_check=False)
        d.redistribute(mesh, [Replicate()]).to_local().sum().backward()

    gather = _collective_call("all_gather", x.numel() * x.element_size() * world, rank, world,
                              device)
    steps = {"plain": (plain, False), "gather": (gather, False),
             "reshard": (redistribute, False)}
    spans = _interleaved_spans(steps, device, repeats, clock=time.thread_time)
    return {key: statistics.median(end - start for start, end in calls)
            for key, calls in spans.items()}


# Tensor-parallel pairs of Linears `width` wide on TP_ROWS rows: small ones, where DTensor's
# dispatch is the whole cost, and large ones, where a weight-sized cost shows (a 4096-wide
# pair ran 13-16 ms beyond its local math and collectives on 8-128 rows alike)
TP_WIDTHS = (128, 512, 1024, 2048, 3072, 4096)
TP_WIDTHS_QUICK = (128, 1024, 4096)
TP_ROWS = 16
TP_SMALL_WIDTH = 1024  # up to here a pair is cheap: more rounds (`_tp_pairs`)


def _tp_pairs(device, repeats: int = 7, widths=TP_WIDTHS,
              small_repeats: int = 80) -> dict[int, tuple[float, float, float, float]]:
    """{width: (bytes of one layer's weights, bytes of the activation, plain pair s, TP pair
    s)}: a column-parallel Linear, a ReLU and a row-parallel Linear (Megatron's MLP, the
    executor's styles, output replicated), forward and backward on TP_ROWS replicated
    rows, against the same local shards run plainly, timed in turn. Their difference,
    less the two all-reduces the pair issues (the caller prices them with the fitted
    link), is what DTensor costs two layers as the executor runs them: its dispatch,
    from_local/to_local, redistribute's bookkeeping, and per weight byte whatever it does
    beyond the math (`strategies.calibrated.tp_layer_fit`). A tiny Linear timed alone,
    the figure this replaces, saw none of the latter: 0.6-1.9 ms per layer against 6-6.7
    ms measured for a 4096-wide one in a step (fc_heavy_cnn's plan priced 19% short).
    Pairs up to TP_SMALL_WIDTH run `small_repeats` rounds: a few ms each, their figure is
    ~1 ms beside two bimodal all-reduces (0.3 or ~4 ms each), and 7 rounds put the fitted
    per-layer cost anywhere in 0-1.4 ms from one calibration to the next."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    out = {}
    # a multiple of the ranks: DTensor cannot shard 128 features 3 ways
    for width in sorted({max(world, w // world * world) for w in widths}):
        torch.manual_seed(0)
        pair = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width))
        parallelize_module(pair.to(device), mesh, {
            "0": ColwiseParallel(input_layouts=Replicate()),
            "2": RowwiseParallel(input_layouts=Shard(-1), output_layouts=Replicate())})
        local = nn.Sequential(nn.Linear(width, width // world), nn.ReLU(),
                              nn.Linear(width // world, width)).to(device)
        x = torch.randn(TP_ROWS, width, device=device)

        def step_of(module):
            def step():
                module(x.detach().requires_grad_(True)).sum().backward()
                for p in module.parameters():  # as zero_grad: no accumulation
                    p.grad = None
            return step

        rounds = max(repeats, small_repeats) if width <= TP_SMALL_WIDTH else repeats
        t = _interleaved_times({"plain": step_of(local), "tp": step_of(pair)}, device, rounds)
        out[width] = (float(width * (width + 1) * 4), float(TP_ROWS * width * 4),
                      t["plain"], t["tp"])
        del pair, local
    return out


def contention_ops(device: torch.device) -> dict:
    """A compute-bound op (a 2048-wide Linear, forward and backward, on 64 rows) and a
    memory-bound one (a 256 MB copy), each ~30 ms so that time slices average out. Run
    alone and on every rank at once, their ratio is what sharing the machine costs:
    cores, caches and memory bandwidth. Made once per rank (`time_contention_ops` runs
    them): the 512 MB of the copy took ~0.3 s to allocate and touch on every call."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 2048).to(device)
    x = torch.randn(64, 2048, device=device)
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.zeros_like(src)

    def step():
        linear(x.detach().requires_grad_(True)).sum().backward()

    return {"compute": step, "memory": lambda: dst.copy_(src)}


def time_contention_ops(ops: dict, repeats: int = 15, clock=time.perf_counter
                        ) -> dict[str, float]:
    """Median seconds by `clock` of each of `contention_ops`."""
    return {key: median_time(op, repeats, budget_s=0.0, clock=clock) for key, op in ops.items()}


def _linears(width: int, layers: int, device):
    """(`layers` `width`-wide Linears with ReLUs between, step_of(model)): the small
    training step the fixed-cost measurements run plainly and wrapped (DDP, FSDP2);
    step_of gives one SGD step of the model it is handed on 16 rows."""
    from torch import nn

    torch.manual_seed(0)
    stack = [m for _ in range(layers) for m in (nn.Linear(width, width), nn.ReLU())][:-1]
    model = nn.Sequential(*stack).to(device)
    x = torch.randn(16, width, device=device)

    def step_of(wrapped):
        opt = torch.optim.SGD(wrapped.parameters(), lr=0.01, foreach=False)

        def step():
            wrapped(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        return step
    return model, step_of


def _step_overhead(device, repeats: int = 21) -> dict[str, float]:
    """A small training step run plainly and under DDP on every rank: their difference,
    less the gradient all-reduce (subtracted by the caller with the fitted link), is what
    a distributed step costs beyond its layers and collectives (hooks, bucket bookkeeping,
    the ranks waiting on each other)."""
    from torch.nn.parallel import DistributedDataParallel

    plain, step_of = _linears(256, 2, device)
    ddp = DistributedDataParallel(_linears(256, 2, device)[0],
                                  device_ids=None if device.type == "cpu" else [device])
    return {**_interleaved_times({"plain": step_of(plain), "ddp": step_of(ddp)}, device,
                                 repeats),
            "grad_bytes": float(sum(p.numel() * p.element_size() for p in plain.parameters()))}


# FSDP2 steps of `layers` Linears `width` wide: sizes on both sides of the shared cache
# (past it gloo streams from memory), smaller ones where the per-layer fixed cost shows
FSDP_LAYERS = ((128, 8), (1024, 2), (2048, 2), (3072, 2), (3584, 2), (4096, 2))
# Quick: two on each side, one layer past the cache (each layer is its own FSDP2 root, so a
# lone one costs what one of a stack does; two 4096-wide ones took 13 of the quick
# calibration's seconds), and 4 small layers (each new root's first step costs ~0.2 s on 4
# processes)
FSDP_LAYERS_QUICK = ((128, 4), (1024, 2), (3072, 1), (4096, 1))
# Each step is first called until it faults in no new memory (`warm_up`), then
# FSDP_BIG_ROUNDS rounds are timed: a new width's first steps fault in fresh pages (glibc
# reuses a big freed block only where its heap has room for it in one piece) and run
# FSDP2's first gathers, which a training step past its warm-up does not pay. Each layer
# is its own FSDP2 root resharded after forward and gathered again in backward, as
# executor.levers wraps a plan's fsdp layers, not FSDP2's cheaper default (a root keeps
# its weights gathered until backward). The measurements behind both:
# benchmarks/results/HISTORY.md, "Calibration choices".
FSDP_BIG_ROUNDS = 4
# The latency-bound layer (weights under SMALL_BYTES) takes this many times the rounds: its
# per-layer figure is a difference of two means whose FSDP2 step holds 3 bimodal
# collectives a layer (see SMALL_REPEATS), and it prices every layer of a transformer's
# FSDP plan, so its spread becomes theirs; four times the rounds halve it for ~1 s more
# (benchmarks/results/HISTORY.md, "Calibration choices").
FSDP_SMALL_ROUNDS = 4


def fsdp_stack(stack, mesh):
    """`stack` with FSDP2 `fully_shard` on each Linear, as executor.levers wraps a plan's
    fsdp layers: each its own unit, resharded after forward and gathered again in
    backward (the comment above FSDP_BIG_ROUNDS says what FSDP2's default did to the
    prices)."""
    from torch import nn
    from torch.distributed.fsdp import fully_shard

    for module in stack:
        if isinstance(module, nn.Linear):
            fully_shard(module, mesh=mesh, reshard_after_forward=True)
    return stack


def _fsdp_layers(device, repeats: int = 9, sizes=FSDP_LAYERS, big_rounds: int = FSDP_BIG_ROUNDS
                 ) -> dict[int, tuple[int, float, float, float]]:
    """{width: (layers, bytes of one layer's weights, plain step s, FSDP2 step s)}: a step
    of `layers` Linears run plainly and under FSDP2 `fully_shard` per layer, timed in turn.
    Their difference per layer is what FSDP2 costs a layer end to end (two all-gathers, a
    reduce-scatter, the copies into and out of its flat buffers, its hooks), which the
    caller fits like a collective ("fsdp_layer"). Composed from the collectives measured
    alone, it came out 1.6x too high for 64 KB layers (the fixed cost of three calls in a
    step) and 2.4x too high or 0.7x too low for 64 MB ones (a lone 64 MB all-gather
    ranged 63-179 ms between calibrations; FSDP2's whole layer took 155 ms)."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    out = {}
    for width, layers in sizes:
        plain, step_of = _linears(width, layers, device)
        sharded = fsdp_stack(_linears(width, layers, device)[0], mesh)
        # 0.1-0.6 s a step past 1024: fewer rounds (FSDP_BIG_ROUNDS), timed warm
        nbytes = width * (width + 1) * 4
        rounds = (max(big_rounds, repeats // 2) if width > 1024
                  else repeats * FSDP_SMALL_ROUNDS if nbytes < SMALL_BYTES else repeats)
        t = _interleaved_times({"plain": step_of(plain), "fsdp": step_of(sharded)}, device,
                               rounds)
        out[width] = (layers, float(nbytes), t["plain"], t["fsdp"])
        del plain, sharded
    return out


# A contention trial during which other processes used more than this many cores is run
# again (up to `trials` times), after waiting up to REDO_QUIET_WAIT_S for them to pause:
# a user's other work inflates the all-at-once compute slowdown (a test starting 4
# processes puts 2 processes' at 1.70x where it reads 1.0x), and with it the price of
# every plan that computes on both ranks at once.
DISTURBED_CORES = 0.25
REDO_QUIET_WAIT_S = 2.0


def _contention(rank: int, device, quiet_wait_s: float, trials: int = 5,
                repeats: int = 9) -> dict[str, float]:
    """Rank 0 alone (the others idle in a barrier), then every rank at once, in turn
    `trials` times: the median of the ratios, times the share of the cores each rank gets
    with all computing (`core_share`); "redone": the trials run again because other
    processes worked meanwhile (DISTURBED_CORES).

    Timed by the clock layers are timed by (profiler.profile.layer_clock: with one thread,
    this process's CPU time), which holds what sharing the machine with the other ranks
    costs an op that runs (caches, memory bandwidth: a stalled core is busy) and not the
    time slices a process outside the ranks takes. By wall time the quick calibration's
    memory figure ranged 1.0-1.74x and the compute one reached 2.1x on 2 processes, 2
    cores, as other load came and went (one busy process elsewhere halves the cores the
    ranks get together and not the one rank 0 gets alone), and fc_cnn's FSDP plan, whose
    layers stream past the shared cache, was priced +40%. Where the ranks outnumber the
    cores they time-share by design: that share is the rule's, not a measurement's."""
    clock = layer_clock() if device.type == "cpu" else time.perf_counter
    ratios: dict[str, list[float]] = {"compute": [], "memory": []}
    ops = contention_ops(device)
    kept = redone = 0
    while kept < trials:
        wait_s = max(quiet_wait_s, REDO_QUIET_WAIT_S if redone else 0.0)
        if wait_s > 0 and rank == 0:
            wait_for_quiet(wait_s)
        dist.barrier()
        with RanksOtherLoad() as other:
            alone = time_contention_ops(ops, repeats, clock) if rank == 0 else None
            dist.barrier()
            together = time_contention_ops(ops, repeats, clock)
            dist.barrier()
        if other.cores is not None and other.cores > DISTURBED_CORES and redone < trials:
            redone += 1  # another process's work ran in this trial: once more
            continue
        kept += 1
        if rank == 0:
            for key in ratios:
                ratios[key].append(together[key] / alone[key])
    share = core_share(dist.get_world_size()) if device.type == "cpu" else 1.0
    out = {key: share * max(1.0, statistics.median(r)) if rank == 0 else 1.0
           for key, r in ratios.items()}
    return {**out, "redone": redone}


def core_share(world: int) -> float:
    """How many times slower a rank computes with all `world` ranks computing at once,
    from their time slices alone: each needs its threads, the machine has os.cpu_count()
    cores."""
    return max(1.0, world * torch.get_num_threads() / (os.cpu_count() or 1))


# Messages up to 1 MB are timed in turn (`_interleaved_spans`), 120 calls each: their time
# is the latency, bimodal in a step (0.3 or ~4 ms after a burst, each call one or the
# other about half the time, whatever the ranks' arrival skew), so a mean over n calls
# scatters by ~1.9 ms / sqrt(n): 10 calls in one block moved the fitted latency by 2x from
# one calibration to the next, 40 calls by 1.5x (a 256 KB all-reduce priced 1.6-2.8 ms by
# four idle quick calibrations; benchmarks/calibration_spread.py), and every small model's
# prediction with it. A call costs its ~9 ms burst: 120 rounds of 15 are ~16 s.
SMALL_BYTES, SMALL_REPEATS = 1 << 20, 120


def repeats_for(nbytes: int, repeats: int, least: int = 3) -> int:
    """Fewer calls of the largest messages: a 128 MB gloo all-gather takes 0.2-0.6 s here,
    and its spread is small against its size (`least`: the fewest of those; 5, as the full
    calibration takes, where ranks have a core each, for ~1 s more; 2 where more processes
    than cores take 2-4x as long). More calls narrow only the spread within the few
    seconds they take, not the host's drift between calibrations, which is larger
    (benchmarks/results/HISTORY.md, "Calibration choices")."""
    if nbytes >= 64 << 20:
        return max(least, repeats // 5)
    if nbytes >= 16 << 20:
        return max(3 if repeats < 10 else 5, repeats // 2)
    return repeats


def _rounds_scale(device, world: int, quick: bool) -> tuple[int, bool, int]:
    """(shared, sparse, fewer): how far a rank's measurements cut their rounds where more
    processes than cores time-share them, and further in the quick calibration."""
    # more processes than cores: each call takes ~2-5x longer (time-sharing), fewer rounds
    shared = 2 if device.type == "cpu" and world > (os.cpu_count() or 1) else 1
    # and fewer still in the quick calibration (`sparse`), whose figures there are several
    # ms each (DTensor 8-12 ms on 4 processes) beside a round's ~2 ms of bimodal collective:
    # a quarter of the rounds of DTensor, the DDP step and the small tensor-parallel pairs
    # (`fewer`), a third of the small collectives' and 2 calls of the largest ones. With a
    # third, a half and 3, 4 processes took 60-66 s on 2 cores (first use 63-69 s); with
    # these 53-55 s (first use 55.5-58.6 s), and the 4-process fidelity benchmark read
    # median 9%, worst 49% against 12% and 65% the hour before
    sparse = quick and shared > 1
    fewer = 4 if sparse else shared
    return shared, sparse, fewer


class _Laps:
    """Seconds each measurement of a rank took, for the log: `lap(name)` closes one."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self._clock = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.phases[name] = now - self._clock
        self._clock = now


def _measured_names(world: int) -> list[str]:
    """The collectives of MEASURED this rank times on `world` ranks and this backend."""
    return [name for name in MEASURED
            if not (name == "send_recv" and world != 2)]  # one pair is enough: 2 ranks


def _unsupported(error: RuntimeError) -> bool:
    """Whether `error` says the backend lacks a collective."""
    text = str(error).lower()
    return "not supported" in text or "unsupported" in text


def _small_spans(names, sizes, rank: int, world: int, device, rounds: int) -> list:
    """(name, nbytes, spans) of the collectives up to SMALL_BYTES, timed in turn."""
    small = [(name, nbytes) for name in names for nbytes in sizes if nbytes <= SMALL_BYTES]
    try:
        taken = _interleaved_spans(
            {(name, nbytes): (_collective_call(name, nbytes, rank, world, device),
                              name == "bucket_all_reduce") for name, nbytes in small},
            device, rounds)
    except RuntimeError as error:  # e.g. a collective the backend lacks
        if not _unsupported(error):
            raise
        taken = {}
    return [(name, nbytes, taken[(name, nbytes)])
            for name in names for nbytes in sizes if (name, nbytes) in taken]


def _large_spans(names, sizes, rank: int, world: int, device, quiet_wait_s: float,
                 repeats: int, least: int) -> list:
    """(name, nbytes, spans) of the collectives past SMALL_BYTES, one block each."""
    out = []
    for name in names:
        for nbytes in sizes:
            if nbytes <= SMALL_BYTES:
                continue
            if quiet_wait_s > 0:  # on a shared machine, measure between others' bursts
                if rank == 0:
                    wait_for_quiet(quiet_wait_s)
                dist.barrier()
            try:
                timing = _together_spans if name == "bucket_all_reduce" else _in_step_spans
                calls = timing(_collective_call(name, nbytes, rank, world, device), device,
                               repeats_for(nbytes, repeats, least=least))
            except RuntimeError as error:  # e.g. a collective the backend lacks
                if _unsupported(error):
                    break
                raise
            out.append((name, nbytes, calls))
    return out


def _layer_overheads(rank: int, world: int, device, quick: bool, shared: int, fewer: int,
                     laps: _Laps) -> dict:
    """DTensor's, the DDP step's, FSDP2 layers' and tensor-parallel pairs' figures."""
    # DTensor's and the DDP step's figures are each a difference of two means whose calls
    # hold a bimodal collective (see SMALL_REPEATS): 21-31 rounds moved them by 1-1.5 ms
    # between calibrations. Where more processes than cores time-share them, the quick
    # calibration takes a quarter of the rounds (`fewer`)
    dtensor = _dtensor_overheads(rank, world, device, 90 // fewer)
    laps.lap("dtensor")
    step = _step_overhead(device, 60 // fewer)
    laps.lap("ddp step")
    # more processes than cores: 3 rounds (each 0.5-1 s of a 67 MB layer on 4 processes)
    fsdp = _fsdp_layers(device, (9 if fewer == 1 else 6) if quick else 15,
                        FSDP_LAYERS_QUICK if quick else FSDP_LAYERS,
                        big_rounds=FSDP_BIG_ROUNDS if shared == 1 else 3)
    laps.lap("fsdp layers")
    tp = _tp_pairs(device, (7 if quick else 11) // shared,
                   TP_WIDTHS_QUICK if quick else TP_WIDTHS, 80 // fewer)
    laps.lap("tp pairs")
    return {"dtensor": dtensor, "step": step, "fsdp": fsdp, "tp": tp}


def _rank_measure(rank: int, world: int, sizes, repeats: int, quiet_wait_s: float = 0.0,
                  quick: bool = False) -> dict:
    """Every figure one rank of `measure_collectives` takes, in the order all ranks share."""
    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    shared, sparse, fewer = _rounds_scale(device, world, quick)
    laps = _Laps()
    # where ranks time-share cores: 4 shorter trials, not 2 (whose median is their mean:
    # one thrashed trial put 4 processes' compute slowdown at 3.07-3.18x, against 2.0-2.5x
    # in nine other quick measurements, and priced such plans up to +90%)
    together = _contention(rank, device, quiet_wait_s,
                           trials=(3 if shared == 1 else 4) if quick else 5,
                           repeats=(5 if shared == 1 else 3) if quick else 9)
    laps.lap("contention")
    names = _measured_names(world)
    spans = _small_spans(names, sizes, rank, world, device,
                         max(repeats, SMALL_REPEATS // (3 if sparse else shared)))
    laps.lap("small collectives")
    large = {"names": names, "sizes": sizes, "rank": rank, "world": world, "device": device,
             "quiet_wait_s": quiet_wait_s, "repeats": repeats // shared if quick else repeats,
             "least": 2 if sparse else 5}
    spans += _large_spans(**large)
    laps.lap("large collectives")
    # gloo's wake-up after compute, where processes outnumber cores too (there the bursts
    # time-share: the curve is read by the wall gap); not on GPUs (NCCL's kernels queue
    # behind compute)
    gap = (_gap_spans(_collective_call("all_reduce", GAP_BYTES, rank, world, device), device)
           if device.type == "cpu" else None)
    laps.lap("gap curve")
    overheads = _layer_overheads(rank, world, device, quick, shared, fewer, laps)
    # the large ones once more, last (after the FSDP2 layers, whose figures the buffers'
    # heap moves): `collective_samples` keeps the faster window of each. One window is a
    # few seconds, and a slow spell of the host within it (a 67 MB bucket all-reduce read
    # 81.9 ms beside a 46 ms all-reduce, against 38-48 in seven calibrations) priced the
    # FC-heavy CNN's DDP plan 283 ms, measured 227
    late = _large_spans(**large)
    laps.lap("large collectives again")
    return {"spans": spans, "late": late, "gap": gap, "dtensor": overheads["dtensor"],
            "contention": together, "step": overheads["step"], "fsdp": overheads["fsdp"],
            "tp": overheads["tp"], "phases": laps.phases}


# --- compute ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class ComputeRates:
    """What `measure_compute` found: achieved rates, not a DeviceSpec (that is
    `strategies.calibrated.device_spec`'s to build)."""

    name: str  # "cpu", or the CUDA device's name
    kind: str  # "cpu" or "cuda"
    threads: int
    matmul_flops: float  # per second, float32
    conv2d_flops: float
    copy_bytes_per_s: float
    memory_bytes: float
    half_flops: dict[str, float] = field(default_factory=dict)  # CUDA: bfloat16, float16
    # CUDA only: what pricing by shape (strategies.gpu_compute) reads
    multiprocessors: int = 0
    attention_flops: float = 0.0  # causal flash attention, forward + backward, bfloat16
    launch_s: float = 0.0  # one tiny kernel, back to back


# On a GPU a 1024-cube GEMM runs at a fraction of the ceiling (on an H200, bf16: 126 of ~700
# TFLOP/s; it is launch- and wave-bound), so the ceiling is measured where it is reached:
# 8192-cube bf16 and fp16 (690 TFLOP/s on an H200 in 1.6 ms), a 4096-cube fp32 GEMM
# (51 TFLOP/s in 2.7 ms). Pricing by shape (tiles, waves, the launch floor) takes it from
# there down to small GEMMs.
CUDA_HALF_N, CUDA_FLOAT_N = 8192, 4096


def measure_compute(threads: int, device: str = "cpu") -> ComputeRates:
    """Achieved FLOP/s of matmul and conv2d, and copy bandwidth (256 MB, out of cache),
    on `device` with `threads` intra-op threads, by torch.utils.benchmark medians; on a GPU
    also the half-precision GEMM ceiling, flash attention's rate and the launch floor."""
    from torch.utils import benchmark

    dev = torch.device(device)
    cuda = dev.type == "cuda"

    def median_s(stmt: str, env: dict, min_run_time: float = 0.3) -> float:
        timer = benchmark.Timer(stmt=stmt, globals=env, num_threads=threads)
        return timer.blocked_autorange(min_run_time=min_run_time).median

    with thread_count(threads), torch.no_grad():
        n = CUDA_FLOAT_N if cuda else 1024
        a, b = torch.randn(n, n, device=dev), torch.randn(n, n, device=dev)
        matmul = 2 * n**3 / median_s("a @ b", {"a": a, "b": b})
        x = torch.randn(16, 64, 32, 32, device=dev)
        w = torch.randn(64, 64, 3, 3, device=dev)
        conv_flops = 2 * 16 * 64 * 32 * 32 * 64 * 9
        conv = conv_flops / median_s("F.conv2d(x, w, padding=1)",
                                     {"x": x, "w": w, "F": torch.nn.functional})
        src = torch.ones(256 * 2**20 // 4, device=dev)  # touched: untouched pages read as
        dst = torch.zeros_like(src)  # one shared zero page, which sits in cache
        bandwidth = 2 * src.numel() * 4 / median_s("dst.copy_(src)", {"dst": dst, "src": src})
        half, extra = {}, {}
        if cuda:  # tensor cores: the ceiling of each low-precision dtype
            h = torch.randn(CUDA_HALF_N, CUDA_HALF_N, device=dev)
            for dtype in (torch.bfloat16, torch.float16):
                g = h.to(dtype)
                half[str(dtype).removeprefix("torch.")] = 2 * CUDA_HALF_N**3 / median_s(
                    "g @ g", {"g": g})
            del h, g
            sms = torch.cuda.get_device_properties(dev).multi_processor_count
            extra = dict(multiprocessors=sms,
                         attention_flops=_flash_attention_flops(dev, median_s),
                         launch_s=median_s("t.add_(1)", {"t": torch.ones(1, device=dev)}))
    if cuda:
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
        name = torch.cuda.get_device_name(dev)
    else:
        memory = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        name = "cpu"
    return ComputeRates(name=name, kind=dev.type, threads=threads, matmul_flops=matmul,
                        conv2d_flops=conv, copy_bytes_per_s=bandwidth, memory_bytes=memory,
                        half_flops=half, **extra)


def _flash_attention_flops(dev: torch.device, median_s) -> float:
    """FLOP/s of causal scaled-dot-product attention, forward and backward, in bf16 at a
    training shape (4 x 32 heads x 2048 x 128), counted as strategies.gpu_compute counts it:
    half the score matrix, backward 2.5 x forward."""
    b, heads, seq, dim = 4, 32, 2048, 128
    q = torch.randn(b, heads, seq, dim, device=dev, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.ones_like(q)
    stmt = ("torch.autograd.grad(F.scaled_dot_product_attention(q, q, q, is_causal=True), "
            "q, grad)")
    with torch.enable_grad():
        seconds = median_s(stmt, {"q": q, "grad": grad, "F": torch.nn.functional,
                                  "torch": torch})
    forward = 2 * b * seq * seq * heads * dim  # half of 4·b·s²·h·d
    return forward * 3.5 / seconds


# --- collectives on `world` ranks --------------------------------------------------------------

def measure_collectives(world: int, sizes, repeats: int, quiet_wait_s: float, quick: bool,
                        backend: str, threads: int) -> tuple[list[Sample], list[dict]]:
    """(one Sample per collective and size, each rank's raw measurements) from `world`
    spawned ranks: the figures `strategies.calibrated` fits links and overheads to."""
    per_rank = run_ranks(_rank_measure, world, sizes, repeats, quiet_wait_s, quick,
                         backend=backend, threads=1 if backend == "gloo" else threads)
    return collective_samples(per_rank, world), per_rank


def collective_samples(per_rank: list[dict], world: int) -> list[Sample]:
    """One Sample per collective and size from every rank's spans (`_call_seconds`); a
    collective timed in both windows ("spans" and "late": the large ones) by the faster
    one, the window without a slow spell; send/recv's ping-pong halved."""
    late = {(name, nbytes): i for i, (name, nbytes, _) in enumerate(per_rank[0].get("late", []))}
    samples = []
    for i, (name, nbytes, _) in enumerate(per_rank[0]["spans"]):
        t = _call_seconds([r["spans"][i][2] for r in per_rank])
        j = late.get((name, nbytes))
        if j is not None:
            t = min(t, _call_seconds([r["late"][j][2] for r in per_rank]))
        samples.append(Sample(collective=name, ranks=world, nbytes=nbytes,
                              seconds=t / 2 if name == "send_recv" else t))
    return samples
