"""An exact lower bound for chunked pipeline shapes with few stages: every stage cut
enumerated, each priced at its stages' least times by the schedule's own action graph.

With each rank's actions in a fixed order (planner.schedules.actions), an action starts
when the one before it on its rank and the ones it needs (the forward of the stage before,
the input gradient of the stage after, its own input gradient for a weight gradient) have
ended, so the simulated makespan is the longest path through that graph, which one pass
in topological order computes for many stage-time vectors at once (`makespans`: numpy
over the cuts). planner.schedules.price times a stage's forward, input gradient and
weight gradient at fixed shares of its per-microbatch time T_k (schedules.parts: the
forward's measured share, the backward's rest in halves), so the makespan is a maximum
of sums of the T_k with nonnegative weights: nondecreasing in every T_k.

A plan of the shape cuts the units into pp·chunks stages and runs each layer with one
option; its T_k is at least the sum, over the stage's units, of each layer's least
per-microbatch time and each edge's least entry, plus its cut transfers and the replayed
prologue, and each rank's per-step part at least the sum of its layers' least. So

    step >= min over cuts of [ makespan(T_least(cut)) + max_r S_least_r(cut) ],

and it holds whatever the memory budget (memory is not read); it is reached where the
least options fit. Offered while the cuts number at most MAX_CUTS (two ranks of two
chunks on a 50-unit model: 18,424), which is where the busiest-rank bound
(planner.stage_loads) leaves a gap: a short pipeline's fill and drain are a large part of
its step, and that bound leaves the bubble out.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from planner import schedules

MAX_CUTS = 60_000
CHUNK = 8_192  # cuts priced at once (memory: CHUNK x actions floats)


@lru_cache(maxsize=256)
def action_graph(schedule: str, pp: int, chunks: int, microbatches: int
                 ) -> tuple[tuple[int, str, tuple[int, ...]], ...]:
    """The schedule's actions in topological order, each as (its stage, its kind: "F",
    "B", "I" or "W", the positions of the actions it waits for) (module docstring)."""
    S = pp * chunks
    orders = schedules.actions(schedule, pp, chunks, microbatches)
    nodes, preds, done_by = [], [], {}
    for order in orders:
        for n, (s, kind, i) in enumerate(order):
            nodes.append((s, kind, i))
            preds.append([len(nodes) - 2] if n else [])
            # what others wait for: a forward, an input gradient (B or I), a weight gradient
            done_by["F" if kind == "F" else "G" if kind in "BI" else "W", s, i] = len(nodes) - 1
    for node, (s, kind, i) in enumerate(nodes):
        if kind == "F" and s > 0:
            preds[node].append(done_by["F", s - 1, i])
        elif kind == "W":
            preds[node].append(done_by["G", s, i])
        elif kind in "BI":
            preds[node].append(done_by["F", s, i])
            if s < S - 1:
                preds[node].append(done_by["G", s + 1, i])
    waiting = [len(p) for p in preds]
    after: list[list[int]] = [[] for _ in nodes]
    for node, ps in enumerate(preds):
        for q in ps:
            after[q].append(node)
    ready = [node for node, w in enumerate(waiting) if w == 0]
    order, position = [], {}
    while ready:
        node = ready.pop()
        position[node] = len(order)
        s, kind, _ = nodes[node]
        order.append((s, kind, tuple(position[q] for q in preds[node])))
        for nxt in after[node]:
            waiting[nxt] -= 1
            if not waiting[nxt]:
                ready.append(nxt)
    if len(order) != len(nodes):
        raise AssertionError(f"{schedule} (pp {pp}, v {chunks}, m {microbatches}): its "
                             f"action graph has a cycle")
    return tuple(order)


def makespans(schedule: str, pp: int, chunks: int, microbatches: int,
              total: np.ndarray, forward: float = 1 / 3) -> np.ndarray:
    """The simulated makespan (planner.schedules.price, `forward` the forward's share)
    of each row of `total` (rows, stages: per-microbatch times), all rows at once: the
    longest path through the action graph."""
    ends: list[np.ndarray] = []
    share = schedules.parts(forward)
    for stage, kind, waits in action_graph(schedule, pp, chunks, microbatches):
        start = np.maximum.reduce([ends[q] for q in waits]) if len(waits) > 1 else (
            ends[waits[0]] if waits else 0.0)
        ends.append(start + share[kind] * total[:, stage])
    return np.maximum.reduce(ends)


def cut_count(units: int, stages: int) -> int:
    """How many cuts of `units` units into `stages` nonempty contiguous stages."""
    return math.comb(units - 1, stages - 1) if units >= stages else 0


def path_bound(problem, pp: int, microbatches: int, schedule: str, chunks: int
               ) -> float | None:
    """The least over every cut of the step at its stages' least times (module
    docstring); None where the cuts number more than MAX_CUTS. `problem`: the shape's
    StageProblem as built (its split backward applied here, as evaluate() does)."""
    S = pp * chunks
    U = len(problem.units)
    count = cut_count(U, S)
    if count == 0:
        return math.inf
    if count > MAX_CUTS:
        return None
    problem = problem.for_schedule(schedule)
    tables = problem.tables
    work = np.concatenate([[0.0], np.cumsum(tables.unit_least_s)])
    once = np.concatenate([[0.0], np.cumsum(tables.unit_step_least_s)])
    cut_s = np.asarray(problem.cut_s, float)
    ranks = np.asarray(schedules.placement(schedule, pp, chunks) if pp > 1 else (0,) * S)
    best = math.inf
    cuts = itertools.combinations(range(1, U), S - 1)
    while True:
        block = np.array(list(itertools.islice(cuts, CHUNK)), int).reshape(-1, S - 1)
        if not len(block):
            return best
        starts = np.concatenate([np.zeros((len(block), 1), int), block], 1)
        ends = np.concatenate([block, np.full((len(block), 1), U)], 1)
        total = work[ends] - work[starts]
        total[:, 1:] += problem.replay_s
        for k in range(1, S):
            if ranks[k - 1] != ranks[k]:  # the turn of a V stays on one rank
                sent = cut_s[starts[:, k]]
                total[:, k - 1] += sent
                total[:, k] += sent
        stage_once = once[ends] - once[starts]
        per_rank = np.stack([stage_once[:, ranks == r].sum(1) for r in range(pp)], 1)
        step = makespans(schedule, pp, chunks, microbatches, total,
                         problem.forward_share) + per_rank.max(1)
        best = min(best, float(step.min()))
