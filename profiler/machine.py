"""Measure this machine's CPU: achieved matmul FLOP/s and memory bandwidth.

The cost model needs a rate for the local CPU when a plan targets it ("4xcpu"); a catalog
figure would be wrong on any other machine, so it is measured (about a second).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from functools import lru_cache

import torch


@contextmanager
def threads(count: int | None):
    """Run the body with `count` intra-op threads, then restore the previous setting."""
    before = torch.get_num_threads()
    if count:
        torch.set_num_threads(count)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _median_time(fn, repeats: int = 5) -> float:
    fn()  # warm up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def cpu_model() -> str:
    """The CPU's model name ("AMD EPYC 9654 96-Core Processor"), from /proc/cpuinfo where
    Linux has it, else what the platform module says; part of a profile's cache key."""
    import platform

    try:
        with open("/proc/cpuinfo") as info:
            for line in info:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@lru_cache(maxsize=8)
def measure_cpu(thread_count: int | None = None) -> tuple[float, float]:
    """(matmul FLOP/s, copy bandwidth bytes/s) with `thread_count` threads."""
    with threads(thread_count), torch.no_grad():
        n = 512
        a, b = torch.randn(n, n), torch.randn(n, n)
        flops = 2 * n**3 / _median_time(lambda: a @ b)
        # 256 MB: far beyond any cache, as the optimizer's pass over weights is
        src = torch.ones(256 * 2**20 // 4)  # touched: an untouched page reads as the one
        dst = torch.zeros_like(src)  # shared zero page, which sits in cache
        bandwidth = 2 * src.numel() * 4 / _median_time(lambda: dst.copy_(src))
    return flops, bandwidth
