import contextlib
import fcntl
import os
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))


@pytest.fixture(scope="session", autouse=True)
def hyplan_cache_dir(tmp_path_factory):
    """Every test (and every process it starts) plans with a cache directory of its own
    session, seeded with the fixed reference profile (tests/reference_profile.py): the
    shipped path (`Nxcpu` reads this machine's cached profile), no calibration per test,
    the same prices on every run, and the user's own cache untouched."""
    from reference_profile import seed_cache

    directory = tmp_path_factory.mktemp("hyplan-cache")
    before = os.environ.get("HYPLAN_CACHE_DIR")
    os.environ["HYPLAN_CACHE_DIR"] = str(directory)
    seed_cache()
    yield directory
    if before is None:
        os.environ.pop("HYPLAN_CACHE_DIR", None)
    else:
        os.environ["HYPLAN_CACHE_DIR"] = before


# --- tests that time this machine run alone ---------------------------------------------------
# The suite runs on 2 pytest-xdist workers (README; most tests start processes, import
# libraries or solve, and leave a core idle part of the time). A test marked `serial`
# measures this machine (a calibration, the load of other processes, layers timed against
# each other): while it runs the other worker runs nothing. A readers-writer lock over
# the workers: every test holds a shared lock for its whole run (setup to teardown); a
# serial one holds it exclusively, and first takes a gate that keeps new tests from
# starting meanwhile (flock gives no turn to a waiting writer otherwise).


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: measures this machine; runs while no other "
                                       "test of the suite does (2 xdist workers)")


@contextlib.contextmanager
def _flock(path: Path, mode: int):
    with open(path, "a") as f:
        fcntl.flock(f, mode)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@contextlib.contextmanager
def _turn(serial: bool, run_id: str):
    base = Path(tempfile.gettempdir()) / f"hyplan-tests-{run_id}"
    gate, held = base.with_suffix(".gate"), base.with_suffix(".lock")
    if serial:
        with _flock(gate, fcntl.LOCK_EX), _flock(held, fcntl.LOCK_EX):
            yield
    else:
        with _flock(gate, fcntl.LOCK_SH):
            pass  # not while a serial test waits for its turn or runs
        with _flock(held, fcntl.LOCK_SH):
            yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside a test
        yield
        return
    with _turn(item.get_closest_marker("serial") is not None, run_id):
        yield
