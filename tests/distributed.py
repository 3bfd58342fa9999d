"""Run a function on N gloo ranks (CPU processes) and collect each rank's result: the
launcher every multi-process test uses is hyplan's own (profiler.launch), which starts the
ranks on a free port, hides CUDA (FSDP and gloo misbehave when it is visible), gives each
rank one thread, and raises with the failing rank's traceback. Here its ranks are forked
from its fork server unless a test says otherwise: tests check results, not time, and a
forked launch takes ~0.1 s where spawned ranks take ~4 s. Each rank runs with the cycle
collector's thresholds the suite's processes have (tests/conftest.py)."""

import functools
import warnings

from planner.cycle_collector import fewer_collections
from profiler import launch
from profiler.launch import free_port

__all__ = ["free_port", "run_ranks"]

# what the tests' ranks import beyond torch and hyplan (profiler.launch.PRELOAD), imported
# once by the fork server of each test process, not by every rank: transformers' modeling
# code took 1.5-2.2 CPU-s a rank here (most launches run Hugging Face models)
PRELOAD = ("transformers.modeling_utils",)


def run_ranks(fn, world_size: int, *args, forked: bool = True, **kwargs) -> list:
    """profiler.launch.run_ranks, forked by default. A forked launch whose rank died of a
    signal before reporting runs again with new interpreters, with a warning: forked
    ranks running two dozen Hugging Face models each died of SIGSEGV in 2 of 6 suites
    (2026-11-26) and in 1 of 6 (11-28), never spawned ones, and none of 6 such launches
    in a row on 11-29; a crash of hyplan's own making crashes the spawned run too."""
    ranked = functools.partial(_collecting_less, fn)
    try:
        return launch.run_ranks(ranked, world_size, *args, forked=forked,
                                preload=PRELOAD, **kwargs)
    except launch.RanksExited as error:
        if not forked or not any(status < 0 for status in error.statuses):
            raise
        warnings.warn(f"forked {error}: run again as new interpreters", stacklevel=2)
        return launch.run_ranks(ranked, world_size, *args, forked=False, **kwargs)


def _collecting_less(fn, rank: int, world_size: int, *args):
    with fewer_collections():
        return fn(rank, world_size, *args)
