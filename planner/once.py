"""One plan for all ranks: under an initialized process group, plan on rank 0 and hand every
rank the same Plan, without making rank 0 wait for anyone.

Each rank planning for itself times its layers on its own (busy, differently loaded) cores,
and two ranks whose measured times differ can choose different plans; ranks running
different plans then deadlock in their first mismatched collective. So `optimize` (and the
other public entries that return a Plan) plan on rank 0 only; the other ranks neither trace
nor measure, and read rank 0's plan as JSON, or the error rank 0 raised while planning,
which they raise as the same exception (same type, same message).

The plan travels through the process group's key-value store, not a collective: rank 0
writes it and returns at once. A collective would make the common torchrun habit
`if rank == 0: plan = planner.optimize(...); plan.save(path)` (the others waiting for the
file) hang forever, rank 0 waiting in a broadcast no other rank joins. Through the store,
rank 0 planning alone simply plans alone.

The other ranks that do call the entry pair their calls with rank 0's by order (their n-th
call reads rank 0's n-th plan), as collectives pair. They wait up to `ARRIVAL_WAIT_S` for
rank 0 to start planning and then as long as the planning takes, up to the process group's
timeout; a rank whose rank 0 never calls raises, naming the two ways to call it, instead
of waiting unbounded. Should rank 0 plan alone first and then with the others, the calls
pair off by one and `executor.parallelize`'s plan agreement check says so by name.
"""

from __future__ import annotations

import functools
import itertools
import pickle
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import timedelta
from typing import Callable

import torch.distributed as dist

from planner.cycle_collector import fewer_collections
from planner.plan import Plan

# True while this process is inside a planning entry: a nested entry (baseline inside
# optimize, optimize_3d inside an experiment) plans directly, as rank 0 alone runs it.
_PLANNING = ContextVar("hyplan_planning_once", default=False)

# How long a rank other than 0 waits for rank 0 to start planning: the ranks reach the call
# at different times (rank 0 may build its model or read data first), but a rank 0 that
# never calls must not leave the others waiting for the process group's whole timeout.
ARRIVAL_WAIT_S = 300.0

_KEY = "hyplan/plan_once"
# this process's calls of a planning entry, in order: the n-th pairs with rank 0's n-th
_calls = itertools.count()


class PlanningFailed(RuntimeError):
    """Rank 0's planning error, where its exception could not be rebuilt on this rank."""


class RankZeroDidNotPlan(RuntimeError):
    """This rank asked for rank 0's plan, and rank 0 did not start planning in time."""


def _group_size() -> int:
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


@contextmanager
def planning_alone():
    """Plan in this process only, as if no process group were up: for planning that one
    rank does on its own (a re-plan on rank 0 after a run), which the others never join."""
    token = _PLANNING.set(True)
    try:
        yield
    finally:
        _PLANNING.reset(token)


def plan_once(entry: Callable[..., Plan]) -> Callable[..., Plan]:
    """Decorate a function returning a Plan so that, under a process group of more than one
    rank, rank 0 runs it and every rank that calls it returns rank 0's Plan (or raises its
    error). Rank 0 never waits for the others."""

    @functools.wraps(entry)
    def planned_once(*args, **kwargs) -> Plan:
        with fewer_collections():
            return _planned_once(*args, **kwargs)

    def _planned_once(*args, **kwargs) -> Plan:
        if _group_size() == 1 or _PLANNING.get():
            return entry(*args, **kwargs)
        key = f"{_KEY}/{next(_calls)}"
        store = dist.distributed_c10d._get_default_store()
        if dist.get_rank() == 0:
            return _plan_and_publish(entry, args, kwargs, store, key)
        return _read(store, key, entry.__name__)

    return planned_once


def _plan_and_publish(entry, args, kwargs, store, key: str) -> Plan:
    """Rank 0: say planning started, plan, then leave the plan (or the error) in the store
    for whichever ranks ask."""
    store.set(f"{key}/started", b"1")
    token = _PLANNING.set(True)
    try:
        plan = entry(*args, **kwargs)
    except BaseException as error:  # KeyboardInterrupt too: the other ranks must not hang
        store.set(f"{key}/result", pickle.dumps(("error", to_portable(error))))
        raise
    finally:
        _PLANNING.reset(token)
    store.set(f"{key}/result", pickle.dumps(("plan", plan.to_json(indent=None))))
    return plan


def _read(store, key: str, entry_name: str) -> Plan:
    """Rank 0's plan, or its error raised here."""
    try:
        store.wait([f"{key}/started"], timedelta(seconds=ARRIVAL_WAIT_S))
    except dist.DistStoreError:
        raise RankZeroDidNotPlan(
            f"rank {dist.get_rank()} called planner.{entry_name} under the process group, and "
            f"rank 0 did not start planning within {ARRIVAL_WAIT_S:g} s: call it on every "
            "rank (rank 0 plans and hands the plan to all), or on rank 0 alone, saving the "
            "plan (plan.save) for the others to read with planner.Plan.load") from None
    store.wait([f"{key}/result"])  # as long as rank 0 plans, up to the group's timeout
    kind, value = pickle.loads(store.get(f"{key}/result"))
    if kind == "plan":
        return Plan.from_json(value)
    raise from_portable(value)


def to_portable(error: BaseException):
    """The error as bytes the other ranks can unpickle, or (type name, message) where it
    does not survive pickling (an exception holding a solver or a tensor)."""
    try:
        data = pickle.dumps(error)
        pickle.loads(data)
        return data
    except Exception:
        return (f"{type(error).__module__}.{type(error).__qualname__}", str(error))


def from_portable(value) -> BaseException:
    """The error to_portable sent, noted as rank 0's."""
    if isinstance(value, bytes):
        error = pickle.loads(value)
    else:
        name, message = value
        error = PlanningFailed(f"{name}: {message}")
    error.add_note("(raised on rank 0 while planning; rank 0 plans for every rank)")
    return error
