"""Progress of a long search, told to whoever listens, without the planner drawing it.

The search reports a `Progress` after each candidate it settles; the command line (above
the planner) listens with `listening(callback)` and draws a rich progress bar. The planner
never imports rich or the CLI: a context variable carries the callback down, so the
public `planner.optimize(...)` signature stays as it is and a library user who does not
listen pays one lookup per candidate.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from dataclasses import dataclass


@dataclass(frozen=True)
class Progress:
    """Where a search stands: candidates settled of the total, the best step so far and
    the least lower bound among candidates still open (the gap is theirs)."""

    candidates: int
    settled: int  # solved or pruned
    solved: int
    best_s: float | None  # the incumbent's predicted step time
    bound_s: float | None  # no open candidate can beat this
    current: str = ""  # the candidate being solved, in words

    @property
    def gap(self) -> float | None:
        if self.best_s is None or self.bound_s is None or self.best_s <= 0:
            return None
        return max(0.0, (self.best_s - self.bound_s) / self.best_s)


_listener: contextvars.ContextVar[Callable[[Progress], None] | None] = contextvars.ContextVar(
    "hyplan_progress", default=None)


@contextlib.contextmanager
def listening(callback: Callable[[Progress], None]) -> Iterator[None]:
    """Hand every Progress of searches run inside the block to `callback`."""
    token = _listener.set(callback)
    try:
        yield
    finally:
        _listener.reset(token)


def listened() -> bool:
    """Whether anyone listens: a search counts its candidates for a Progress only then
    (a scan of every candidate per report, seconds on deep models)."""
    return _listener.get() is not None


def report(progress: Progress) -> None:
    """Tell the listener, if any."""
    callback = _listener.get()
    if callback is not None:
        callback(progress)
