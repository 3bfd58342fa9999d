"""Start N local ranks (processes on one process group) and collect their results.

What `hyplan calibrate`, the benchmarks and the multi-process tests use to run real
collectives on this machine: a new interpreter per rank, as torchrun starts them (or, for
tests that check results rather than time, ranks forked from a server that imported torch
once), a rendezvous store the caller holds on a port the OS picked, CUDA hidden for gloo
(gloo and FSDP misbehave when it is visible), `threads` intra-op threads per rank, and the
failing rank's traceback raised.
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


class RanksExited(RuntimeError):
    """Ranks that exited before reporting a result: `ranks`, and each one's exit status
    (negative: the signal that ended it)."""

    def __init__(self, ranks: list[int], statuses: list[int]):
        super().__init__(f"ranks {ranks} exited with status {statuses} before reporting")
        self.ranks, self.statuses = ranks, statuses


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
        # a client of the store the caller holds open (`run_ranks`), on its port
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False)
        dist.init_process_group(backend, rank=rank, world_size=world_size, store=store)
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# What every forked rank imports, loaded once into the fork server (`_context`): a rank
# forked from it starts in ~0.1 s, where a spawned one imports torch itself (2 ranks 3.9 s,
# 4 ranks 8.2 s for an empty function on this 2-core machine; ~100 such launches in the
# tests). torch and hyplan; a caller adds what its ranks import (`run_ranks`'s `preload`:
# the tests add transformers' modeling code, 1.5-2.2 CPU-s a rank here). Importing them
# starts no thread (the server's /proc/self/task is the same before and after), which a
# fork must not inherit; a library's native pools (transformers' tokenizers) start when
# used, in a rank.
PRELOAD = ("torch", "torch.distributed", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint",
           "torch.nn.parallel", "profiler", "strategies", "planner", "executor")


def _context(forked: bool, preload: tuple[str, ...] = ()):
    """The start method ranks are made by: spawn (a new interpreter), or a fork server
    that imported PRELOAD and `preload` (nothing else: no threads, no CUDA context, so the
    forks are clean), started with this process's first forked launch and kept for the
    next (whose `preload` it no longer reads)."""
    if not forked:
        return mp.get_context("spawn")
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(list(PRELOAD) + list(preload))
    return ctx


def run_ranks(fn, world_size: int, *args, backend: str = "gloo", threads: int = 1,
              timeout_s: float = 300.0, forked: bool = False,
              preload: tuple[str, ...] = ()) -> list:
    """[fn(rank, world_size, *args) for each rank], each in its own process, in this
    process's environment: a new interpreter per rank, as torchrun starts them, so what
    the ranks time is what a run gets.

    `forked`: fork the ranks from a server that has already imported torch (`_context`),
    for callers that check results, not time (the tests: a launch in ~0.1 s instead of
    ~4 s). Forked ranks ran compute-heavy steps 8-12% slower than spawned ones here (2
    processes: the MLP's DDP step 312-342 ms forked, 290-311 ms spawned; fc_cnn's tensor
    plan 232-243 against 205-211 ms), and the calibration and the fidelity benchmark had
    measured on them for a stop. `preload`: more modules for the fork server to import
    when this launch starts it (one not installed is skipped). A rank that exits before
    it reports (killed, or dead in native code) raises RanksExited with the exit statuses."""
    ctx = _context(forked, preload)
    results = ctx.Queue()
    # the rendezvous store, held by this process on a port the OS picked and kept bound
    # until the ranks are done: a port found free and handed on (free_port) could be taken
    # meanwhile by another launch (two test workers start ranks at once)
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False)
    port = store.port
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
                    raise RanksExited(dead, [procs[r].exitcode for r in dead]) from None
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
        del store
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


def _self_ticks() -> int:
    """CPU ticks of this process (all its threads), user and system."""
    return sum(int(x) for x in _stat("self")[11:13])


def _cores(ticks: int, seconds: float) -> float:
    return max(0, ticks) / os.sysconf("SC_CLK_TCK") / seconds


class OtherLoad:
    """Context manager: `.cores` is the CPU (in cores, averaged over the block) used by
    processes outside this one and its children (`_own_ticks`); None where /proc is
    missing. Printed beside a timing, it tells a clean figure from one taken on a busy
    machine."""

    cores: float | None = None
    _own = staticmethod(_own_ticks)  # the ticks that are not other processes'

    def __enter__(self):
        try:
            self._start = (_busy_ticks(), self._own(), time.perf_counter())
        except OSError:
            self._start = None
        return self

    def _span(self) -> tuple[int, int, float]:
        """(the machine's busy ticks, own ticks, seconds) since the block began."""
        busy, own, began = self._start
        return _busy_ticks() - busy, self._own() - own, time.perf_counter() - began

    def __exit__(self, *exc):
        if self._start is not None:
            busy, own, seconds = self._span()
            self.cores = _cores(busy - own, seconds)
        return False


class RanksOtherLoad(OtherLoad):
    """OtherLoad entered and left by every rank of the default process group at once: the
    CPU used by processes other than the ranks, the machine's busy ticks less all the
    ranks' own; the same figure on every rank (the largest any rank saw), so that they
    agree on what to do about it."""

    _own = staticmethod(_self_ticks)  # each rank's own; the others' are gathered

    def __exit__(self, *exc):
        if exc[0] is not None or self._start is None:  # no /proc: on no rank
            return False
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, self._span())  # any backend; the same list on all
        ranks_own = sum(own for _, own, _ in seen)
        self.cores = max(_cores(busy - ranks_own, seconds) for busy, _, seconds in seen)
        return False
