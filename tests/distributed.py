"""Run a function on N gloo ranks (CPU processes) and collect each rank's result: the
launcher every multi-process test uses is hyplan's own (profiler.launch), which starts the
ranks on a free port, hides CUDA (FSDP and gloo misbehave when it is visible), gives each
rank one thread, and raises with the failing rank's traceback."""

from profiler.launch import free_port, run_ranks

__all__ = ["free_port", "run_ranks"]
