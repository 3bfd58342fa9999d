"""Calibration as shipped: planning for this machine measures it once, on first use, keeps
the profile per machine in the user's cache directory, reads it afterwards, and
`hyplan calibrate` replaces it; explain() says which profile priced a plan."""

import os
import re
import time

import pytest
import torch

import models
import planner
from planner.cli import main
from profiler.allocator import POLICY as MEMORY_POLICY
from profiler.machine import cpu_model
from strategies.calibrated import load_profile
from strategies.profile_cache import cache_dir, machine_key, profile_path
from strategies import parse_devices


@pytest.fixture
def fresh_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HYPLAN_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_the_cache_is_keyed_by_the_facts_its_figures_depend_on(tmp_path, monkeypatch):
    key = machine_key(2)
    model = cpu_model().lower()
    assert key.startswith("cpu-") and f"{os.cpu_count()}cores" in key
    assert f"torch{torch.__version__}".replace("+", "-") in key and key.endswith("-2procs")
    # e.g. "amd", "intel" ("Intel(R) Xeon(R)" is spelled intel-r-xeon-r in a file name)
    assert re.sub(r"[^a-z0-9]+", "-", model.split()[0]).strip("-") in key
    assert machine_key(4) != key and machine_key(2, "cuda") != key
    monkeypatch.delenv("HYPLAN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "hyplan"
    monkeypatch.setenv("HYPLAN_CACHE_DIR", str(tmp_path / "mine"))
    assert profile_path(2).parent == tmp_path / "mine" / "profiles"


def test_first_use_calibrates_once_then_reads_the_cache(fresh_cache, capsys):
    # one process: the compute-only calibration (a few seconds), by the path 2xcpu takes
    path = profile_path(1)
    assert not path.exists()
    first = parse_devices("1xcpu")
    assert path.exists() and "calibrating this machine" in capsys.readouterr().err
    made = path.stat().st_mtime_ns
    began = time.perf_counter()
    second = parse_devices("1xcpu")
    assert time.perf_counter() - began < 1.0 and path.stat().st_mtime_ns == made
    assert "calibrating" not in capsys.readouterr().err
    assert first == second and "quick calibration" in first.source

    x, _ = models.batch("mlp", 16, 0)
    plan = planner.optimize(models.build("mlp"), "1xcpu", example_inputs=(x,), optimizer="sgd")
    text = plan.explain()
    assert "Priced with: quick calibration of" in text and first.source.split("made ")[1] in text


def test_a_profile_measured_under_another_memory_policy_is_measured_again(fresh_cache, capsys):
    # an older hyplan's ranks kept only the main heap: their FSDP2 and all-gather figures
    # held page faults a run no longer pays (profiler.allocator); the older profile is the
    # reference one under no policy (a calibration to make it is ~6 s here)
    from reference_profile import reference_profile, seed_cache

    seed_cache()
    path = profile_path(1)
    reference_profile(1).model_copy(update={"memory_policy": ""}).save(path)
    capsys.readouterr()
    parse_devices("1xcpu")
    assert "calibrating this machine" in capsys.readouterr().err
    assert load_profile(path).memory_policy == MEMORY_POLICY


def test_hyplan_calibrate_refreshes_the_cached_profile(fresh_cache, capsys):
    from reference_profile import seed_cache

    seed_cache()  # a cached profile, as a first use leaves one
    before = parse_devices("1xcpu").source
    time.sleep(1.1)  # the profile's time stamp is to the second
    assert main(["calibrate", "--processes", "1"]) == 0
    after = parse_devices("1xcpu")
    assert after.source != before and after.source.startswith("hyplan calibrate of")
    assert str(profile_path(1)) in capsys.readouterr().out


def test_a_calibration_on_a_busy_machine_says_so():
    # DTensor's and a step's fixed costs are differences of small medians: measured while
    # others' work ran they come out up to 100x too large, and explain() must say so
    from reference_profile import reference_profile

    quiet = reference_profile(2).model_copy(update={"other_load_cores": 0.05})
    busy = reference_profile(2).model_copy(update={"other_load_cores": 1.4})
    assert not quiet.busy and "idle machine" not in quiet.describe()
    assert busy.busy and "1.4 cores" in busy.describe()
    assert "hyplan calibrate" in busy.cluster(2, 1).source
