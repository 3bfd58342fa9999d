"""Run a function on N gloo ranks (CPU processes on this machine) and collect the results.

The benchmarks' launcher, the same approach as tests/distributed.py: spawned processes on a
free port, CUDA hidden, one intra-op thread per rank, the failing rank's traceback raised.
`OtherLoad` says how much CPU other processes took during a run, so a timing taken on a
shared machine can be told apart from a clean one.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class OtherLoad:
    """Context manager: `.cores` is the CPU (in cores, averaged over the block) used by
    processes outside this one and its waited-for children; None where /proc is missing."""

    cores: float | None = None

    @staticmethod
    def _busy() -> int:
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:9]]
        return sum(v) - v[3] - v[4]  # all but idle and iowait (steal included)

    @staticmethod
    def _own() -> int:
        with open("/proc/self/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return sum(int(x) for x in fields[11:15])  # utime stime cutime cstime

    def __enter__(self):
        try:
            self._start = (self._busy(), self._own(), time.perf_counter())
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            busy, own, t = self._start
            ticks = (self._busy() - busy) - (self._own() - own)
            self.cores = max(0, ticks) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t)
        return False


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, results, args):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), CUDA_VISIBLE_DEVICES="")
    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """[fn(rank, world_size, *args) for each rank], each run in its own spawned process."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, port, results, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    try:
        while len(out) < world_size:
            rank, ok, value = results.get(timeout=timeout_s)
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    except queue.Empty:
        raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(out))} gave no "
                           f"result within {timeout_s} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
