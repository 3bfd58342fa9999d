"""Keep freed CPU memory in the process instead of handing it back to the kernel.

glibc's malloc serves big blocks (over its mmap threshold, at most 32 MB) with fresh
mmap()s and returns them on free(). A training step frees its gradients
(`zero_grad(set_to_none=True)`, the default) and its activations, and the next step asks
for the same sizes again: every page of them is faulted in and zeroed anew. Measured on 2
gloo processes here: the MLP's tensor plan took 76 ms a step that way and 54 ms with the
memory kept, the FC-heavy CNN's hybrid 154 ms and 90 ms. A GPU's caching allocator keeps
its blocks the same way, and PyTorch's CPU performance guide recommends jemalloc or
tcmalloc for the same reason; `mallopt` does it without preloading another allocator.

Threads are the other half. glibc gives each thread that allocates its own arena, whose
heaps are mmap()ed 64 MB at a time and given back as they empty, and gloo's worker threads
allocate a collective's scratch there: with the main heap kept and the arenas not, a
67 MB FSDP2 layer on 2 gloo processes still faults ~32k pages (128 MB) a step, a 64 MB
all-gather 17k pages a call; with one arena for every thread, none after the first steps.
Pages faulted in anew make a step's time depend on the process's history and the host's
load, so a price measured under them does not repeat (the figures:
benchmarks/results/HISTORY.md, "Calibration choices").

Layer timing (profiler.profile), the ranks hyplan starts (profiler.launch), `hyplan train`
before its process group starts gloo's threads, and every CPU run (executor.parallelize)
call `keep_freed_memory()`, so what the cost model was measured under is what a run gets;
a calibrated profile records the policy it was measured under (`POLICY`) and one measured
under another is measured again (strategies.profile_cache).
"""

from __future__ import annotations

import ctypes
import ctypes.util
from functools import lru_cache

M_TRIM_THRESHOLD, M_MMAP_MAX, M_ARENA_MAX = -1, -4, -8
# what a calibrated profile's figures were measured under: "heap" kept the main heap only
# (profiles without a policy); "one-heap" also serves every thread from it
POLICY = "one-heap"


@lru_cache(maxsize=1)
def keep_freed_memory() -> bool:
    """Serve every block from the one main heap (no per-block mmap, no per-thread arena)
    and never trim its top: freed memory stays mapped and is reused. True where it took
    effect (glibc), False on other C libraries, where it does nothing. Call it before
    threads start allocating (before `init_process_group` starts gloo's): a thread keeps
    the arena it already has."""
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return (bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TRIM_THRESHOLD, 2**31 - 1))
            and bool(mallopt(M_ARENA_MAX, 1)))
