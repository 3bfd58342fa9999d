"""Accelerators and links the cost model knows, with where each figure comes from.

Peak rates are datasheet figures; `efficiency` is the fraction of peak that dense matmul and
convolution reach in practice, so `achievable_flops` is what the cost model divides FLOPs by.
A GPU with a `GPUShape` (A100, H100, H200) is priced by shape instead
(strategies.gpu_compute): GEMM tiles and waves over its SMs against a measured matmul
ceiling, memory-bound ops at measured memory bandwidth, attention at FlashAttention's
measured rate, a kernel-launch floor. Link bandwidths are per device, one direction, as a
ring collective sees them ("bus bandwidth" in nccl-tests' terms), from published
nccl-tests figures.
"""

from __future__ import annotations

import glob
import os
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

GB = 1e9
GiB = 2**30
TFLOPS = 1e12


class GPUShape(BaseModel):
    """What pricing a GPU op by its shape needs, each figure from a datasheet or a published
    measurement (the catalog below names which)."""

    model_config = ConfigDict(frozen=True)

    sm_count: int = Field(gt=0, description="streaming multiprocessors (datasheet)")
    # the output tile one SM computes at a time: 128 x 256 is the large-GEMM tile of
    # cuBLAS / CUTLASS on Ampere and Hopper (NVIDIA, "Matrix Multiplication Background
    # User's Guide", tile and wave quantization, which works its examples with it)
    tile_m: int = 128
    tile_n: int = 256
    matmul_fraction: float = Field(gt=0, le=1, description="best measured GEMM rate / peak")
    attention_fraction: float = Field(gt=0, le=1, description="flash attention fwd+bwd / peak")
    memory_fraction: float = Field(gt=0, le=1, description="best measured copy bandwidth / peak")
    launch_s: float = Field(ge=0, description="the least time one kernel costs, launch included")
    elementwise_fraction: float = Field(
        1.0, gt=0, le=1, description="eager elementwise / reduction kernels' bandwidth as a "
        "share of the best copy's")
    unaligned_fraction: float = Field(
        1.0, gt=0, le=1, description="a half-precision GEMM with a dim not a multiple of 8: "
        "its rate as a share of the aligned ceiling")
    source: str = ""


class DeviceSpec(BaseModel):
    """One device: compute rate per dtype, memory size and memory bandwidth."""

    model_config = ConfigDict(frozen=True)

    name: str
    peak_flops: dict[str, float] = Field(description="peak FLOP/s per dtype name")
    efficiency: float = Field(0.6, gt=0, le=1, description="fraction of peak dense ops reach")
    memory_bytes: float = Field(gt=0)
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    kind: str = "cuda"  # the torch device type that runs it
    source: str = ""
    # achieved FLOP/s per op class ("matmul", "conv2d"), where measured (hyplan calibrate)
    op_flops: dict[str, float] = Field(default_factory=dict)
    # the last-level cache the processes on one machine share (0: unknown). Memory-bound
    # work slows down when processes share the machine only once what they stream
    # together spills it (measured here: 1-8 MB copies no slower on 2 processes at once,
    # 64-256 MB copies 1.8-2.0x slower)
    cache_bytes: float = Field(0.0, ge=0)
    # priced by shape where known (strategies.gpu_compute); None: peak x efficiency
    shape: GPUShape | None = None

    def achievable_flops(self, dtype: str = "float32") -> float:
        if dtype not in self.peak_flops:
            raise ValueError(
                f"device {self.name} has no FLOP rate for dtype {dtype!r}; "
                f"known: {sorted(self.peak_flops)}"
            )
        return self.peak_flops[dtype] * self.efficiency


class Regime(BaseModel):
    """alpha and beta for the messages of more than `above_bytes` (the global tensor): where
    a collective's bandwidth changes with size (gloo past the shared cache; NCCL's
    protocols), each size range gets its own pair."""

    model_config = ConfigDict(frozen=True)

    above_bytes: float = Field(ge=0)
    # may be negative: the line of a range that starts at above_bytes, where time grows
    # faster than the smaller messages' line (strategies.calibrated._two_lines)
    latency_s: float
    bandwidth_bytes_per_s: float = Field(gt=0)


class CollectiveFit(BaseModel):
    """One collective's own alpha (latency per message) and beta (bandwidth per rank), as
    `hyplan calibrate` fits them: a library may implement a collective unlike its ring
    model (gloo's reduce-scatter is an all-reduce), so each gets its own pair. `regimes`
    (ascending `above_bytes`) replace the pair for larger messages."""

    model_config = ConfigDict(frozen=True)

    latency_s: float = Field(ge=0)
    bandwidth_bytes_per_s: float = Field(gt=0)
    regimes: tuple[Regime, ...] = ()

    def alpha_beta(self, nbytes: float = 0.0) -> tuple[float, float]:
        """(latency, bandwidth) for a message of `nbytes` (the global tensor)."""
        alpha, beta = self.latency_s, self.bandwidth_bytes_per_s
        for regime in self.regimes:
            if nbytes > regime.above_bytes:
                alpha, beta = regime.latency_s, regime.bandwidth_bytes_per_s
        return alpha, beta


class GapCurve(BaseModel):
    """What a small blocking collective (a 16 KB all-reduce) costs a step against how much
    compute the ranks ran since the previous one: `seconds[i]` after `gaps_s[i]`
    (ascending), measured by `hyplan calibrate` in rows of calls at one gap (a gloo process
    that computed longer pays more to wake into the collective; idle 2-core VM: 0.23 /
    1.00 / 2.38 / 3.76 ms after 0 / 0.5 / 2 / 8 ms, benchmarks/collective_gap.py)."""

    model_config = ConfigDict(frozen=True)

    gaps_s: tuple[float, ...]
    seconds: tuple[float, ...]
    # the compute the link's fitted collectives were timed behind (profiler.calibrate's
    # BURST_S): the curve prices a gap relative to it (strategies.collectives)
    fits_gap_s: float = 6e-3

    def seconds_at(self, gap_s: float) -> float:
        """The curve's all-reduce after `gap_s` of compute: interpolated between the
        measured gaps, the nearest end's figure outside them."""
        return float(np.interp(gap_s, self.gaps_s, self.seconds))


class LinkSpec(BaseModel):
    """A link between devices: bandwidth per device (one direction) and latency per message.

    `collectives` holds measured per-collective figures (from `hyplan calibrate`); a
    collective without one uses the link's own bandwidth and latency. `gap_curve` (gloo,
    measured) and `blocking_gap_s` (the compute between two blocking collectives of the
    plans being priced, set by planner.price.in_rhythm) price blocking collectives at the
    rhythm a plan issues them (strategies.collectives.collective_time_s)."""

    model_config = ConfigDict(frozen=True)

    name: str
    bandwidth_bytes_per_s: float = Field(gt=0)
    latency_s: float = Field(ge=0)
    source: str = ""
    collectives: dict[str, CollectiveFit] = Field(default_factory=dict)
    gap_curve: GapCurve | None = None  # None (catalog links, older profiles): the fits alone
    blocking_gap_s: float | None = None  # None: blocking collectives at their fits

    def alpha_beta(self, collective: str, nbytes: float = 0.0) -> tuple[float, float]:
        """(latency per message, bandwidth per rank) the cost of `collective` over a
        message of `nbytes` (the global tensor) uses."""
        fit = self.collectives.get(collective)
        if fit is None:
            return self.latency_s, self.bandwidth_bytes_per_s
        return fit.alpha_beta(nbytes)


def _gpu(name, fp32, fp16, bf16, mem_gib, bw_gbs, source, efficiency=0.6, tf32=None,
         shape=None, fp8=None):
    flops = {"float32": fp32 * TFLOPS, "float16": fp16 * TFLOPS}
    if bf16:
        flops["bfloat16"] = bf16 * TFLOPS
    if tf32:
        flops["tfloat32"] = tf32 * TFLOPS
    if fp8:
        flops["float8"] = fp8 * TFLOPS
    return DeviceSpec(
        name=name,
        peak_flops=flops,
        efficiency=efficiency,
        memory_bytes=mem_gib * GiB,
        memory_bandwidth_bytes_per_s=bw_gbs * GB,
        source=source,
        shape=shape,
    )


# Kernel-launch floor: a CUDA launch costs a few microseconds ("Getting Started with CUDA
# Graphs", NVIDIA technical blog, 2019, measures 3.8 us per launched kernel back to back)
# and PyTorch's eager dispatch adds its own; 5 us per kernel.
LAUNCH_S = 5e-6
# Memory-bound kernels reach ~90% of HBM's datasheet bandwidth at best: 1.80 of 2.04 TB/s
# on an A100 80GB measured with Nsight Compute at 88%, and "the maximum memory bandwidth
# achieved by any kernel was around 90%" (NVIDIA developer forums, "Trouble to reach peak
# bandwidth of A100", 2025, citing a GTC 2025 talk).
MEMORY_FRACTION = 0.9
# Maximum achievable matmul FLOPS (MAMF), bf16, best shape found by a sweep: A100 SXM
# 267.9 of 312 TFLOP/s (85.9%), H100 SXM 792.1 of 989 (80.1%), GH200 821.0 of 989 (83.0%)
# (S. Bekman, "Machine Learning Engineering", compute/accelerator/README.md, MAMF table,
# CUDA 12.1 / 12.5). Applied to fp16 and fp32 alike, for want of a measurement.
# Attention: torch's flash backend is FlashAttention-2, which reaches 50-73% of peak on
# A100 (Dao 2023, arXiv 2307.08691, abstract; 0.6 taken) and "only 35% utilization on
# H100" (Shah et al. 2024, FlashAttention-3, arXiv 2407.08608, abstract).
# Measured on a lent H100 SXM (benchmarks/gpu_lent.py, 2026-11-26, torch 2.11, CUDA 13;
# benchmarks/results/gpu-h100.txt): the eager memory-bound kernels of a bf16-mixed training
# step stream at ~0.68 of the best copy's bandwidth (copy 3.01 TB/s): a 953 M Llama's took
# 91.0 ms for the 179 GB profiler.traffic counts (1.97 TB/s, 0.65), GPT-2 small's 70 ms
# (79.0 less its loss) for 149 GB (2.12 TB/s, 0.70); one kernel alone reaches 0.76-0.97
# (mixed dtypes, broadcasts and strided copies are the slow ones). A bf16 GEMM with a dim
# of 50257 (GPT-2's vocabulary; not a multiple of 8) fell back to CUTLASS's align1
# kernels: 3.8 TFLOP in 30.7 ms, 123 TFLOP/s, 0.156 of the aligned 790.
ELEMENTWISE_FRACTION = 0.68
UNALIGNED_FRACTION = 0.156
A100_SHAPE = GPUShape(
    sm_count=108, matmul_fraction=267.9 / 312, attention_fraction=0.6,
    memory_fraction=MEMORY_FRACTION, launch_s=LAUNCH_S,
    elementwise_fraction=ELEMENTWISE_FRACTION, unaligned_fraction=UNALIGNED_FRACTION,
    source="108 SMs (A100 datasheet); MAMF 267.9/312 (Bekman); FA2 0.6 (Dao 2023); "
           "elementwise and unaligned GEMM shares as measured on an H100")
H100_SHAPE = GPUShape(
    sm_count=132, matmul_fraction=792.1 / 989, attention_fraction=0.35,
    memory_fraction=MEMORY_FRACTION, launch_s=LAUNCH_S,
    elementwise_fraction=ELEMENTWISE_FRACTION, unaligned_fraction=UNALIGNED_FRACTION,
    source="132 SMs (H100 SXM5 datasheet); MAMF 792.1/989 (Bekman); FA2 0.35 (Shah 2024); "
           "elementwise 0.68 of copy, unaligned GEMMs 0.156 (measured, gpu_lent.py)")
H200_SHAPE = H100_SHAPE.model_copy(update={
    "matmul_fraction": 821.0 / 989,
    "source": "132 SMs (H200 datasheet); MAMF 821.0/989 of GH200, same die and HBM3e "
              "(Bekman); FA2 0.35 (Shah 2024)"})

# float8 (strategies.float8). H100 SXM5 FP8 tensor cores: 1,979 TFLOP/s dense (datasheet,
# 3,958 with sparsity), twice bf16's 989; H200 the same die. A float8 GEMM is priced at
# the bf16 GEMM's measured share of its own peak: "the gemm speedup approaching 2x as M, K,
# N increase" (torchao, torchao/float8/README.md, "Performance": its H100 microbenchmark,
# 1.39x for a whole 4096 x 8192 x 16384 Linear with its casts).
H100_FLOAT8_TFLOPS = 1979
# Casting one operand element to float8, compiled (torchao relies on torch.compile for
# it: "enable torch.compile to generate fused kernels for float8 scaling and casting"):
# an amax pass reads 2 bytes, a cast reads 2 and writes both orientations (1 + 1).
FLOAT8_CAST_BYTES = 6
# Eager, the absolute value is a kernel of its own (read 2, write 2) before the max.
FLOAT8_EAGER_CAST_BYTES = 10
# A rowwise-scaled float8 GEMM's rate as a share of a tensorwise one's, taken from
# torchtitan's own comparison on Llama 3 8B, 8 H100, compiled (pytorch/torchtitan commit
# 7a04053, Jan 2025): bf16 5,760, rowwise 6,424 (+11.5%), tensorwise with float8
# all-gather 7,186 tokens/s (+24.8%) per GPU; the share that puts hyplan's rowwise price
# the same distance below its tensorwise price (benchmarks/titan_levers.py prints both).
FLOAT8_ROWWISE_GEMM_SHARE = 0.8

DEVICES: dict[str, DeviceSpec] = {
    # Krizhevsky (2014) assumes 2 TFLOP/s achieved on a K20 (footnote 3): 2/3.52 of peak.
    "K20": _gpu("K20", 3.52, 3.52, None, 5, 208, "NVIDIA Tesla K20 datasheet", 2.0 / 3.52),
    # One GK210 die of a K80 board (the board holds two).
    "K80": _gpu("K80", 4.37, 4.37, None, 12, 240, "NVIDIA Tesla K80 datasheet (per GPU)"),
    "V100": _gpu("V100", 15.7, 125, None, 16, 900, "NVIDIA V100 SXM2 datasheet"),
    "V100-32GB": _gpu("V100-32GB", 15.7, 125, None, 32, 900, "NVIDIA V100 SXM2 datasheet"),
    "A100-40GB": _gpu(
        "A100-40GB", 19.5, 312, 312, 40, 1555, "NVIDIA A100 SXM4 datasheet", tf32=156,
        shape=A100_SHAPE),
    "A100-80GB": _gpu(
        "A100-80GB", 19.5, 312, 312, 80, 2039, "NVIDIA A100 SXM4 datasheet", tf32=156,
        shape=A100_SHAPE),
    "H100": _gpu("H100", 67, 989, 989, 80, 3350, "NVIDIA H100 SXM5 datasheet (dense)", tf32=494,
                 shape=H100_SHAPE, fp8=H100_FLOAT8_TFLOPS),
    # Meta's Grand Teton H100 (torchtitan's benchmarks): 96 GB HBM2e at 2.4 TB/s, run at a
    # 500 W power limit. Its peak lies "between SXM and NVL" (torchtitan,
    # benchmarks/llama3_h100_202412_torchtitan.md, footnote 2) and is not published: the
    # SXM5 rates are an upper bound, as torchtitan itself uses them.
    "H100-96GB": _gpu("H100-96GB", 67, 989, 989, 96, 2400, "torchtitan Grand Teton H100 "
                      "(HBM2e, 500 W); SXM5 peak rates as an upper bound", tf32=494,
                      shape=H100_SHAPE, fp8=H100_FLOAT8_TFLOPS),
    "H200": _gpu("H200", 67, 989, 989, 141, 4800, "NVIDIA H200 SXM datasheet (dense)", tf32=494,
                 shape=H200_SHAPE, fp8=H100_FLOAT8_TFLOPS),
}
DEVICES["A100"] = DEVICES["A100-80GB"]

# Links inside one box and between boxes, per device family.
INTRA_NODE: dict[str, LinkSpec] = {
    # Krizhevsky (2014): PCIe 2.0 switches, "about 6 GB/s" between GPUs of a group.
    "K20": LinkSpec(name="PCIe 2.0", bandwidth_bytes_per_s=6 * GB, latency_s=10e-6,
                    source="Krizhevsky 2014, section 5"),
    "K80": LinkSpec(name="PCIe 3.0", bandwidth_bytes_per_s=10 * GB, latency_s=10e-6,
                    source="PCIe 3.0 x16 achieved copy bandwidth"),
    # DGX-1 hybrid cube mesh: nccl-tests all-reduce bus bandwidth about 130 GB/s.
    "V100": LinkSpec(name="NVLink 2", bandwidth_bytes_per_s=130 * GB, latency_s=10e-6,
                     source="NVIDIA DGX-1 V100 whitepaper; nccl-tests busbw"),
    # 8x A100 SXM, NVLink 3 through NVSwitch, 300 GB/s per direction: nccl-tests
    # all_reduce_perf busbw ~200 GB/s (NVIDIA/nccl-tests issue 149, HPE 8x A100 80GB, NCCL
    # 2.18) and 208 GB/s (issue 178).
    "A100": LinkSpec(name="NVLink 3", bandwidth_bytes_per_s=205 * GB, latency_s=8e-6,
                     source="nccl-tests busbw 200-208 GB/s (NVIDIA/nccl-tests #149, #178)"),
    # 8x H100 SXM, NVLink 4, 450 GB/s line rate: NCCL reaches ~370 GB/s busbw on ring
    # collectives (all-gather, reduce-scatter; ~20% protocol overhead), and all-reduce
    # with NVLink SHARP (NVLS, NCCL's default there) peaks at ~480 GB/s busbw on 8 GPUs
    # (S. Jeaugey, NVIDIA, NVIDIA/nccl-tests issue 212, 2024-05-06; 476 GB/s measured in
    # issue 290).
    "H100": LinkSpec(name="NVLink 4", bandwidth_bytes_per_s=370 * GB, latency_s=6e-6,
                     source="nccl-tests busbw: 370 GB/s ring, 480 GB/s all-reduce with "
                            "NVLS (NVIDIA/nccl-tests #212)",
                     collectives={name: CollectiveFit(latency_s=6e-6,
                                                      bandwidth_bytes_per_s=480 * GB)
                                  for name in ("all_reduce", "bucket_all_reduce")}),
}
INTER_NODE: dict[str, LinkSpec] = {
    "K20": LinkSpec(name="10 GbE", bandwidth_bytes_per_s=1.25 * GB, latency_s=30e-6,
                    source="10 Gigabit Ethernet line rate"),
    "K80": LinkSpec(name="10 GbE", bandwidth_bytes_per_s=1.25 * GB, latency_s=30e-6,
                    source="10 Gigabit Ethernet line rate"),
    # DGX-1: 4x EDR InfiniBand (100 Gb/s) for 8 GPUs.
    "V100": LinkSpec(name="EDR InfiniBand", bandwidth_bytes_per_s=6.25 * GB, latency_s=5e-6,
                     source="DGX-1: 4x 100 Gb/s EDR per 8 GPUs"),
    # DGX A100: 8x HDR InfiniBand (200 Gb/s = 25 GB/s), one per GPU; NCCL's share of the
    # line rate taken as NDR's below (46-48 of 50): 23 GB/s per GPU.
    "A100": LinkSpec(name="HDR InfiniBand", bandwidth_bytes_per_s=23 * GB, latency_s=5e-6,
                     source="DGX A100: 8x 200 Gb/s HDR, one per GPU; NCCL at 93% of line "
                            "rate as on NDR"),
    # DGX H100: 8x NDR InfiniBand (400 Gb/s), one per GPU: "for NDR @ 400Gbps you should
    # see 46-48GB/s per NIC" in nccl-tests (D. Addison, NVIDIA, NVIDIA/nccl-tests issue
    # 290, 2025-03-03).
    "H100": LinkSpec(name="NDR InfiniBand", bandwidth_bytes_per_s=46 * GB, latency_s=5e-6,
                     source="nccl-tests busbw 46-48 GB/s per NDR NIC (NVIDIA/nccl-tests "
                            "#290)"),
}


def link_family(device_name: str) -> str:
    """The key of a device's links: 'A100-80GB' → 'A100', 'H200' → 'H100' (same NVLink 4)."""
    base = device_name.split("-")[0].upper()
    return {"H200": "H100", "CPU": "cpu"}.get(base, base)


def local_cpu(threads: int | None = None) -> DeviceSpec:
    """This machine's CPU as one device, from a short matmul measurement.

    The figure is measured, not looked up: a CPU's rate depends on its cores, vector units
    and the threads each process gets. `threads` is the intra-op threads per device.
    """
    from profiler.machine import measure_cpu  # local import: measuring costs a second

    flops, bandwidth = measure_cpu(threads)
    pages = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    return DeviceSpec(
        name="cpu",
        kind="cpu",
        peak_flops={"float32": flops, "bfloat16": flops / 2, "float16": flops / 4},
        efficiency=1.0,  # measured: the rate is already achieved, not peak
        memory_bytes=float(pages),
        memory_bandwidth_bytes_per_s=bandwidth,
        source=f"measured on this machine ({threads or 'default'} threads)",
        cache_bytes=shared_cache_bytes(),
    )


def shared_cache_bytes() -> float:
    """This machine's largest CPU cache (the shared last level), from sysfs; 0 if unknown."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            text = Path(path).read_text().strip().upper()
        except OSError:
            continue
        unit = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            sizes.append(int(digits) * unit)
    return float(max(sizes, default=0))


# gloo over loopback TCP between processes on one machine, measured on the 2-core
# development machine (2026-11-22, 2 processes): all-reduce of 1 KB 1.1 ms (two ring
# steps, so about 0.5 ms a message), of 16-64 MB 1.2-1.4 GB/s bus bandwidth.
CPU_LINK = LinkSpec(name="gloo loopback", bandwidth_bytes_per_s=1.2 * GB, latency_s=0.5e-3,
                    source="measured: gloo all-reduce over loopback, 2 processes")
