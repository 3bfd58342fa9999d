"""Fewer passes of Python's cycle collector while hyplan plans: tracing and searching
allocate millions of small objects (fake tensors, fx nodes, per-layer options), and the
collector's default thresholds start a pass every 700 of them, each full pass walking every
object the process holds (a traced model and its graph included).

Building and planning eight models of tests/zoo.py in every plan kind spent 3.0-3.4 s of
its 25.4 s in 1,884 collections here; with this module's threshold inside the planning
entries, 2.4 s in 991 and 23.1 s in all; with it for the whole process, 0.9 s in 20 and
23.4 s (2026-11-29; the test suite sets it so: tests/conftest.py). Garbage is still
collected (reference counting frees all but cycles, and a pass still runs every 50,000
objects), and the caller's thresholds come back when planning ends.
"""

from __future__ import annotations

import contextlib
import gc

# a pass of the youngest generation every this many net allocations while planning
PLANNING_THRESHOLD = 50_000


@contextlib.contextmanager
def fewer_collections():
    """The youngest generation's threshold raised to PLANNING_THRESHOLD (never lowered),
    and the caller's thresholds restored after."""
    before = gc.get_threshold()
    gc.set_threshold(max(before[0], PLANNING_THRESHOLD), *before[1:])
    try:
        yield
    finally:
        gc.set_threshold(*before)


@contextlib.contextmanager
def older_objects_frozen():
    """The objects alive before a search kept out of the collector's full passes while it
    runs (gc.freeze), and given back after. The search allocates millions of small
    objects (a LayerOptions per layer and shape), each few hundred thousand of which start
    a full pass over every object the process holds: with a traced model and its graph in
    memory (DeepSeek-V3: 7,342 layers) those passes took some 15% of its ranking. Where
    something else has frozen objects already (a process that forks workers), nothing is
    changed."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
