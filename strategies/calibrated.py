"""A measured machine as the cost model reads it: `ClusterProfile` (pydantic JSON, what
`--devices profile.json` plans on), `load_profile`, the fits, and `calibrate`, which runs
`profiler.calibrate`'s measurements and fits them.

The fits: alpha (latency per message) and beta (bandwidth per rank) per collective by
least squares against the ring formulas of `strategies.collectives` (relative error
weighted, so 1 KB counts as much as 128 MB), piecewise where the bandwidth changes with
size (`fit_collective`: past the shared cache gloo's copies stream from memory, about half
as fast); DTensor's, DDP's and FSDP2's fixed costs are what their measured steps take
beyond the plain step and the collectives the fitted link prices.

    hyplan calibrate --processes 2 4 --out cpu-profile.json
"""

from __future__ import annotations

import datetime
import os
import platform
import time
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from profiler.calibrate import (
    BURST_S, GAP_BYTES, MEASURED, QUICK_SIZES, SIZES, ComputeRates, Sample, burst_wall_s,
    gap_seconds, measure_collectives, measure_compute,
)
from profiler.allocator import POLICY as MEMORY_POLICY
from profiler.launch import wait_for_quiet
from profiler.machine import cpu_model
from strategies.cluster import Cluster, cpu_threads_per_device, time_sharing_slowdown
from strategies.collectives import (
    COEFFICIENTS, all_reduce_s, collective_time_s,
)
from strategies.devices import (
    CPU_LINK, ELEMENTWISE_FRACTION, UNALIGNED_FRACTION, CollectiveFit, DeviceSpec, GapCurve,
    GPUShape, LinkSpec, Regime, shared_cache_bytes,
)

PROFILE_SCHEMA = "hyplan.cluster-profile/1"
# a second regime must at least halve the one line's squared relative error to be kept
SPLIT_GAIN = 0.5
# ... unless the one line already fits every size to this relative error (rounding):
# with numpy 2.4.6, a split of exact data on one line "halved" its error (7e-31 to 3e-31)
# and was kept
EXACT_RELATIVE_ERROR = 1e-9


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
    # the CPU memory policy the ranks ran under (profiler.allocator.POLICY); "" before it
    # was recorded. A local profile made under another is measured again (profile_cache)
    memory_policy: str = ""
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
            measured_at = min(self.compute_slowdown or {per_node: 1.0},
                              key=lambda k: (abs(k - per_node), -k))
            slowdown = time_sharing_slowdown(
                per_node, measured_at, self.threads_per_process, self.cores,
                self.compute_slowdown.get(measured_at) or max(
                    1.0, measured_at * self.threads_per_process / self.cores))
        elif slowdown is None:
            slowdown = self._nearest(self.compute_slowdown, per_node) or 1.0
        if link is None:  # one process: nothing was communicated; the loopback default
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
    alpha, beta = _range_line([s for s in samples if s.nbytes > above_bytes], above_bytes)
    return CollectiveFit(latency_s=lower.latency_s,
                         bandwidth_bytes_per_s=lower.bandwidth_bytes_per_s,
                         regimes=(Regime(above_bytes=above_bytes, latency_s=alpha,
                                         bandwidth_bytes_per_s=beta),))


def _range_line(samples: list[Sample], above_bytes: float) -> tuple[float, float]:
    """The line of the messages past `above_bytes`: a least-squares line in relative error
    whose intercept may be negative, as long as it stays positive over the range. Past the
    shared cache time grows faster than in proportion here (an FSDP2 layer: 1.7 ms/MB at
    38 MB, 2.3-3.9 ms/MB at 67 MB); a line forced through a non-negative intercept splits
    the difference and priced the 67 MB layers of fc_cnn 40% short. `fit_alpha_beta`'s
    clamped line where the free one is not that. Returns (alpha, beta)."""
    a, b = COEFFICIENTS[samples[0].collective](samples[0].ranks)
    if len({s.nbytes for s in samples}) >= 2 and len({s.ranks for s in samples}) == 1:
        x = np.array([[a / s.seconds, b * s.nbytes / s.seconds] for s in samples])
        (alpha, inv_beta), *_ = np.linalg.lstsq(x, np.ones(len(samples)), rcond=None)
        if alpha < 0 < inv_beta and a * alpha + b * above_bytes * inv_beta > 0:
            return float(alpha), float(1 / inv_beta)
    fit = fit_alpha_beta(samples)
    return fit.latency_s, fit.bandwidth_bytes_per_s


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
    if _squared_error(one, samples) <= len(samples) * EXACT_RELATIVE_ERROR**2:
        return one  # one line to rounding: a split could only "halve" rounding noise
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


def gap_curve(per_rank: list[dict]) -> GapCurve:
    """The link's GapCurve from every rank's timings of the small all-reduce after each
    gap (profiler.calibrate._gap_spans), made non-decreasing (`monotone`): a process that
    computed longer pays more to wake, and a few calls' noise would otherwise price a
    shorter gap above a longer one."""
    seconds = gap_seconds(per_rank)
    gaps = sorted(seconds)
    # the fits were timed after BURST_S bursts: read the curve where those really ended
    return GapCurve(gaps_s=tuple(gaps), seconds=tuple(monotone([seconds[g] for g in gaps])),
                    fits_gap_s=burst_wall_s(per_rank, BURST_S))


def monotone(values: list[float]) -> list[float]:
    """The non-decreasing sequence nearest `values` in least squares (pool adjacent
    violators: a run that falls is replaced by its mean)."""
    blocks: list[list[float]] = []  # [mean, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            (m2, c2), (m1, c1) = blocks.pop(), blocks.pop()
            blocks.append([(m1 * c1 + m2 * c2) / (c1 + c2), c1 + c2])
    return [m for m, c in blocks for _ in range(c)]


def device_spec(rates: ComputeRates) -> DeviceSpec:
    """The DeviceSpec of a measured device: rates achieved, so efficiency 1. On a CPU the
    half-precision rates are what its float32 matmul allows (no tensor cores); a GPU is
    priced by shape (strategies.gpu_compute) at its measured ceilings: GEMM tiles and waves
    over its own SMs at the large-GEMM rate, flash attention at its measured share of it,
    memory-bound ops at the measured copy bandwidth, nothing below the measured launch."""
    if rates.kind == "cpu":
        return DeviceSpec(
            name=rates.name, kind=rates.kind, efficiency=1.0,
            peak_flops={"float32": rates.matmul_flops, "bfloat16": rates.matmul_flops / 2,
                        "float16": rates.matmul_flops / 4},
            op_flops={"matmul": rates.matmul_flops, "conv2d": rates.conv2d_flops},
            memory_bytes=rates.memory_bytes,
            memory_bandwidth_bytes_per_s=rates.copy_bytes_per_s,
            cache_bytes=shared_cache_bytes(),
            source=f"measured by hyplan calibrate ({rates.threads} threads, "
                   f"torch.utils.benchmark)")
    peak = {"float32": rates.matmul_flops, **rates.half_flops}
    half = rates.half_flops.get("bfloat16", rates.matmul_flops)
    shape = GPUShape(
        sm_count=max(1, rates.multiprocessors), matmul_fraction=1.0,
        attention_fraction=min(1.0, rates.attention_flops / half) if rates.attention_flops
        else 0.35, memory_fraction=1.0, launch_s=rates.launch_s,
        # a training step's eager elementwise kernels against the best copy, and a GEMM off
        # the 16-byte alignment: what the catalog measured (strategies.devices)
        elementwise_fraction=ELEMENTWISE_FRACTION, unaligned_fraction=UNALIGNED_FRACTION,
        source=f"measured by hyplan calibrate: GEMM ceilings, flash attention "
               f"{rates.attention_flops / 1e12:.0f} TFLOP/s, launch "
               f"{rates.launch_s * 1e6:.1f} us; elementwise and unaligned GEMM shares "
               f"as the catalog's")
    return DeviceSpec(
        name=rates.name, kind=rates.kind, efficiency=1.0, peak_flops=peak,
        memory_bytes=rates.memory_bytes, memory_bandwidth_bytes_per_s=rates.copy_bytes_per_s,
        shape=shape, source=f"measured by hyplan calibrate (CUDA events, "
                            f"torch.utils.benchmark; {shape.source})")


# --- the whole calibration -------------------------------------------------------------------

def _use_cuda(processes, kind: str | None) -> bool:
    """Whether to calibrate CUDA devices: `kind` where given (checked), else CUDA where
    this machine has max(processes) GPUs."""
    cuda = torch.cuda.is_available() and torch.cuda.device_count() >= max(processes)
    if kind is not None:
        if kind == "cuda" and not cuda:
            raise ValueError(f"calibrate: {max(processes)} CUDA devices asked for, this "
                             f"machine has {torch.cuda.device_count()}")
        cuda = kind == "cuda"
    return cuda


def _measure_device(threads: int, cuda: bool, quiet_wait_s: float, log,
                    started: float) -> DeviceSpec:
    """One device's compute rates, as a DeviceSpec, logged."""
    log(f"compute: matmul, conv2d and a 256 MB copy with {threads} thread(s)")
    if quiet_wait_s > 0:
        wait_for_quiet(quiet_wait_s)
    device = device_spec(measure_compute(threads, "cuda" if cuda else "cpu"))
    log("  " + ", ".join(f"{dtype} matmul {rate / 1e9:.1f} GFLOP/s"
                         for dtype, rate in device.peak_flops.items())
        + (f", conv2d {device.op_flops['conv2d'] / 1e9:.1f} GFLOP/s" if device.op_flops else "")
        + f", copy {device.memory_bandwidth_bytes_per_s / 1e9:.1f} GB/s"
        + f" ({time.perf_counter() - started:.1f} s)")
    return device


def _measure_link(world: int, sizes, repeats: int, quiet_wait_s: float, quick: bool,
                  backend: str, threads: int, device: DeviceSpec, log):
    """(link, samples, tensor-parallel samples, each rank's raw figures) of `world` ranks:
    the collectives measured and their link fitted."""
    log(f"collectives on {world} {backend} ranks: {', '.join(MEASURED)}, "
        f"{len(sizes)} sizes x {repeats} repeats")
    samples, per_rank = measure_collectives(world, sizes, repeats, quiet_wait_s, quick,
                                            backend, threads)
    samples += fsdp_layer_samples(per_rank, world)
    log("  measured in " + ", ".join(f"{name} {seconds:.1f} s"
                                     for name, seconds in per_rank[0]["phases"].items()))
    # on CPU the regimes change where the processes' data spills the shared cache
    link = fit_link(samples, f"{backend} ({world} processes)",
                    f"fitted by hyplan calibrate on {platform.node()}",
                    split_bytes=device.cache_bytes or None)
    if per_rank[0].get("gap") is not None:  # gloo
        link = link.model_copy(update={"gap_curve": gap_curve(per_rank)})
    tp_samples = tp_layer_samples(per_rank, world, link)
    if tp_samples:  # fitted on its own (absolute seconds, weights' bytes): see there
        link = link.model_copy(update={"collectives": {
            **link.collectives, "tp_layer": tp_layer_fit(tp_samples)}})
    samples += tp_samples
    return link, samples, tp_samples, per_rank


def _log_fits(link: LinkSpec, log) -> None:
    """Each collective's fit, with its regimes, and the gap curve where there is one."""
    for name, fit in link.collectives.items():
        line = (f"  {name:<17} alpha {fit.latency_s * 1e3:7.3f} ms   beta "
                f"{fit.bandwidth_bytes_per_s / 1e9:6.2f} GB/s")
        for r in fit.regimes:
            line += (f"; past {r.above_bytes / 2**20:g} MB: alpha {r.latency_s * 1e3:.3f} "
                     f"ms, beta {r.bandwidth_bytes_per_s / 1e9:.2f} GB/s")
        log(line)
    if link.gap_curve is not None:
        curve = link.gap_curve
        log(f"  a {GAP_BYTES // 1024} KB all-reduce after " + ", ".join(
            f"{g * 1e3:.2g} ms: {t * 1e3:.2f} ms" for g, t in zip(curve.gaps_s, curve.seconds))
            + " of compute")


def _log_overheads(world: int, link: LinkSpec, tp_samples, redone: int, compute_slowdown: float,
                   memory_slowdown: float, layer_overhead: float,
                   reshard_overhead: float, log) -> None:
    """The slowdown of all ranks at once and DTensor's and a tensor-parallel Linear's
    own costs on `world` ranks."""
    log(f"  all {world} at once: compute {compute_slowdown:.2f}x, memory "
        f"{memory_slowdown:.2f}x slower than one process alone"
        + (f" ({redone} trials run again: other processes worked meanwhile)"
           if redone else ""))
    log(f"  DTensor: {layer_overhead * 1e3:.2f} ms per parallel layer, "
        f"{reshard_overhead * 1e3:.2f} ms per redistribute (fwd + bwd)")
    if "tp_layer" in link.collectives:
        tp = link.collectives["tp_layer"]
        per_mb_ms = 2**20 / tp.bandwidth_bytes_per_s * 1e3
        log(f"  a tensor-parallel Linear beyond its math and collectives: "
            f"{tp.latency_s * 1e3:.2f} ms + {per_mb_ms:.3f} ms per MB of its weight on "
            f"each rank (pairs at "
            + ", ".join(f"{s.nbytes / 2**20:.2g} MB: {s.seconds * 1e3:.2f} ms"
                        for s in tp_samples) + ")")


def calibrate(processes=(2, 4), quick: bool = False, repeats: int | None = None,
              log=print, quiet_wait_s: float = 0.0, kind: str | None = None) -> ClusterProfile:
    """Measure this machine: compute at the threads each of max(processes) gets, and the
    collectives on every process count of at least 2 in `processes` (`(1,)`: compute
    only). `quiet_wait_s`: before each measurement, wait up to that long for other
    processes' load to pause. `kind`: "cpu" or "cuda" (default: CUDA where this machine
    has max(processes) GPUs)."""
    started = time.perf_counter()
    cuda = _use_cuda(processes, kind)
    backend = "nccl" if cuda else "gloo"
    sizes = QUICK_SIZES if quick else SIZES
    repeats = repeats or (10 if quick else 25)
    cores = os.cpu_count() or 1
    threads = torch.get_num_threads() if cuda else cpu_threads_per_device(max(processes))
    device = _measure_device(threads, cuda, quiet_wait_s, log, started)

    links, layer_overhead, reshard_overhead, all_samples = {}, {}, {}, []
    compute_slowdown, memory_slowdown, step_overhead = {}, {}, {}
    for world in (p for p in processes if p >= 2):
        link, samples, tp_samples, per_rank = _measure_link(
            world, sizes, repeats, quiet_wait_s, quick, backend, threads, device, log)
        all_samples += samples
        links[world] = link
        _log_fits(link, log)
        # a layer's fixed part (the tp_layer fit's latency): what prices a layer where a
        # profile has no fit, and what StepMonitor's refit scales
        layer_overhead[world] = link.collectives["tp_layer"].latency_s if tp_samples else 0.0
        for key, table in (("compute", compute_slowdown), ("memory", memory_slowdown)):
            table[world] = max(1.0, per_rank[0]["contention"][key])
        reshard_overhead[world] = _reshard_overhead(per_rank)
        step_overhead[world] = _fixed_step(per_rank, world, link)
        log(f"  a distributed step's fixed cost: {step_overhead[world] * 1e3:.2f} ms")
        _log_overheads(world, link, tp_samples, per_rank[0]["contention"].get("redone", 0),
                       compute_slowdown[world], memory_slowdown[world],
                       layer_overhead[world], reshard_overhead[world], log)
    return ClusterProfile(
        created=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        host=platform.node(), torch_version=torch.__version__, backend=backend, cores=cores,
        threads_per_process=threads, cpu_model=cpu_model(), quick=quick,
        memory_policy=MEMORY_POLICY if backend == "gloo" else "",
        seconds=round(time.perf_counter() - started, 1), device=device, links=links,
        dtensor_layer_overhead_s=layer_overhead, dtensor_reshard_overhead_s=reshard_overhead,
        compute_slowdown=compute_slowdown, memory_slowdown=memory_slowdown,
        step_overhead_s=step_overhead,
        samples=all_samples)


def _reshard_overhead(per_rank: list[dict]) -> float:
    """DTensor's own seconds per redistribute: its CPU beyond the plain op and the
    all-gather it issues (profiler.calibrate._dtensor_overheads), the most any rank spent.
    Not scaled by the all-at-once compute slowdown where processes outnumber cores: scaled,
    it reads more than twice the wall a redistribute adds there
    (benchmarks/results/HISTORY.md, "Calibration choices")."""
    d = {k: max(r["dtensor"][k] for r in per_rank) for k in ("plain", "gather", "reshard")}
    return max(0.0, d["reshard"] - d["plain"] - d["gather"])


def fsdp_layer_samples(per_rank: list[dict], world: int) -> list[Sample]:
    """The "fsdp_layer" samples: per layer, an FSDP2 step less the plain one (each timed
    across the ranks, `profiler.calibrate._interleaved_times`), which
    strategies.collectives.fsdp_layer_s prices FSDP layers by; its fit already holds the
    flat-buffer copies, so fsdp_overhead_s_per_byte stays 0."""
    out = []
    for width, (layers, nbytes, _, _) in per_rank[0]["fsdp"].items():
        plain = max(r["fsdp"][width][2] for r in per_rank)
        sharded = max(r["fsdp"][width][3] for r in per_rank)
        out.append(Sample(collective="fsdp_layer", ranks=world, nbytes=int(nbytes),
                          seconds=max(1e-6, (sharded - plain) / layers)))
    return out


def tp_layer_samples(per_rank: list[dict], world: int, link: LinkSpec) -> list[Sample]:
    """The "tp_layer" samples: per width, half of a tensor-parallel pair's step beyond the
    plain one (each timed across the ranks, `profiler.calibrate._interleaved_times`) and
    beyond the pair's two all-reduces (forward output, backward input gradient, priced by
    the fitted `link` as the plan prices them), over one layer's weight bytes. A pair
    whose collectives ran faster than the link prices them (small ones issued close
    together) gives 0: the link's price stands."""
    out = []
    for width, (weight_bytes, act_bytes, _, _) in per_rank[0].get("tp", {}).items():
        plain = max(r["tp"][width][2] for r in per_rank)
        tp = max(r["tp"][width][3] for r in per_rank)
        beyond = tp - plain - 2 * all_reduce_s(act_bytes, world, link)
        out.append(Sample(collective="tp_layer", ranks=world, nbytes=int(weight_bytes),
                          seconds=max(1e-9, beyond / 2)))
    return out


def tp_layer_fit(samples: list[Sample]) -> CollectiveFit:
    """alpha + (n/P)/beta through the "tp_layer" samples by least squares in absolute
    seconds, both terms non-negative. Absolute, unlike the collectives' relative fit: a
    small pair's figure is a difference of two near-equal times, often ~0, and weighed
    relatively it would pull the line through zero at every size; what a plan misses is
    the milliseconds of the large layers."""
    a, b = COEFFICIENTS["tp_layer"](samples[0].ranks)
    x = np.array([[a, b * s.nbytes] for s in samples])
    y = np.array([s.seconds for s in samples])
    (alpha, slope), *_ = np.linalg.lstsq(x, y, rcond=None)
    if slope <= 0:
        alpha, slope = float(max(0.0, y.mean() / a)), 0.0
    elif alpha < 0:
        alpha, slope = 0.0, float(max(0.0, np.linalg.lstsq(x[:, 1:], y, rcond=None)[0][0]))
    return CollectiveFit(latency_s=float(alpha),
                         bandwidth_bytes_per_s=1.0 / slope if slope > 0 else 1e18)


def _fixed_step(per_rank: list[dict], world: int, link: LinkSpec) -> float:
    """A DDP step less the plain step and its gradient all-reduce (fitted link)."""
    d = {k: max(r["step"][k] for r in per_rank) for k in per_rank[0]["step"]}
    sync = collective_time_s("bucket_all_reduce", d["grad_bytes"], world, link)
    return max(0.0, d["ddp"] - d["plain"] - sync)
