"""One plan for all ranks: under an initialized process group, plan on rank 0 and hand every
rank the same Plan.

Each rank planning for itself times its layers on its own (busy, differently loaded) cores,
and two ranks whose measured times differ can choose different plans; ranks running
different plans then deadlock in their first mismatched collective. So `optimize` (and the
other public entries that return a Plan) plan on rank 0 only; the other ranks neither trace
nor measure, and wait in one broadcast for rank 0's plan as JSON, or for the error rank 0
raised while planning, which they raise as the same exception (same type, same message).

The only collective is that broadcast, on the default group: every rank must call the
entry, as it would call any collective. The other ranks wait for it up to the process
group's timeout (torch.distributed.init_process_group(timeout=...)).
"""

from __future__ import annotations

import functools
import pickle
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Callable

import torch.distributed as dist

from planner.plan import Plan

# True while this process is inside a planning entry: a nested entry (baseline inside
# optimize, optimize_3d inside an experiment) plans directly, as rank 0 alone runs it.
_PLANNING = ContextVar("hyplan_planning_once", default=False)


class PlanningFailed(RuntimeError):
    """Rank 0's planning error, where its exception could not be rebuilt on this rank."""


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
    rank, rank 0 runs it and every rank returns rank 0's Plan (or raises its error)."""

    @functools.wraps(entry)
    def planned_once(*args, **kwargs) -> Plan:
        if _group_size() == 1 or _PLANNING.get():
            return entry(*args, **kwargs)
        if dist.get_rank() == 0:
            return _plan_and_send(entry, args, kwargs)
        return _receive()

    return planned_once


def _plan_and_send(entry, args, kwargs) -> Plan:
    """Rank 0: plan, then send the plan, or the error, to every other rank."""
    token = _PLANNING.set(True)
    try:
        plan = entry(*args, **kwargs)
    except BaseException as error:  # KeyboardInterrupt too: the other ranks must not hang
        dist.broadcast_object_list([("error", to_portable(error))], src=0)
        raise
    finally:
        _PLANNING.reset(token)
    dist.broadcast_object_list([("plan", plan.to_json(indent=None))], src=0)
    return plan


def _receive() -> Plan:
    """Rank 0's plan, or its error raised here."""
    box = [None]
    dist.broadcast_object_list(box, src=0)
    kind, value = box[0]
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
