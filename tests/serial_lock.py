"""Tests that time this machine run alone while the suite runs on 2 pytest-xdist workers.

Most tests start processes, import libraries or solve, and leave a core idle part of the
time, so two workers finish the suite sooner. A test marked `serial` measures this
machine (a calibration, the load of other processes, layers timed against each other):
while it runs, the other worker runs nothing. A readers-writer lock over the workers:
every test holds a shared `flock` for its whole run (setup to teardown); a serial one
holds it exclusively, and first takes a gate that keeps new tests from starting meanwhile
(flock gives a waiting writer no turn otherwise: the other worker's next test would take
the shared lock again). tests/conftest.py wraps each test in `turn`.
"""

from __future__ import annotations

import contextlib
import fcntl
import tempfile
from pathlib import Path


def lock_base(run_id: str) -> Path:
    """The lock files' path, less their suffixes, shared by one run's workers."""
    return Path(tempfile.gettempdir()) / f"hyplan-tests-{run_id}"


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def turn(serial: bool, base: Path):
    """Held while a test runs: alone if `serial`, else beside other tests that are not."""
    gate, held = base.with_suffix(".gate"), base.with_suffix(".lock")
    if serial:
        with _flock(gate, fcntl.LOCK_EX), _flock(held, fcntl.LOCK_EX):
            yield
    else:
        with _flock(gate, fcntl.LOCK_SH):
            pass  # not while a serial test waits for its turn or runs
        with _flock(held, fcntl.LOCK_SH):
            yield
