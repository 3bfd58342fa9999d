"""Several steps timed against each other, in rounds of one call each.

Timed one after another, a slow spell of this machine falls on one step and not the next,
and their ratio (what a plan weighs: a layer's rows against its shards, a plain backward
against a split one, a forward against a whole step) moves with it; timed in rounds, the
spell falls on all alike.
"""

from __future__ import annotations

import statistics


def medians_in_rounds(steps: dict, clock, least: int, budget_s: float,
                      most: int = 25) -> dict:
    """{key: median seconds by `clock`} of each of `steps` (already warm), called in
    rounds of one call each: at least `least` rounds, more (up to `most`) while the calls
    so far took less than `budget_s` in all."""
    samples: dict = {key: [] for key in steps}
    spent, rounds = 0.0, 0
    while rounds < least or (spent < budget_s and rounds < most):
        for key, step in steps.items():
            start = clock()
            step()
            samples[key].append(clock() - start)
            spent += samples[key][-1]
        rounds += 1
    return {key: statistics.median(times) for key, times in samples.items()}
