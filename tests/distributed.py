"""Run a function on N gloo ranks (CPU processes) and collect each rank's result: the
launcher every multi-process test uses is hyplan's own (profiler.launch), which starts the
ranks on a free port, hides CUDA (FSDP and gloo misbehave when it is visible), gives each
rank one thread, and raises with the failing rank's traceback. Here its ranks are forked
from its fork server unless a test says otherwise: tests check results, not time, and a
forked launch takes ~0.1 s where spawned ranks take ~4 s."""

from profiler import launch
from profiler.launch import free_port

__all__ = ["free_port", "run_ranks"]


def run_ranks(fn, world_size: int, *args, forked: bool = True, **kwargs) -> list:
    """profiler.launch.run_ranks, forked by default."""
    return launch.run_ranks(fn, world_size, *args, forked=forked, **kwargs)
