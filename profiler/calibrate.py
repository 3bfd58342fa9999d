"""`hyplan calibrate`: measure this machine and save a cluster profile the planner accepts.

Three measurements, each the figure the cost model divides by:

- compute: achieved FLOP/s of matmul and conv2d and copy bandwidth per op class, with
  `torch.utils.benchmark` (median of blocked runs), at the threads each process gets;
- collectives: all-reduce, all-gather, reduce-scatter, all-to-all and send/recv over a
  real process group of P spawned ranks (gloo on CPU; NCCL timed with CUDA events where
  there are P GPUs), at sizes from 1 KB to 128 MB, each as a training step meets it:
  after a burst of compute on every rank (blocking collectives: one rank waits for the
  other), and DDP's bucket all-reduce with the ranks started together; each call timed
  from the moment its last rank arrives to the moment its last rank leaves (a rank that
  arrives early sleeps and gives its core away: that wait is the peers' compute, not the
  collective's cost); then alpha (latency per message) and beta (bandwidth per rank)
  fitted per collective by least squares against the ring formulas of
  `strategies.collectives` (relative error weighted, so 1 KB counts as much as 128 MB),
  piecewise where the bandwidth changes with size (`fit_collective`: past the shared
  cache gloo's copies stream from memory, about half as fast);
- DTensor's fixed costs: a tiny Linear run through ColwiseParallel / RowwiseParallel, and
  a tiny DTensor redistribute, against the plain op and the fitted collective they issue.

The profile is pydantic JSON: `--devices profile.json` (or `4xprofile.json`) plans on it.

    hyplan calibrate --processes 2 4 --out cpu-profile.json
"""

from __future__ import annotations

import datetime
import os
import platform
import statistics
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from strategies.cluster import Cluster
from strategies.collectives import COEFFICIENTS
from strategies.devices import CollectiveFit, DeviceSpec, LinkSpec, Regime, shared_cache_bytes

PROFILE_SCHEMA = "hyplan.cluster-profile/1"
# Up to 128 MB. Past the shared cache gloo's copies stream from memory on every rank at
# once: a 64-128 MB all-gather took twice what a fit on sizes <= 32 MB predicts, and one
# line fitted through 128 MB overpriced every smaller message (4-process median error 8% ->
# 41%), so the fit is piecewise (fit_collective) and the sizes reach past the cache.
SIZES = (1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20,
         128 << 20)
QUICK_SIZES = (1 << 10, 1 << 20, 8 << 20, 32 << 20, 64 << 20, 128 << 20)
# a second regime must at least halve the one line's squared relative error to be kept
SPLIT_GAIN = 0.5
MEASURED = ("all_reduce", "bucket_all_reduce", "all_gather", "reduce_scatter", "all_to_all",
            "send_recv")


class Sample(BaseModel):
    """One measured timing: `collective` over `nbytes` (the global tensor) on `ranks`."""

    model_config = ConfigDict(frozen=True)

    collective: str
    ranks: int
    nbytes: int
    seconds: float


class ClusterProfile(BaseModel):
    """A measured machine: its device, its links per process count, DTensor's overheads,
    and the raw samples the fits came from (so a fit can be checked or redone)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    schema_id: Literal["hyplan.cluster-profile/1"] = Field(PROFILE_SCHEMA, alias="schema")
    created: str
    host: str
    torch_version: str
    backend: str
    cores: int
    threads_per_process: int
    cpu_model: str = ""
    quick: bool = False  # made by the quick calibration (first use of a local device)
    seconds: float = 0.0  # how long measuring took
    device: DeviceSpec
    links: dict[int, LinkSpec] = Field(description="fitted link per process count")
    dtensor_layer_overhead_s: dict[int, float] = Field(default_factory=dict)
    dtensor_reshard_overhead_s: dict[int, float] = Field(default_factory=dict)
    # compute- and memory-bound ops run on every process at once, against alone
    compute_slowdown: dict[int, float] = Field(default_factory=dict)
    memory_slowdown: dict[int, float] = Field(default_factory=dict)
    step_overhead_s: dict[int, float] = Field(default_factory=dict)
    fsdp_overhead_s_per_byte: dict[int, float] = Field(default_factory=dict)
    samples: list[Sample] = Field(default_factory=list)
    # CPU (in cores) other processes used while this was measured: DTensor's and a step's
    # fixed costs are differences of small medians, which others' load inflates up to 100x
    # (0.19 -> 28 ms per redistribute at load 12 on the 2-core VM)
    other_load_cores: float | None = None

    def _nearest(self, table: dict[int, object], count: int):
        if not table:
            return None
        return table[min(table, key=lambda k: (abs(k - count), -k))]

    def cluster(self, devices_per_node: int | None = None, nodes: int | None = None) -> Cluster:
        """A Cluster of `devices_per_node` of the measured devices (default: the largest
        process count measured), with the link fitted at that count (or the nearest)."""
        per_node = devices_per_node or max(self.links, default=1)
        link = self._nearest(self.links, per_node)
        slowdown = self.compute_slowdown.get(per_node)
        if slowdown is None and self.device.kind == "cpu":
            # not measured at this count: the time-sharing rule from the nearest count
            # measured (or from none: the bare share of the cores)
            from strategies.cluster import time_sharing_slowdown

            measured_at = min(self.compute_slowdown or {per_node: 1.0},
                              key=lambda k: (abs(k - per_node), -k))
            slowdown = time_sharing_slowdown(
                per_node, measured_at, self.threads_per_process, self.cores,
                self.compute_slowdown.get(measured_at) or max(
                    1.0, measured_at * self.threads_per_process / self.cores))
        elif slowdown is None:
            slowdown = self._nearest(self.compute_slowdown, per_node) or 1.0
        if link is None:  # one process: nothing was communicated; the loopback default
            from strategies.devices import CPU_LINK

            link = CPU_LINK
        return Cluster(
            device=self.device, nodes=nodes or 1, devices_per_node=per_node,
            intra_node=link, inter_node=link,
            cores=self.cores if self.device.kind == "cpu" else 0,
            threads_per_device=self.threads_per_process,
            dtensor_layer_overhead_s=self._nearest(self.dtensor_layer_overhead_s, per_node) or 0.0,
            dtensor_reshard_overhead_s=self._nearest(self.dtensor_reshard_overhead_s, per_node) or 0.0,
            compute_slowdown=slowdown,
            memory_slowdown=self._nearest(self.memory_slowdown, per_node) or slowdown,
            step_overhead_s=self._nearest(self.step_overhead_s, per_node) or 0.0,
            fsdp_overhead_s_per_byte=self._nearest(self.fsdp_overhead_s_per_byte,
                                                   per_node) or 0.0,
            source=self.describe())

    def describe(self) -> str:
        """Which measurement this is, for explain(): host, when, how."""
        how = "quick calibration" if self.quick else "hyplan calibrate"
        counts = "/".join(str(p) for p in sorted(self.links)) or "1"
        return (f"{how} of {self.host} ({self.cpu_model or self.device.name}, {self.cores} "
                f"cores, {counts} processes, torch {self.torch_version}), made {self.created}"
                + (f"; made while other processes used {self.other_load_cores:.1f} cores: "
                   f"its figures are inflated, run `hyplan calibrate` on an idle machine"
                   if self.busy else ""))

    @property
    def busy(self) -> bool:
        """Was the machine busy with other work while this was measured?"""
        return (self.other_load_cores or 0.0) > BUSY_CORES

    def save(self, path: str | Path) -> None:
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(self.model_dump_json(indent=2, by_alias=True))
        tmp.replace(path)


# other processes' CPU above which a calibration is called busy (a quiet VM shows 0.0-0.1)
BUSY_CORES = 0.25


def load_profile(path: str | Path) -> ClusterProfile:
    """Read a profile written by `hyplan calibrate`; a bad file is a one-line error."""
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ValueError(f"devices: cannot read cluster profile {str(path)!r} "
                         f"({error.strerror}); write one with `hyplan calibrate --out "
                         f"{path}`") from None
    try:
        return ClusterProfile.model_validate_json(text)
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"]) or "(top level)"
        raise ValueError(f"devices: {path} is not a hyplan cluster profile (field {where}: "
                         f"{first['msg']}); re-create it with `hyplan calibrate`") from None


# --- the fit ------------------------------------------------------------------------------

def fit_alpha_beta(samples: list[Sample]) -> CollectiveFit:
    """alpha and beta of one collective from timings (any mix of sizes and rank counts).

    Each sample reads t = a(P)·α + b(P)·n·(1/β) (`strategies.collectives.COEFFICIENTS`):
    linear in (α, 1/β). Rows are divided by t, so the fit minimizes relative error and a
    1 KB message weighs as much as a 32 MB one; α or 1/β that come out negative (noise on a
    link with no visible latency) are clamped at zero and the other refitted alone.
    """
    if not samples:
        raise ValueError("fit_alpha_beta: no samples")
    names = {s.collective for s in samples}
    if len(names) != 1:
        raise ValueError(f"fit_alpha_beta: samples of one collective only, got {sorted(names)}")
    coefficients = COEFFICIENTS[names.pop()]
    rows, targets = [], []
    for s in samples:
        if s.seconds <= 0:
            raise ValueError(f"fit_alpha_beta: non-positive time {s.seconds} for {s}")
        a, b = coefficients(s.ranks)
        rows.append([a / s.seconds, b * s.nbytes / s.seconds])
        targets.append(1.0)
    x, y = np.array(rows), np.array(targets)
    (alpha, inv_beta), *_ = np.linalg.lstsq(x, y, rcond=None)
    if alpha < 0:
        alpha, inv_beta = 0.0, float(np.linalg.lstsq(x[:, 1:], y, rcond=None)[0][0])
    if inv_beta <= 0:
        inv_beta = 1e-15  # no measurable size dependence: an effectively infinite link
        alpha = max(0.0, float(np.linalg.lstsq(x[:, :1], y, rcond=None)[0][0]))
    return CollectiveFit(latency_s=float(alpha), bandwidth_bytes_per_s=float(1.0 / inv_beta))


def _squared_error(fit: CollectiveFit, samples: list[Sample]) -> float:
    """Sum over samples of ((predicted - measured) / measured)^2."""
    total = 0.0
    for s in samples:
        a, b = COEFFICIENTS[s.collective](s.ranks)
        alpha, beta = fit.alpha_beta(s.nbytes)
        total += ((a * alpha + b * s.nbytes / beta) / s.seconds - 1.0) ** 2
    return total


def _two_lines(samples: list[Sample], above_bytes: float) -> CollectiveFit:
    lower = fit_alpha_beta([s for s in samples if s.nbytes <= above_bytes])
    upper = fit_alpha_beta([s for s in samples if s.nbytes > above_bytes])
    return CollectiveFit(latency_s=lower.latency_s,
                         bandwidth_bytes_per_s=lower.bandwidth_bytes_per_s,
                         regimes=(Regime(above_bytes=above_bytes, latency_s=upper.latency_s,
                                         bandwidth_bytes_per_s=upper.bandwidth_bytes_per_s),))


def fit_collective(samples: list[Sample], split_bytes: float | None = None,
                   min_sizes: int = 2) -> CollectiveFit:
    """One collective's cost, piecewise where its bandwidth changes with size.

    With `split_bytes` (on CPU: the shared cache, past which gloo's copies stream from
    memory), sizes up to it get one line and sizes past it another (`fit_alpha_beta` on
    each side), when each side has `min_sizes` sizes; else one line. Without it, every
    split of the measured sizes (the lower range with one size more than `min_sizes`)
    is tried and the one with the least squared relative error is kept if it at least
    halves the one line's (SPLIT_GAIN): where a library changes protocol with size and
    the machine says nothing of where. Data made by two exact lines is recovered
    exactly; a searched split lies at the largest size measured below the change."""
    sizes = sorted({s.nbytes for s in samples})
    if split_bytes is not None:
        below = sum(n <= split_bytes for n in sizes)
        if below < min_sizes or len(sizes) - below < min_sizes:
            return fit_alpha_beta(samples)
        return _two_lines(samples, split_bytes)
    one = fit_alpha_beta(samples)
    best, best_error = one, _squared_error(one, samples) * SPLIT_GAIN
    for i in range(min_sizes + 1, len(sizes) - min_sizes + 1):
        fit = _two_lines(samples, sizes[i - 1])
        error = _squared_error(fit, samples)
        if error < best_error:
            best, best_error = fit, error
    return best


def fit_link(samples: list[Sample], name: str, source: str,
             split_bytes: float | None = None) -> LinkSpec:
    """A LinkSpec with one (piecewise, `fit_collective`) fit per collective; its own
    figures are all-reduce's for small messages."""
    fits = {c: fit_collective([s for s in samples if s.collective == c], split_bytes)
            for c in sorted({s.collective for s in samples})}
    base = fits.get("all_reduce") or next(iter(fits.values()))
    return LinkSpec(name=name, bandwidth_bytes_per_s=base.bandwidth_bytes_per_s,
                    latency_s=base.latency_s, source=source, collectives=fits)


# --- measuring, inside each rank ------------------------------------------------------------

def _span_timer(device: torch.device):
    """span(fn) -> (start, end) of one call in seconds. On CPU the clock is the host's
    monotonic clock, which every process on the machine shares, so spans of one call on
    several ranks can be compared; on a GPU, CUDA events (start 0: durations only)."""
    if device.type == "cuda":
        def span(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return 0.0, start.elapsed_time(end) / 1e3
        return span

    def span(fn):
        begin = time.perf_counter()
        fn()
        return begin, time.perf_counter()
    return span


def _timer(device: torch.device):
    """seconds(fn): one timed call, with CUDA events on a GPU."""
    span = _span_timer(device)

    def seconds(fn):
        begin, end = span(fn)
        return end - begin
    return seconds


def _compute_burst(device, seconds: float = 8e-3):
    """A closure that keeps this rank computing for about `seconds` (matmuls)."""
    a = torch.randn(256, 256, device=device)
    timer = _timer(device)
    one = min(timer(lambda: a @ a) for _ in range(5))
    count = max(1, round(seconds / max(one, 1e-6)))

    def burst():
        for _ in range(count):
            a @ a
    return burst


def _in_step_time(fn, device, repeats: int) -> float:
    """Seconds of `fn` as a training step meets it: every rank computes for a moment
    (an ~8 ms burst, about a layer's time here) and then calls it, `repeats` times; the
    mean of the middle 80%. How long the ranks computed matters: a 1 MB all-reduce took
    1.6 ms after 0.5 ms bursts, 2.3 ms after 2 ms, 3.5-4.8 ms after 8-25 ms.

    Why not back-to-back calls after a barrier: there the ranks arrive together and their
    communication threads are awake. In a step one rank arrives first and sleeps in the
    collective until the other's data wakes it; on this 2-core VM that costs a median 2 ms
    per collective, against 0.2-0.5 ms after a barrier (a 1 KB gloo all-reduce), which made
    tensor-parallel plans of small models look 2x faster than they ran. And the mean, not
    the median: such latencies are bimodal, and a step is a sum of many of them."""
    return _trimmed_mean([end - start for start, end in _in_step_spans(fn, device, repeats)])


def _in_step_spans(fn, device, repeats: int) -> list[tuple[float, float]]:
    """(start, end) of each of `repeats` calls of `fn`, each after a compute burst (see
    `_in_step_time`); `_call_seconds` combines the ranks' spans of one call."""
    span = _span_timer(device)
    burst = _compute_burst(device)
    fn()  # warm up: connections, buffers
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
    fn()
    spans = []
    for _ in range(repeats):
        dist.barrier()
        spans.append(span(fn))
    return spans


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
    full = torch.randn(elements, device=device)
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
        if dist.get_backend() == "gloo":
            # DTensor's shard-to-shard redistribute on a CPU group is an all-gather and a
            # chunk (gloo has no all-to-all it uses): measure what the executor will run
            # (each rank's n/P gathered into n, then chunked)
            return _collective_call("all_gather", nbytes, rank, world, device)
        out = torch.empty_like(full)
        return lambda: dist.all_to_all_single(out, full)
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
    """Forward + backward of a tiny Linear through DTensor's parallel styles, and of one
    tiny redistribute, against the plain op: the seconds DTensor adds beyond the
    collectives themselves (those are subtracted by the caller with the fitted link)."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel, RowwiseParallel, parallelize_module,
    )

    mesh = init_device_mesh(device.type, (world,))
    width, rows = 64, 8
    x = torch.randn(rows, width, device=device)

    def step_of(module, inp):
        def step():
            y = module(inp.detach().requires_grad_(True))
            y.sum().backward()
        return step

    torch.manual_seed(0)
    plain = nn.Linear(width, width).to(device)
    col = parallelize_module(nn.Linear(width, width).to(device), mesh, ColwiseParallel())
    row = parallelize_module(nn.Linear(width, width).to(device), mesh,
                             RowwiseParallel(input_layouts=Shard(-1)))
    x_shard = x[:, : width // world].contiguous()

    def redistribute():
        d = DTensor.from_local(x.detach().requires_grad_(True), mesh, [Shard(0)],
                               run_check=False)
        d.redistribute(mesh, [Replicate()]).to_local().sum().backward()

    return {
        "plain": _in_step_time(step_of(plain, x), device, repeats),
        "column": _in_step_time(step_of(col, x), device, repeats),
        "row": _in_step_time(step_of(row, x_shard), device, repeats),
        "reshard": _in_step_time(redistribute, device, repeats),
        "tiny_bytes": float(x.numel() * x.element_size() * world),
        "row_bytes": float(rows * width * 4),
    }


def contention_ops(device: torch.device, repeats: int = 15) -> dict[str, float]:
    """Median seconds of a compute-bound op (a 2048-wide Linear, forward and backward, on
    64 rows) and a memory-bound one (a 256 MB copy), each ~30 ms so that time slices
    average out. Run alone and on every rank at once, their ratio is what sharing the
    machine costs: cores, caches and memory bandwidth."""
    from profiler.profile import median_time

    torch.manual_seed(0)
    linear = torch.nn.Linear(2048, 2048).to(device)
    x = torch.randn(64, 2048, device=device)
    src = torch.ones(256 * 2**20 // 4, device=device)
    dst = torch.zeros_like(src)

    def step():
        linear(x.detach().requires_grad_(True)).sum().backward()

    return {"compute": median_time(step, repeats, budget_s=0.0),
            "memory": median_time(lambda: dst.copy_(src), repeats, budget_s=0.0)}


def _two_linears(width: int, device):
    """(two `width`-wide Linears with a ReLU between, step_of(model)): the small training
    step the fixed-cost measurements run plainly and wrapped (DDP, FSDP2); step_of gives
    one SGD step of the model it is handed on 16 rows."""
    from torch import nn

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width)).to(device)
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

    plain, step_of = _two_linears(256, device)
    ddp = DistributedDataParallel(_two_linears(256, device)[0],
                                  device_ids=None if device.type == "cpu" else [device])
    return {"plain": _in_step_time(step_of(plain), device, repeats),
            "ddp": _in_step_time(step_of(ddp), device, repeats),
            "grad_bytes": float(sum(p.numel() * p.element_size() for p in plain.parameters()))}


def _fsdp_step(device, repeats: int = 9) -> dict[str, float]:
    """A step of two 2048-wide Linears (32 MB of weights, past the shared cache on two
    processes, as the layers FSDP is for are) run plainly and under FSDP2 `fully_shard`
    per layer: their difference, less the all-gathers and reduce-scatters FSDP issues
    (subtracted by the caller with the fitted link), is what FSDP2 costs per byte of
    weights beyond its collectives: copying shards into and out of its flat buffers, and
    on gloo its reduce-scatter's concatenation. Measured here: about nothing at these
    16 MB layers; at 64 MB layers FSDP steps ran 2.7 ms per MB over, most of it in the
    collectives themselves past the shared cache (see SIZES), which this does not catch."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    plain, step_of = _two_linears(2048, device)
    sharded = _two_linears(2048, device)[0]
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in (sharded[0], sharded[2]):
        fully_shard(layer, mesh=mesh)
    return {"plain": _in_step_time(step_of(plain), device, repeats),
            "fsdp": _in_step_time(step_of(sharded), device, repeats),
            "layer_bytes": float(2048 * 2049 * 4), "layers": 2.0}


def _contention(rank: int, device, quiet_wait_s: float, trials: int = 5,
                repeats: int = 9) -> dict[str, float]:
    """Rank 0 alone (the others idle in a barrier), then every rank at once, in turn
    `trials` times: the median of the ratios, so that load elsewhere on the machine, which
    drifts, weighs on both sides alike."""
    from profiler.launch import wait_for_quiet

    ratios: dict[str, list[float]] = {"compute": [], "memory": []}
    for _ in range(trials):
        if quiet_wait_s > 0 and rank == 0:
            wait_for_quiet(quiet_wait_s)
        dist.barrier()
        alone = contention_ops(device, repeats) if rank == 0 else None
        dist.barrier()
        together = contention_ops(device, repeats)
        dist.barrier()
        if rank == 0:
            for key in ratios:
                ratios[key].append(together[key] / alone[key])
    return {key: statistics.median(r) if r else 1.0 for key, r in ratios.items()}


def repeats_for(nbytes: int, repeats: int) -> int:
    """Fewer calls of the largest messages: a 128 MB gloo all-gather takes 0.2-0.6 s here,
    and its spread is small against its size."""
    if nbytes >= 64 << 20:
        return max(3, repeats // 5)
    if nbytes >= 16 << 20:
        return max(5, repeats // 2)
    return repeats


def _rank_measure(rank: int, world: int, sizes, repeats: int, quiet_wait_s: float = 0.0,
                  quick: bool = False) -> dict:
    from profiler.launch import wait_for_quiet

    device = torch.device("cuda", rank) if dist.get_backend() == "nccl" else torch.device("cpu")
    together = _contention(rank, device, quiet_wait_s, trials=3 if quick else 5,
                           repeats=5 if quick else 9)
    spans = []
    for name in MEASURED:
        if name == "send_recv" and world != 2:
            continue  # one pair is enough; it is measured on 2 ranks
        if name == "all_to_all" and dist.get_backend() == "gloo":
            continue  # DTensor runs it as an all-gather on gloo: calibrate() copies those
        for nbytes in sizes:
            if quiet_wait_s > 0:  # on a shared machine, measure between others' bursts
                if rank == 0:
                    wait_for_quiet(quiet_wait_s)
                dist.barrier()
            try:
                timing = _together_spans if name == "bucket_all_reduce" else _in_step_spans
                calls = timing(_collective_call(name, nbytes, rank, world, device), device,
                               repeats_for(nbytes, repeats))
            except RuntimeError as error:  # e.g. a collective the backend lacks
                if "not supported" in str(error).lower() or "unsupported" in str(error).lower():
                    break
                raise
            spans.append((name, nbytes, calls))
    # tiny ops: many repeats are cheap, and the difference of two medians needs them
    return {"spans": spans,
            "dtensor": _dtensor_overheads(rank, world, device, 15 if quick else 31),
            "contention": together, "step": _step_overhead(device, 11 if quick else 21),
            "fsdp": _fsdp_step(device, 5 if quick else 9)}


# --- compute ---------------------------------------------------------------------------------

def measure_compute(threads: int, device: str = "cpu") -> DeviceSpec:
    """Achieved FLOP/s of matmul and conv2d, and copy bandwidth (256 MB, out of cache),
    on `device` with `threads` intra-op threads, by torch.utils.benchmark medians."""
    from torch.utils import benchmark

    from profiler.machine import threads as thread_count

    dev = torch.device(device)

    def median_s(stmt: str, env: dict, min_run_time: float = 0.3) -> float:
        timer = benchmark.Timer(stmt=stmt, globals=env, num_threads=threads)
        return timer.blocked_autorange(min_run_time=min_run_time).median

    with thread_count(threads), torch.no_grad():
        n = 1024
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
        half = {}
        if dev.type == "cuda":  # tensor cores: the rate of each low-precision dtype
            for dtype in (torch.bfloat16, torch.float16):
                h, g = a.to(dtype), b.to(dtype)
                half[str(dtype).removeprefix("torch.")] = 2 * n**3 / median_s(
                    "h @ g", {"h": h, "g": g})
    if dev.type == "cuda":
        memory = float(torch.cuda.get_device_properties(dev).total_memory)
        name = torch.cuda.get_device_name(dev)
    else:
        memory = float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
        name = "cpu"
    return DeviceSpec(
        name=name, kind=dev.type, efficiency=1.0,
        peak_flops={"float32": matmul, "bfloat16": matmul / 2, "float16": matmul / 4}
        if dev.type == "cpu" else {"float32": matmul, **half},
        op_flops={"matmul": matmul, "conv2d": conv},
        memory_bytes=memory, memory_bandwidth_bytes_per_s=bandwidth,
        cache_bytes=shared_cache_bytes() if dev.type == "cpu" else 0.0,
        source=f"measured by hyplan calibrate ({threads} threads, torch.utils.benchmark)")


# --- the whole calibration -------------------------------------------------------------------

def calibrate(processes=(2, 4), quick: bool = False, repeats: int | None = None,
              log=print, quiet_wait_s: float = 0.0, kind: str | None = None) -> ClusterProfile:
    """Measure this machine: compute at the threads each of max(processes) gets, and the
    collectives on every process count of at least 2 in `processes` (`(1,)`: compute
    only). `quiet_wait_s`: before each measurement, wait up to that long for other
    processes' load to pause. `kind`: "cpu" or "cuda" (default: CUDA where this machine
    has max(processes) GPUs)."""
    from profiler.launch import run_ranks
    from profiler.machine import cpu_model
    from strategies.cluster import cpu_threads_per_device

    started = time.perf_counter()
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= max(processes)
    if kind is not None:
        if kind == "cuda" and not cuda:
            raise ValueError(f"calibrate: {max(processes)} CUDA devices asked for, this "
                             f"machine has {torch.cuda.device_count()}")
        cuda = kind == "cuda"
    backend = "nccl" if cuda else "gloo"
    sizes = QUICK_SIZES if quick else SIZES
    repeats = repeats or (10 if quick else 25)
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads() if cuda else cpu_threads_per_device(max(processes))

    log(f"compute: matmul, conv2d and a 256 MB copy with {threads} thread(s)")
    if quiet_wait_s > 0:
        from profiler.launch import wait_for_quiet

        wait_for_quiet(quiet_wait_s)
    device = measure_compute(threads, "cuda" if cuda else "cpu")
    log(f"  matmul {device.op_flops['matmul'] / 1e9:.1f} GFLOP/s, conv2d "
        f"{device.op_flops['conv2d'] / 1e9:.1f} GFLOP/s, copy "
        f"{device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s")

    links, layer_overhead, reshard_overhead, all_samples = {}, {}, {}, []
    compute_slowdown, memory_slowdown, step_overhead, fsdp_overhead = {}, {}, {}, {}
    for world in (p for p in processes if p >= 2):
        log(f"collectives on {world} {backend} ranks: {', '.join(MEASURED)}, "
            f"{len(sizes)} sizes x {repeats} repeats")
        per_rank = run_ranks(_rank_measure, world, sizes, repeats, quiet_wait_s, quick,
                             backend=backend, threads=1 if backend == "gloo" else threads)
        samples = []
        for i, (name, nbytes, _) in enumerate(per_rank[0]["spans"]):
            t = _call_seconds([r["spans"][i][2] for r in per_rank])
            samples.append(Sample(collective=name, ranks=world, nbytes=nbytes,
                                  seconds=t / 2 if name == "send_recv" else t))
        if backend == "gloo":  # DTensor's all-to-all on gloo is an all-gather (see above)
            samples += [s.model_copy(update={"collective": "all_to_all"})
                        for s in samples if s.collective == "all_gather"]
        all_samples += samples
        # on CPU the regimes change where the processes' data spills the shared cache
        link = fit_link(samples, f"{backend} ({world} processes)",
                        f"fitted by hyplan calibrate on {platform.node()}",
                        split_bytes=device.cache_bytes or None)
        links[world] = link
        for name, fit in link.collectives.items():
            line = (f"  {name:<17} alpha {fit.latency_s * 1e3:7.3f} ms   beta "
                    f"{fit.bandwidth_bytes_per_s / 1e9:6.2f} GB/s")
            for r in fit.regimes:
                line += (f"; past {r.above_bytes / 2**20:g} MB: alpha {r.latency_s * 1e3:.3f} "
                         f"ms, beta {r.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
            log(line)
        layer_overhead[world], reshard_overhead[world] = _overheads(per_rank, world, link)
        for key, table in (("compute", compute_slowdown), ("memory", memory_slowdown)):
            table[world] = max(1.0, per_rank[0]["contention"][key])
        step_overhead[world] = _fixed_step(per_rank, world, link)
        log(f"  a distributed step's fixed cost: {step_overhead[world] * 1e3:.2f} ms")
        fsdp_overhead[world] = _fsdp_per_byte(per_rank, world, link)
        log(f"  FSDP2 beyond its collectives: {fsdp_overhead[world] * 1e9:.2f} ms per MB "
            f"of sharded weights")
        log(f"  all {world} at once: compute {compute_slowdown[world]:.2f}x, memory "
            f"{memory_slowdown[world]:.2f}x slower than one process alone")
        log(f"  DTensor: {layer_overhead[world] * 1e3:.2f} ms per parallel layer, "
            f"{reshard_overhead[world] * 1e3:.2f} ms per redistribute (fwd + bwd)")
    return ClusterProfile(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), torch_version=torch.__version__, backend=backend, cores=cores,
        threads_per_process=threads, cpu_model=cpu_model(), quick=quick,
        seconds=round(time.perf_counter() - started, 1), device=device, links=links,
        dtensor_layer_overhead_s=layer_overhead, dtensor_reshard_overhead_s=reshard_overhead,
        compute_slowdown=compute_slowdown, memory_slowdown=memory_slowdown,
        step_overhead_s=step_overhead, fsdp_overhead_s_per_byte=fsdp_overhead,
        samples=all_samples)


def _overheads(per_rank: list[dict], world: int, link: LinkSpec) -> tuple[float, float]:
    """DTensor's own seconds per parallel layer and per redistribute: the measured step
    less the plain op and the collective it issues (priced by the fitted link)."""
    from strategies.collectives import all_gather_s, all_reduce_s

    d = {k: max(r["dtensor"][k] for r in per_rank) for k in per_rank[0]["dtensor"]}
    # column: backward all-reduces the partial input gradient; row: forward all-reduces
    # the partial output
    column = d["column"] - d["plain"] - all_reduce_s(d["row_bytes"], world, link)
    row = d["row"] - d["plain"] - all_reduce_s(d["row_bytes"], world, link)
    reshard = d["reshard"] - all_gather_s(d["tiny_bytes"], world, link)
    return max(0.0, (column + row) / 2), max(0.0, reshard)


def _fsdp_per_byte(per_rank: list[dict], world: int, link: LinkSpec) -> float:
    """FSDP2's seconds per byte of weights beyond its collectives (two all-gathers and a
    reduce-scatter per layer, priced by the fitted link) and the plain step."""
    from strategies.collectives import all_gather_s, reduce_scatter_s

    d = {k: max(r["fsdp"][k] for r in per_rank) for k in per_rank[0]["fsdp"]}
    p = d["layer_bytes"]
    collectives = d["layers"] * (2 * all_gather_s(p, world, link)
                                 + reduce_scatter_s(p, world, link))
    return max(0.0, d["fsdp"] - d["plain"] - collectives) / (d["layers"] * p)


def _fixed_step(per_rank: list[dict], world: int, link: LinkSpec) -> float:
    """A DDP step less the plain step and its gradient all-reduce (fitted link)."""
    from strategies.collectives import collective_time_s

    d = {k: max(r["step"][k] for r in per_rank) for k in per_rank[0]["step"]}
    sync = collective_time_s("bucket_all_reduce", d["grad_bytes"], world, link)
    return max(0.0, d["ddp"] - d["plain"] - sync)
