import os
import sys
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
