"""The ranks hyplan starts (profiler.launch): spawned, or forked from a fork server that
lives on, so that their CPU time reaches this process only through that server; either
way `OtherLoad`, which tells a calibration made on a busy machine, must count them as this
process's own, and they run in the environment of their launch."""

import time

import pytest

from profiler.launch import OtherLoad, run_ranks


def _spin(rank, world, seconds):
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        pass
    return rank


@pytest.mark.serial
@pytest.mark.parametrize("forked", [True, False], ids=["forked", "spawned"])
def test_other_load_does_not_count_the_ranks_it_started(forked):
    if forked:
        run_ranks(_spin, 2, 0.0, forked=True)  # the server is up before the block, as in a suite
    with OtherLoad() as load:
        assert run_ranks(_spin, 2, 1.0, forked=forked) == [0, 1]
    # two ranks spun a core each for a second: none of it is another process's load
    # (counted as other load, it read ~2 cores; below 1 leaves room for a busy machine)
    assert load.cores is not None and load.cores < 1.0, load.cores


def _environment(rank, world, name):
    import os

    return os.environ.get(name)


def test_ranks_see_the_environment_of_their_launch(monkeypatch):
    """A forked rank starts from the fork server's environment, which is whatever this
    process had when its first launch started the server: the launch passes its own."""
    run_ranks(_spin, 2, 0.0, forked=True)  # the server is up, without the variable
    monkeypatch.setenv("HYPLAN_TEST_LAUNCH_VARIABLE", "set after the server started")
    assert run_ranks(_environment, 2, "HYPLAN_TEST_LAUNCH_VARIABLE", forked=True) == [
        "set after the server started"] * 2
