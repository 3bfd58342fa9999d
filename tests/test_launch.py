"""The ranks hyplan starts (profiler.launch): spawned, or forked from a fork server that
lives on, so that their CPU time reaches this process only through that server; either
way `OtherLoad`, which tells a calibration made on a busy machine, must count them as this
process's own, and they run in the environment of their launch."""

import time

import pytest

from distributed import PRELOAD
from profiler.launch import OtherLoad, run_ranks

# every forked launch of a test process asks its fork server for the same modules: the
# first one starts the server, and what it preloads serves the process's later launches
FORKED = dict(forked=True, preload=PRELOAD)


def _spin(rank, world, seconds):
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return rank


@pytest.mark.serial
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "spawned"])
def test_other_load_does_not_count_the_ranks_it_started(forked):
    if forked:
        run_ranks(_spin, 2, 0.0, **FORKED)  # the server is up before the block, as in a suite
    with OtherLoad() as load:
        assert run_ranks(_spin, 2, 1.0, forked=forked, preload=PRELOAD) == [0, 1]
    # two ranks spun a core each for a second: none of it is another process's load
    # (counted as other load, it read ~2 cores; below 1 leaves room for a busy machine)
    assert load.cores is not None and load.cores < 1.0, load.cores


def _environment(rank, world, name):
    import os

    return os.environ.get(name)


def test_ranks_see_the_environment_of_their_launch(monkeypatch):
    """A forked rank starts from the fork server's environment, which is whatever this
    process had when its first launch started the server: the launch passes its own."""
    run_ranks(_spin, 2, 0.0, **FORKED)  # the server is up, without the variable
    monkeypatch.setenv("HYPLAN_TEST_LAUNCH_VARIABLE", "set after the server started")
    assert run_ranks(_environment, 2, "HYPLAN_TEST_LAUNCH_VARIABLE", **FORKED) == [
        "set after the server started"] * 2


def _imported(rank, world, name):
    import sys

    return name in sys.modules


def test_a_forked_rank_starts_with_the_modules_its_launch_preloaded():
    """What a launch preloads (tests/distributed.PRELOAD: transformers' modeling code) the
    fork server imported once; a rank has it before it imports anything."""
    pytest.importorskip("transformers")
    assert run_ranks(_imported, 2, "transformers.modeling_utils", **FORKED) == [True, True]


def _killed_once(rank, world, flag):
    """Dies of SIGKILL the first time (leaving `flag`), returns its rank the next."""
    import os
    import signal
    from pathlib import Path

    if not Path(flag).exists():
        Path(flag).touch()
        os.kill(os.getpid(), signal.SIGKILL)
    return rank


def test_a_rank_killed_before_reporting_is_named_with_its_signal(tmp_path):
    from profiler.launch import RanksExited

    with pytest.raises(RanksExited, match=r"ranks \[0\] exited with status \[-9\]") as error:
        run_ranks(_killed_once, 1, str(tmp_path / "flag"), **FORKED)
    assert error.value.statuses == [-9]


def test_the_tests_run_a_forked_launch_again_spawned_when_a_rank_died_of_a_signal(tmp_path):
    """tests/distributed.py: a forked rank dead in native code (a library not safe to
    fork) is not a failure of the plan it ran; the launch is run again, spawned, and says
    so."""
    from distributed import run_ranks as run_in_tests

    with pytest.warns(UserWarning, match="run again as new interpreters"):
        assert run_in_tests(_killed_once, 1, str(tmp_path / "flag")) == [0]
