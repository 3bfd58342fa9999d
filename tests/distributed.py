"""Run a function on N gloo ranks (CPU processes) and collect each rank's result.

The one helper every multi-process test uses: it starts the ranks on a free port, hides
CUDA (FSDP and gloo misbehave when it is visible), gives each rank one thread, and raises
with the failing rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


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
        # plain pickle bytes: tensors sent through the queue would share memory with a
        # process that is about to exit
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn, world_size: int, *args, timeout_s: float = 240.0) -> list:
    """[fn(rank, world_size, *args) for each rank], each run in its own process."""
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
                raise AssertionError(f"rank {rank} failed:\n{value}")
            out[rank] = pickle.loads(value)
    except queue.Empty:
        raise AssertionError(f"ranks {sorted(set(range(world_size)) - set(out))} gave no "
                             f"result within {timeout_s} s") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    return [out[r] for r in range(world_size)]
