"""A fixed profile of "this machine" for the test suite: what planning for `Nxcpu` reads
from the cache (strategies.profile_cache), so that tests plan through the shipped path
without paying a calibration each (a quick one takes about a minute here) and price with
the same figures on every run. The figures are those of the model hyplan used before
calibration shipped: the gloo loopback link of strategies.devices and processes beyond
the cores time-sharing them. tests/test_profile_cache.py runs the real first-use
calibration."""

import os

from profiler.allocator import POLICY as MEMORY_POLICY
from strategies.calibrated import ClusterProfile
from strategies.profile_cache import machine_key, max_calibrated_processes, profile_path
from strategies.devices import CPU_LINK, DeviceSpec

GB = 1e9


def reference_profile(processes: int) -> ClusterProfile:
    cores = os.cpu_count() or 1
    threads = max(1, cores // processes)
    rate = 40e9 * threads
    device = DeviceSpec(name="cpu", kind="cpu", efficiency=1.0,
                        peak_flops={"float32": rate, "bfloat16": rate / 2, "float16": rate / 4},
                        op_flops={"matmul": rate, "conv2d": rate},
                        memory_bytes=float(os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")),
                        memory_bandwidth_bytes_per_s=10 * GB, cache_bytes=32 * 2**20,
                        source="tests/reference_profile.py")
    counts = [p for p in (2, 4) if p <= max(processes, 2)]
    share = {p: max(1.0, p * threads / cores) for p in counts}
    return ClusterProfile(
        created="2026-01-01T00:00:00+00:00", host="reference", torch_version="test",
        backend="gloo", cores=cores, threads_per_process=threads,
        cpu_model=f"reference ({machine_key(processes)})", quick=True, device=device,
        memory_policy=MEMORY_POLICY,
        links={p: CPU_LINK for p in counts}, compute_slowdown=share, memory_slowdown=share)


def seed_cache() -> None:
    """Write the reference profile where planning for 1..max local processes looks."""
    for processes in range(1, max_calibrated_processes() + 1):
        path = profile_path(processes)
        path.parent.mkdir(parents=True, exist_ok=True)
        reference_profile(processes).save(path)
