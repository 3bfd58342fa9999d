"""The devices a plan runs on: how many, of which kind, in how many nodes, joined by what.

`strategies.parse.parse_devices` turns what a user types ("8xV100", "2x8xH100", "4xcpu", 8,
a list of torch devices) into a validated `Cluster`; everything downstream takes the Cluster.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strategies import float8
from strategies.devices import DeviceSpec, LinkSpec
from strategies.kernel_levers import Levers
from strategies.precision import Precision, check_supported, default_precision, parse_precision


class Cluster(BaseModel):
    """`nodes` boxes of `devices_per_node` identical devices."""

    model_config = ConfigDict(frozen=True)

    device: DeviceSpec
    nodes: int = Field(1, ge=1)
    devices_per_node: int = Field(ge=1)
    intra_node: LinkSpec
    inter_node: LinkSpec
    # "bf16-mixed", "fp16-mixed" or "fp32" (strategies.precision); None: the device's default
    precision: str | None = None
    # the dtype the FLOP rate is read at, where it is not the precision's compute dtype
    # (e.g. "tfloat32": fp32 training with TF32 matmuls); None: the precision's
    dtype: str | None = None
    # Measured by `hyplan calibrate` (0 / 1 when not calibrated): the fixed cost of running
    # a layer through DTensor's parallel styles (forward + backward), and of one
    # `Reshard` (DTensor redistribute) between layers, beyond the collectives they issue;
    # and how much slower compute runs when processes outnumber this machine's cores.
    dtensor_layer_overhead_s: float = Field(0.0, ge=0)
    dtensor_reshard_overhead_s: float = Field(0.0, ge=0)
    compute_slowdown: float = Field(1.0, gt=0)  # multiplies compute times (a refit sets it)
    memory_slowdown: float = Field(1.0, gt=0)  # the same for memory-bound work
    step_overhead_s: float = Field(0.0, ge=0)  # a distributed step's own fixed cost
    # FSDP2's cost per byte of a sharded layer's weights beyond its collectives (copies
    # into and out of its flat buffers); measured by `hyplan calibrate`, 0 elsewhere
    fsdp_overhead_s_per_byte: float = Field(0.0, ge=0)
    # the cores one node's devices share (CPU processes on one machine); 0: each device
    # computes on its own (GPUs), and compute_slowdown is all there is to it
    cores: int = Field(0, ge=0)
    threads_per_device: int = Field(1, ge=1)
    # GPUs: the compute beside a layer's FSDP gathers and scatters and DDP bucket
    # all-reduces, per second of the layer's own compute (strategies.overlap; set from the
    # graph by planner.price.in_rhythm). None: they run in the step's path (CPU, gloo)
    overlap_cover: float | None = Field(None, ge=1.0)
    # torch.compile, float8 and async TP, priced (strategies.kernel_levers); all off: eager
    levers: Levers = Levers()
    source: str = ""

    @model_validator(mode="after")
    def _dtype_known(self):
        check_supported(self.training_precision, self.device)
        self.device.achievable_flops(self.compute_dtype)  # raises with the known dtypes
        return self

    @property
    def training_precision(self) -> Precision:
        """The precision a plan on this cluster trains in (strategies.precision), its FSDP
        gathers in float8 where the levers ask (strategies.float8)."""
        chosen = (default_precision(self.device) if self.precision is None
                  else parse_precision(self.precision))
        return float8.gathering(chosen, self.levers)

    @property
    def compute_dtype(self) -> str:
        """The dtype whose FLOP rate compute is priced at."""
        return self.dtype or self.training_precision.compute_dtype

    def at_precision(self, precision: "str | Precision | None") -> "Cluster":
        """The same devices training in `precision` (None: as set, else the device's default),
        recorded by name so a plan says what it was priced for."""
        chosen = self.training_precision if precision is None else parse_precision(precision)
        check_supported(chosen, self.device)  # the plain error, not pydantic's wrapping
        if chosen.name == self.precision:
            return self
        return Cluster(**{**self.model_dump(), "precision": chosen.name})

    @property
    def num_devices(self) -> int:
        return self.nodes * self.devices_per_node

    def link(self, group_size: int) -> LinkSpec:
        """The slowest link a ring over `group_size` consecutive devices crosses."""
        return self.intra_node if group_size <= self.devices_per_node else self.inter_node

    def time_sharing(self, computing: float) -> float:
        """How much slower a compute phase runs while `computing` of this node's processes
        compute at once (`time_sharing_slowdown`; the measured `compute_slowdown` where
        the devices do not share cores)."""
        if not self.cores:
            return self.compute_slowdown
        return time_sharing_slowdown(computing, self.devices_per_node, self.threads_per_device,
                                     self.cores, self.compute_slowdown)

    def computing_at_once(self, computing: float) -> "Cluster":
        """This cluster priced for phases in which `computing` of a node's processes
        compute at once (`time_sharing`; memory-bound work at `memory_sharing_slowdown`):
        what a pipeline's stage costs are read from."""
        if not self.cores or computing >= self.devices_per_node:
            return self
        return self.model_copy(update={
            "compute_slowdown": self.time_sharing(computing),
            "memory_slowdown": memory_sharing_slowdown(computing, self.devices_per_node,
                                                       self.memory_slowdown),
            "cores": 0})

    def describe(self) -> str:
        n = f"{self.devices_per_node}x{self.device.name}"
        return n if self.nodes == 1 else f"{self.nodes}x{n}"

    def with_devices(self, nodes: int, devices_per_node: int) -> "Cluster":
        """The same kind of devices and links, in another count (for baselines)."""
        return self.model_copy(update={"nodes": nodes, "devices_per_node": devices_per_node})


def cpu_threads_per_device(num_devices: int) -> int:
    """Intra-op threads each CPU 'device' (process) gets when they share this machine."""
    return max(1, (os.cpu_count() or 1) // num_devices)


def time_sharing_slowdown(computing: float, processes: int, threads: int, cores: int,
                          measured: float) -> float:
    """How much slower a compute phase runs while `computing` processes of `threads` threads
    each compute at once on `cores` cores, given `measured`: the slowdown of all
    `processes` computing at once against one alone (`hyplan calibrate`).

    A process waiting in a collective or for a pipeline stage's input sleeps and holds no
    core. The k computing need k·t cores and get C, so the phase runs share(k) =
    max(1, k·t/C) times slower; beyond that share, sharing costs some more (caches, memory,
    switching): excess = measured / share(P) with all P at once, none with one alone,
    in proportion between: e(k) = 1 + (excess - 1)·min(1, (k-1)/(P-1)). The slowdown is
    share(k)·e(k), at least 1; at k = P it is `measured`, past P it extrapolates. E.g.
    4 processes on 2 cores measured 2.2x: 4 at once 2.2x, 2 at once (a 4-stage pipeline
    with 2 stages busy) 1.03x, one alone 1.0x."""
    share_all = max(1.0, processes * threads / cores)
    excess = measured / share_all
    grow = min(1.0, (computing - 1) / (processes - 1)) if processes > 1 else 1.0
    grow = max(0.0, grow)
    return max(1.0, max(1.0, computing * threads / cores) * (1 + (excess - 1) * grow))


def memory_sharing_slowdown(computing: float, processes: int, measured: float) -> float:
    """How much slower memory-bound work runs while `computing` of `processes` stream at
    once, given `measured` with all of them (`hyplan calibrate`): none alone, the measured
    figure with all, in proportion between (the excess of `time_sharing_slowdown`; memory
    bandwidth is shared by whoever streams, so no core share). A 2-stage pipeline of one
    microbatch streams on one process at a time: priced at the 1.5-1.7x measured with
    both, its MLP and FC-heavy CNN plans came out +31-33% over their measured steps."""
    if processes <= 1:
        return measured
    grow = max(0.0, min(1.0, (computing - 1) / (processes - 1)))
    return max(1.0, 1 + (measured - 1) * grow)
