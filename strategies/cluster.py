"""The devices a plan runs on: how many, of which kind, in how many nodes, joined by what.

`parse_devices` turns what a user types ("8xV100", "2x8xH100", "4xcpu", 8, a list of torch
devices) into a validated `Cluster`; everything downstream takes the Cluster.
"""

from __future__ import annotations

import os
import re
from functools import lru_cache

from pydantic import BaseModel, ConfigDict, Field, model_validator

from strategies.devices import (
    CPU_LINK,
    DEVICES,
    INTER_NODE,
    INTRA_NODE,
    DeviceSpec,
    LinkSpec,
    link_family,
    local_cpu,
)
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
    source: str = ""

    @model_validator(mode="after")
    def _dtype_known(self):
        check_supported(self.training_precision, self.device)
        self.device.achievable_flops(self.compute_dtype)  # raises with the known dtypes
        return self

    @property
    def training_precision(self) -> Precision:
        """The precision a plan on this cluster trains in (strategies.precision)."""
        if self.precision is None:
            return default_precision(self.device)
        return parse_precision(self.precision)

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

    def describe(self) -> str:
        n = f"{self.devices_per_node}x{self.device.name}"
        return n if self.nodes == 1 else f"{self.nodes}x{n}"

    def with_devices(self, nodes: int, devices_per_node: int) -> "Cluster":
        """The same kind of devices and links, in another count (for baselines)."""
        return self.model_copy(update={"nodes": nodes, "devices_per_node": devices_per_node})


_PROFILE = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(.+\.json)\s*$", re.IGNORECASE)
_SPEC = re.compile(r"^\s*(?:(\d+)\s*x\s*)?(?:(\d+)\s*x\s*)?([A-Za-z][\w.\-]*)\s*$")


@lru_cache(maxsize=8)
def _cpu_device(threads: int) -> DeviceSpec:
    return local_cpu(threads)


def cpu_threads_per_device(num_devices: int) -> int:
    """Intra-op threads each CPU 'device' (process) gets when they share this machine."""
    return max(1, (os.cpu_count() or 1) // num_devices)


def cpu_slowdown(processes: int, threads: int) -> float:
    """How much slower each process computes when `processes` x `threads` outnumber this
    machine's cores (all ranks compute at once under data parallelism)."""
    return max(1.0, processes * threads / (os.cpu_count() or 1))


def _named_cluster(count_a: int | None, count_b: int | None, name: str) -> Cluster:
    nodes, per_node = (count_a, count_b) if count_b is not None else (
        1, 1 if count_a is None else count_a)  # "0xV100" is zero devices, not one
    if nodes < 1 or per_node < 1:
        raise ValueError(f"devices: counts must be positive, got {nodes} nodes x {per_node}")
    if name.lower().endswith(".json"):
        from profiler.calibrate import load_profile  # a measured cluster profile

        return load_profile(name).cluster(per_node, nodes)
    if name.lower() == "cpu":
        threads = cpu_threads_per_device(per_node)
        device = _cpu_device(threads)
        slowdown = cpu_slowdown(per_node, threads)
        return Cluster(device=device, nodes=nodes, devices_per_node=per_node,
                       intra_node=CPU_LINK, inter_node=CPU_LINK,
                       compute_slowdown=slowdown, memory_slowdown=slowdown)
    key = next((k for k in DEVICES if k.lower() == name.lower()), None)
    if key is None:
        raise ValueError(
            f"devices: unknown device {name!r}; known: {', '.join(sorted(DEVICES))}, cpu "
            f"(or pass a strategies.Cluster for another device)"
        )
    family = link_family(key)
    return Cluster(device=DEVICES[key], nodes=nodes, devices_per_node=per_node,
                   intra_node=INTRA_NODE[family], inter_node=INTER_NODE[family])


def parse_devices(devices) -> Cluster:
    """Read a device description: "8xV100", "2x8xH100" (nodes x per node), "4xcpu", "H100",
    an int (that many local devices), a list of torch devices, or a Cluster."""
    if isinstance(devices, Cluster):
        return devices
    if isinstance(devices, bool):
        raise ValueError(f"devices: expected a device string, count or Cluster, got {devices!r}")
    if isinstance(devices, int):
        return _local(devices)
    if isinstance(devices, str):
        profile = _PROFILE.match(devices)
        if profile:  # "[COUNTx]path/to/profile.json": a cluster measured by `hyplan calibrate`
            count, path = profile.groups()
            return _named_cluster(int(count) if count else None, None, path)
        match = _SPEC.match(devices)
        if not match:
            raise ValueError(
                f"devices: cannot read {devices!r}; write COUNTxNAME or NODESxCOUNTxNAME, "
                f"e.g. '8xV100', '2x8xH100', '4xcpu'"
            )
        a, b, name = match.groups()
        return _named_cluster(int(a) if a else None, int(b) if b else None, name)
    if isinstance(devices, (list, tuple)):
        import torch

        kinds = {torch.device(d).type for d in devices}
        if len(kinds) != 1:
            raise ValueError(f"devices: all devices must be of one type, got {sorted(kinds)}")
        return _local(len(devices), kinds.pop())
    raise ValueError(
        f"devices: expected a string like '8xV100', an int, a list of torch devices or a "
        f"Cluster, got {type(devices).__name__}"
    )


def _local(count: int, kind: str | None = None) -> Cluster:
    """`count` devices of this machine: its GPUs if it has that many, else CPU processes."""
    import torch

    if count < 1:
        raise ValueError(f"devices: the device count must be at least 1, got {count}")
    if kind in (None, "cuda") and torch.cuda.is_available() and torch.cuda.device_count() >= count:
        name = torch.cuda.get_device_name(0)
        key = next((k for k in ("H200", "H100", "A100-80GB", "A100-40GB", "V100")
                    if k.split("-")[0] in name), None)
        if key is None:
            raise ValueError(f"devices: local GPU {name!r} is not in the catalog; pass a Cluster")
        return _named_cluster(count, None, key)
    if kind == "cuda":
        raise ValueError(f"devices: {count} CUDA devices asked for, this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    return _named_cluster(count, None, "cpu")
