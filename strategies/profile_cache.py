"""This machine's calibrated profile, made once and kept: what planning for local devices
(`Nxcpu`, or the CUDA devices of this machine) prices with.

A user who plans for `2xcpu` should get the figures of this machine without knowing that
`hyplan calibrate` exists: without them, predictions ran 15-47% short here. So the first
plan for N local processes runs the quick calibration (under a minute on a 2-core
machine) and keeps the profile in the user's cache directory, keyed by what its figures
depend on: CPU (or GPU) model, core count, torch version, device kind and process count.
Later plans read it in milliseconds; `hyplan calibrate` measures again and replaces it.

    $HYPLAN_CACHE_DIR, else $XDG_CACHE_HOME/hyplan, else ~/.cache/hyplan
        profiles/cpu-amd-epyc-2cores-torch2.13.0-2procs.json

More processes than `max_calibrated_processes()` are priced from the profile of that
many (their compute slowdown by the time-sharing rule, `ClusterProfile.cluster`): four
processes on two cores already show what sharing costs, and measuring 64 would take
minutes.
"""

from __future__ import annotations

import fcntl
import os
import re
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

from profiler.allocator import POLICY as MEMORY_POLICY
from profiler.launch import OtherLoad
from profiler.machine import cpu_model
from strategies.calibrated import ClusterProfile, calibrate, load_profile

CACHE_ENV = "HYPLAN_CACHE_DIR"


def cache_dir() -> Path:
    """Where hyplan keeps what it measured: $HYPLAN_CACHE_DIR, else
    $XDG_CACHE_HOME/hyplan, else ~/.cache/hyplan."""
    override = os.environ.get(CACHE_ENV)
    if override:
        return Path(override).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "hyplan"


def max_calibrated_processes() -> int:
    """The most processes the first-use calibration runs: twice the cores, at least 4."""
    return max(4, 2 * (os.cpu_count() or 1))


def _model_name(kind: str) -> str:
    if kind == "cuda":
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no-gpu"
    return cpu_model()


def machine_key(processes: int, kind: str = "cpu") -> str:
    """The profile's name: every fact its figures depend on, as a file name."""
    import torch

    model = re.sub(r"[^a-z0-9]+", "-", _model_name(kind).lower()).strip("-")[:48] or "unknown"
    return (f"{kind}-{model}-{os.cpu_count() or 1}cores-torch{torch.__version__}-"
            f"{processes}procs").replace("+", "-")


def profile_path(processes: int, kind: str = "cpu") -> Path:
    return cache_dir() / "profiles" / f"{machine_key(processes, kind)}.json"


def _stderr(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


@contextmanager
def _locked(path: Path):
    """Hold an exclusive lock beside `path`: two planners started at once (two shells,
    a test and its subprocess) calibrate once, and the second reads what the first made."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_name(path.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def cached_profile(processes: int, kind: str = "cpu") -> ClusterProfile | None:
    """The cached profile for `processes` local processes, or None if there is none (or
    it cannot be read: an older hyplan's, a torn file; or its CPU ranks ran under another
    memory policy than runs now get, `profiler.allocator.POLICY`: an FSDP2 layer or a
    large all-gather costs up to 2x more where freed pages are faulted in anew)."""
    path = profile_path(min(processes, max_calibrated_processes()), kind)
    try:
        profile = load_profile(path) if path.exists() else None
    except ValueError:
        return None
    if profile is not None and kind == "cpu" and profile.memory_policy != MEMORY_POLICY:
        return None
    return profile


def local_profile(processes: int, kind: str = "cpu", log=_stderr) -> ClusterProfile:
    """This machine's profile for `processes` local processes: from the cache, else made
    now by the quick calibration (once; then cached). `log` hears about a calibration."""
    if processes < 1:
        raise ValueError(f"devices: the process count must be at least 1, got {processes}")
    count = min(processes, max_calibrated_processes())
    found = cached_profile(count, kind)
    if found is not None:
        return found
    path = profile_path(count, kind)
    with _locked(path):
        found = cached_profile(count, kind)  # made meanwhile by another planner
        if found is not None:
            return found
        log(f"hyplan: calibrating this machine for {count} {kind} process"
            f"{'es' if count > 1 else ''} (first use, about a minute); the profile is kept "
            f"in {path} and `hyplan calibrate` refreshes it")
        _calibrate_in_a_fresh_process(count, kind, path)
        profile = load_profile(path)
        log(f"hyplan: calibrated in {profile.seconds:.0f} s")
        if profile.busy:
            log(f"hyplan: other processes used {profile.other_load_cores:.1f} cores meanwhile; "
                f"the profile overprices collectives and DTensor: run `hyplan calibrate` "
                f"when the machine is idle")
    return profile


def _calibrate_in_a_fresh_process(count: int, kind: str, path: Path) -> None:
    """Run the quick calibration in a new interpreter: its ranks are spawned processes,
    which import the parent's __main__, and a user's script that plans at top level
    (no `if __name__ == "__main__":`) must not run again in each of them."""
    # `-c`, not `-m strategies.profile_cache`: the package's __init__ imports this module
    # before runpy runs it as __main__ (a RuntimeWarning in the parent and in every rank,
    # whose spawn re-imports a __main__ that has a file)
    code = "import sys; from strategies.profile_cache import _main; _main(sys.argv[1:])"
    done = subprocess.run([sys.executable, "-c", code, str(count), kind, str(path)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not path.exists():
        tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
        raise RuntimeError(f"calibrating this machine failed ({tail[0]}); run `hyplan "
                           f"calibrate` to see why, or plan with a profile file "
                           f"(--devices 2xFILE.json)")


def _main(argv: list[str]) -> None:
    count, kind, path = int(argv[0]), argv[1], Path(argv[2])
    measured(lambda: calibrate((count,), quick=True, log=lambda *_: None, kind=kind)).save(path)


def measured(make) -> ClusterProfile:
    """`make()`'s profile, with the CPU other processes used meanwhile (its ranks are this
    process's children, so they do not count)."""
    with OtherLoad() as load:
        profile = make()
    return profile.model_copy(update={"other_load_cores": load.cores})


def refresh(processes, quick: bool = False, quiet_wait_s: float = 0.0,
            log=print) -> list[tuple[ClusterProfile, Path]]:
    """Measure this machine again for each count in `processes` and replace the cached
    profiles planning uses (`hyplan calibrate`)."""
    kind = _local_kind(max(processes))
    out = []
    for count in sorted(set(processes)):
        path = profile_path(count, kind)
        with _locked(path):
            profile = measured(lambda: calibrate((count,), quick=quick, log=log,
                                                 quiet_wait_s=quiet_wait_s, kind=kind))
            profile.save(path)
        out.append((profile, path))
    return out


def _local_kind(processes: int) -> str:
    import torch

    return "cuda" if torch.cuda.is_available() and torch.cuda.device_count() >= processes \
        else "cpu"

