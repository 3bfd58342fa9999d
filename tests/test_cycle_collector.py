"""planner.cycle_collector: the collector's first threshold raised while hyplan plans and
the caller's thresholds given back after; nothing is frozen twice."""

import gc

import pytest

from planner.cycle_collector import PLANNING_THRESHOLD, fewer_collections, older_objects_frozen


@pytest.fixture
def thresholds():
    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)


def test_planning_raises_the_first_threshold_and_gives_the_callers_back(thresholds):
    gc.set_threshold(700, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (PLANNING_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)


def test_a_caller_with_a_higher_threshold_keeps_it(thresholds):
    gc.set_threshold(10 * PLANNING_THRESHOLD, 5, 5)
    with pytest.raises(RuntimeError), fewer_collections():
        assert gc.get_threshold() == (10 * PLANNING_THRESHOLD, 5, 5)
        raise RuntimeError  # given back on an error too
    assert gc.get_threshold() == (10 * PLANNING_THRESHOLD, 5, 5)


def test_objects_frozen_by_the_caller_stay_frozen():
    # counts, not equalities: a frozen object another thread of the process drops leaves
    # the count (3 of 1.7 million did once in a suite); a second freeze would add the 1,000
    # young lists, an unfreeze take all
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        young = [[] for _ in range(1000)]
        with older_objects_frozen():
            assert gc.get_freeze_count() <= frozen
        assert frozen - len(young) < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
