import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serial_lock import lock_base, turn  # noqa: E402


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


# --- tests that time this machine run alone (tests/serial_lock.py) ---------------------------


def pytest_configure(config):
    config.addinivalue_line("markers", "serial: measures this machine; runs while no other "
                                       "test of the suite does (2 xdist workers)")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run_id is None:  # one process: nothing runs beside a test
        return (yield)
    with turn(item.get_closest_marker("serial") is not None, lock_base(run_id)):
        return (yield)
