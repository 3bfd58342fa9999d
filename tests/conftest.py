import gc
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

from serial_lock import lock_base, turn  # noqa: E402

# The cycle collector as hyplan plans (planner.cycle_collector), for the whole of each test
# process: the suite traces, plans and runs models, allocating as planning does; with the
# default thresholds the collector took ~13% of planning the zoo's models here. The figure
# is planner.cycle_collector.PLANNING_THRESHOLD's, written out: importing planner here
# would load torch into pytest's controller process, which runs no test.
gc.set_threshold(50_000, *gc.get_threshold()[1:])

# Bytecode kept, even where the environment says not to (PYTHONDONTWRITEBYTECODE=1 on this
# machine): the suite starts ~40 interpreters (2 xdist workers, spawned ranks, torchrun's
# workers, CLI runs) that import the same ~30,000 lines of hyplan and its tests; each
# compiled them all again, ~1.2 s an interpreter here (importing planner, executor and the
# CLI: 6.7-7.2 s without bytecode, 5.3-5.9 s with), and a worker's collection took 14.6 s
# against 11.2 s. Set in pytest's controller before it starts the workers, so every process
# of the run inherits it; the files go to __pycache__ folders, which git ignores.
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

# One intra-op thread per test process, as each rank has (profiler.launch): 2 xdist workers
# on 2 cores each with torch's default of a thread per core oversubscribed the machine,
# and an OpenMP thread spins for a while before it sleeps. Inherited, like the line above.
os.environ.setdefault("OMP_NUM_THREADS", "1")


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


# --- the slowest files first, so the 2 xdist workers end together -----------------------------

# Seconds each file took on this 2-core machine (`pytest -n 2 --dist loadfile`, each test's
# wall time summed per file, 2026-11-29: 1,181 s in all, the suite 641 s); files not listed
# take under 15 s. xdist hands out files in collection order (`--no-loadscope-reorder` in
# pyproject.toml), so the longest go first and the short ones fill in at the end
# (longest-processing-time-first scheduling): the two workers ended 8 s apart. Without it
# test_zoo.py, last in the alphabet, ran alone for its last two minutes. (It runs
# tests/test_experts.py's and test_moe_pricing.py's multi-rank jobs in its own launches.)
SLOW_FILES = {
    "test_zoo.py": 290, "test_train_cli.py": 70, "test_pipeline_search.py": 70,
    "test_context_parallel.py": 75, "test_torchvision.py": 53, "test_small_batch_plans.py": 36,
    "test_repeat_blocks.py": 35, "test_hf_pipeline.py": 34, "test_stage_dp.py": 33,
    "test_hf_fsdp.py": 24, "test_search_budget.py": 24, "test_calibrate.py": 22,
    "test_plot.py": 21, "test_export_timing.py": 20, "test_cli.py": 19, "test_launch.py": 18,
    "test_ilp.py": 17, "test_closed_loop.py": 17, "test_profile_cache.py": 16,
    "test_pipeline_equivalence.py": 15,
}


def pytest_collection_modifyitems(config, items):
    """Order the files by SLOW_FILES, slowest first; a stable sort keeps each file's own order."""
    items.sort(key=lambda item: -SLOW_FILES.get(item.path.name, 0))
