"""Start N local ranks (processes on one process group) and collect their results.

What `hyplan calibrate`, the benchmarks and the multi-process tests use to run real
collectives on this machine: processes forked from a server that imported torch once, a
free port, CUDA hidden for gloo (gloo and FSDP misbehave when it is visible), `threads`
intra-op threads per rank, and the failing rank's traceback raised.
"""

from __future__ import annotations

import faulthandler
import os
import pickle
import queue
import socket
import time
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from profiler.allocator import keep_freed_memory


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(fn, rank, world_size, port, backend, threads, results, args, environ):
    faulthandler.enable()  # a rank that dies in native code prints its Python stack
    # the caller's environment as it is now: a forked rank starts with the fork server's,
    # from whenever this process's first launch started it
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    if backend == "gloo":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    else:
        torch.cuda.set_device(rank)
    torch.set_num_threads(threads)
    if backend == "gloo":
        keep_freed_memory()  # as layer timing does (profiler.allocator)
    try:
        dist.init_process_group(backend, rank=rank, world_size=world_size)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What every rank imports, loaded once into the fork server (`_context`): a rank forked
# from it starts in ~0.1 s, where a spawned one imported torch itself (2 ranks 3.9 s, 4
# ranks 8.2 s for an empty function on this 2-core machine; ~100 such launches in the tests).
# torch and hyplan only: a library with native thread pools of its own (transformers'
# tokenizers, safetensors) is left for each rank to import after the fork
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "torch.nn.parallel", "profiler", "strategies", "planner", "executor")


def _context(preload: tuple[str, ...], fresh: bool = False):
    """The start method ranks are made by: a fork server that imported `preload` (nothing
    else: no threads, no CUDA context, so the forks are clean), started with this
    process's first launch and kept for the next ones (a later `preload` is not read);
    `fresh`: a new interpreter per rank (spawn)."""
    if fresh:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(preload))
    return ctx


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", threads: int = 1,
              timeout_s: float = 300.0, preload: tuple[str, ...] = PRELOAD,
              fresh: bool = False) -> list:
    """[fn(rank, world_size, *args) for each rank], each in its own process, forked
    from a server that has already imported torch (`_context`), in this process's
    environment. `preload`: what that server imports if this call starts it; a process
    that launches once (`hyplan calibrate`) names only what its ranks need, a server's
    imports being one process's work where spawned ranks imported side by side. `fresh`:
    spawn each rank (a new interpreter, ~2 s a rank here) instead, for ranks that live
    long and load much (tests/test_zoo.py runs ~25 Hugging Face models in one launch:
    forked, a rank died of SIGSEGV in 2 of 6 suites, and spawned in none)."""
    ctx = _context(preload, fresh)
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry,
                         args=(fn, r, world_size, port, backend, threads, results, args,
                               dict(os.environ)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    out: dict[int, object] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(out) < world_size:
            try:
                rank, ok, value = results.get(timeout=1.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in out and p.exitcode]
                if dead:  # died before reporting (e.g. killed, or failed to start)
                    raise RuntimeError(f"ranks {dead} exited with status "
                                       f"{[procs[r].exitcode for r in dead]} before "
                                       f"reporting") from None
                if time.monotonic() > deadline:
                    raise RuntimeError(f"ranks {sorted(set(range(world_size)) - set(out))} "
                                       f"gave no result within {timeout_s} s") from None
                continue
            if not ok:
                raise RuntimeError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]


def _busy_ticks() -> int:
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:9]]
    return sum(v) - v[3] - v[4]  # all but idle and iowait


def wait_for_quiet(max_wait_s: float, cores: float = 0.15, window_s: float = 0.5) -> float | None:
    """Wait (up to `max_wait_s`) until this machine is busy with less than `cores` cores
    over `window_s`, the caller being idle meanwhile; returns the last load seen (None
    without /proc). A shared machine's load comes in bursts (others' test suites): timing
    between them avoids measuring under it. Under torch.distributed, call it on one rank
    and then barrier."""
    deadline = time.perf_counter() + max_wait_s
    load = None
    try:
        while True:
            busy = _busy_ticks()
            time.sleep(window_s)
            load = (_busy_ticks() - busy) / os.sysconf("SC_CLK_TCK") / window_s
            if load < cores or time.perf_counter() >= deadline:
                return load
    except OSError:
        return None


def _stat(pid) -> list[str]:
    """The fields of /proc/PID/stat after the command name (state first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def _own_ticks() -> int:
    """CPU ticks of this process, its waited-for children, and its live children with
    theirs: the fork server `run_ranks` starts lives on, and the ranks it forks are its
    children, reaped by it, not by this process."""
    me = os.getpid()
    ticks = sum(int(x) for x in _stat("self")[11:15])  # utime stime cutime cstime
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fields = _stat(entry)
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == me:  # its parent
            ticks += sum(int(x) for x in fields[11:15])
    return ticks


class OtherLoad:
    """Context manager: `.cores` is the CPU (in cores, averaged over the block) used by
    processes outside this one and its children (`_own_ticks`); None where /proc is
    missing. Printed beside a timing, it tells a clean figure from one taken on a busy
    machine."""

    cores: float | None = None

    def __enter__(self):
        try:
            self._start = (_busy_ticks(), _own_ticks(), time.perf_counter())
        except OSError:
            self._start = None
        return self

    def __exit__(self, *exc):
        if self._start is not None:
            busy, own, t = self._start
            ticks = (_busy_ticks() - busy) - (_own_ticks() - own)
            self.cores = max(0, ticks) / os.sysconf("SC_CLK_TCK") / (time.perf_counter() - t)
        return False
