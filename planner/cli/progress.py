"""The search's progress on the terminal, drawn with rich (the command line's side of
planner.progress).

Shown on stderr while a search runs, only where stderr is a terminal (scripts, pipes and
tests see the plan alone), and gone when the plan prints: candidates settled of the total,
the best step so far, the least bound still open, the gap, and the candidate being solved.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

from planner.progress import Progress, listening


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1e3:.1f} ms"


@contextlib.contextmanager
def search_progress(enabled: bool | None = None) -> Iterator[None]:
    """Draw the search's progress inside the block (by default only on a terminal)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        yield
        return
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress as Bar, TextColumn

    bar = Bar(TextColumn("search"), BarColumn(), MofNCompleteColumn(),
              TextColumn("{task.description}"), console=Console(stderr=True),
              transient=True)
    task = bar.add_task("", total=None)

    def show(p: Progress) -> None:
        gap = "" if p.gap is None else f", gap {p.gap:.1%}"
        now = f"; solving {p.current}" if p.current else ""
        bar.update(task, total=p.candidates, completed=p.settled,
                   description=f"solved {p.solved}, best {_ms(p.best_s)}, "
                               f"bound {_ms(p.bound_s)}{gap}{now}")

    with bar, listening(show):
        yield
