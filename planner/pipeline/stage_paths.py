"""An exact lower bound for chunked pipeline shapes with few stages: every stage cut
enumerated, each priced at its stages' least times by the schedule's own action graph.

With each rank's actions in a fixed order (planner.pipeline.schedules.actions), an action starts
when the one before it on its rank and the ones it needs (the forward of the stage before,
the input gradient of the stage after, its own input gradient for a weight gradient) have
ended, so the simulated makespan is the longest path through that graph, which one pass
in topological order computes for many stage-time vectors at once (`makespans`: numpy
over the cuts). planner.pipeline.schedules.price times a stage's forward, input gradient and
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
(planner.pipeline.stage_loads) leaves a gap: a short pipeline's fill and drain are a large part of
its step, and that bound leaves the bubble out.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache

import numpy as np

from planner.numerics import mip_solver
from planner.pipeline import held_row, schedules

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
    """The simulated makespan (planner.pipeline.schedules.price, `forward` the forward's share)
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


MEMORY_LAMBDAS = 16  # multipliers of each rank's memory row in relaxed_path_bound
HELD_LAMBDAS = 9  # multipliers of its second row (a factor 3 apart: each a row per τ)
HELD_MIP_S = 1.0  # the most a program with the second row's τ choices runs: its bound read


def relaxed_path_bound(problem, pp: int, microbatches: int, schedule: str,
                       chunks: int, budget_bytes: float | None = None,
                       flights=None, second_row: bool = True,
                       mip_s: float = HELD_MIP_S) -> float:
    """A lower bound for chunked shapes with any number of cuts: `path_bound` with the
    stages' times free (each at least its least one unit, together at least the model's
    least work and transfers) instead of one per cut, by a linear program over the
    schedule's action graph (its end times the variables, each at least an action it
    waits for plus its own share of its stage's time; the makespan at least every end).

    Valid because the makespan is nondecreasing in every stage time (module docstring):
    a plan's own stage times satisfy the program, so its optimum is at most the plan's
    makespan. It keeps what `path_bound` keeps of the bubble, a fill and drain that no
    split of the work escapes, where the busiest rank's work (planner.pipeline.stage_loads) leaves
    it out: few microbatches over many stages (a 70 B Llama over 256 H100s, four of them
    over 4 ranks of 2 chunks, interleaved 1F1B: 7.95 s by the work, 9.50 s by this).

    With `budget_bytes` and `flights` (per stage, the microbatches it keeps in flight:
    stages.in_flight), each rank's stages also carry its memory row, relaxed as in
    stage_loads.memory_bound: a stage keeping f microbatches in flight keeps f of every
    layer it holds, so for any λ >= 0, m times rank r's stage times is at least Σ over
    its units of c_λ(u, f) - λ·budget, c_λ(u, f) = Σ over u's layers of min over options
    (m·t + λ·(w + f·a)) + m times its least edges, f its stage's flight; which units each
    stage holds is free, but for how many of each kind the model has (_memory_rows).
    So where memory forces blocks to be recomputed, their recompute enters the bubble's
    bound: on a 70 B Llama over 256 H100s, interleaved 1F1B over 4 ranks of 2 chunks,
    4 microbatches, every block offered recomputed, 9.50 s without them, 10.84 s with.
    Where options gather (FSDP), each rank's second memory row as well (held_row, its τ
    one of two values, a binary per rank: a small MIP, whose bound is read after
    `mip_s`; `second_row` False leaves it out, a linear program): a 405 B Llama's
    DualPipeV over 8 ranks at tp 2, 88.54 s by the stage rows, 90.48 s with it."""
    from ortools.linear_solver import pywraplp

    S = pp * chunks
    U = len(problem.units)
    if S > U:
        return math.inf
    problem = problem.for_schedule(schedule)
    tables = problem.tables
    ranks = schedules.placement(schedule, pp, chunks) if pp > 1 else (0,) * S
    work = _least_work(problem, ranks)
    once = tables.step_least_s / pp  # the slowest rank's per-step part, at least the mean
    if work <= 0:
        return once
    smallest = float(tables.unit_least_s.min())
    share = schedules.parts(problem.forward_share)
    held = (second_row and budget_bytes is not None and flights is not None and pp > 1
            and held_row.levels(tables) is not None)
    # the second memory row's τ is one per rank: a choice, so a small MIP (its bound read)
    solver = mip_solver()[0] if held else pywraplp.Solver.CreateSolver("GLOP")
    # in units of the work: the program's numbers near 1
    x = [solver.NumVar(smallest / work + (problem.replay_s / work if k else 0.0),
                       solver.infinity(), f"x[{k}]") for k in range(S)]
    solver.Add(sum(x) >= 1.0, "least_work")
    z = _makespan_rows(solver, x, share, action_graph(schedule, pp, chunks, microbatches))
    if budget_bytes is not None and flights is not None and pp > 1:
        # the slowest rank's per-step part, from the same rows as its memory
        slowest = _memory_rows(solver, x, problem, pp, microbatches, ranks, budget_bytes,
                               flights, work, held)
        solver.Minimize(z + slowest)
        once = 0.0
    else:
        solver.Minimize(z)
    if held:
        solver.SetTimeLimit(int(mip_s * 1000))
    status = solver.Solve()
    if held and status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return solver.Objective().BestBound() * work * (1 - 1e-7) + once
    if status != pywraplp.Solver.OPTIMAL:
        return tables.step_least_s / pp  # no answer is no bound
    # the LP's own rounding: its optimum read a hair low errs on the bound's side
    return solver.Objective().Value() * work * (1 - 1e-7) + once


def _least_work(problem, ranks) -> float:
    """The least Σ_k T_k of any cut: every unit's least, the replay of every stage but the
    first, and each hop between ranks paid by both its stages at the least cut."""
    S = len(ranks)
    hops = sum(ranks[k - 1] != ranks[k] for k in range(1, S))
    cuts = sorted(problem.cut_s[1:])
    return (float(problem.tables.unit_least_s.sum()) + (S - 1) * problem.replay_s
            + 2 * float(sum(cuts[:hops])))


def _makespan_rows(solver, x, share, actions):
    """The makespan variable of relaxed_path_bound's program: each action's end at least
    what it waits for plus its share of its stage's time x; the makespan at least every
    end (the ends of each rank's last action and of every action without a successor
    bound it, and every end is at most one of those, so all of them is simplest)."""
    z = solver.NumVar(0.0, solver.infinity(), "makespan")
    ends = []
    for stage, kind, waits in actions:
        end = solver.NumVar(0.0, solver.infinity(), "")
        for q in waits:
            solver.Add(end >= ends[q] + share[kind] * x[stage])
        if not waits:
            solver.Add(end >= share[kind] * x[stage])
        ends.append(end)
    for end in ends:
        solver.Add(z >= end)
    return z


def _memory_rows(solver, x, problem, pp: int, m: int, ranks, budget_bytes, flights,
                 work: float, held: bool = False):
    """relaxed_path_bound's memory rows (its docstring), in its units (of the work, per
    microbatch); the variable of the slowest rank's per-step part, which the bound adds
    to the makespan. Units alike (the same layers, least edges and least times: a
    transformer's blocks) form a class; z[c, k] is how many of class c stage k holds,
    free but for Σ_k z[c, k] = the class's count and each stage at least one unit. Then
    x_k >= Σ_c z[c, k]·least(c) (its units' least times), rank r's per-step part S_r at
    least its units' least, and per multiplier λ: m·Σ_{k on r} x_k + S_r >=
    Σ_{k on r} Σ_c z[c, k]·c_λ(c, f_k) - λ·budget, c_λ with m·t + s (and the same rows
    without S_r, c_λ with m·t alone). A plan's own units per stage satisfy them all:
    the program's least is at most its step. Against each rank taking its own cheapest
    units, the classes keep the head and the norm from being counted on every rank."""
    tables = problem.tables
    S = len(ranks)
    t = m * tables.microbatch_s  # padding: +inf, never the least
    w, a = tables.weight_bytes, tables.activation_bytes
    edges = m * tables.edge_least_s
    key = np.concatenate([tables.counts, tables.edge_least_s[None],
                          tables.unit_least_s[None], tables.unit_step_least_s[None]], 0).T
    classes, first, count = np.unique(key, axis=0, return_index=True, return_counts=True)
    C = len(classes)
    z = [[solver.NumVar(0.0, float(count[c]), "") for k in range(S)] for c in range(C)]
    for c in range(C):
        solver.Add(sum(z[c]) == float(count[c]))
    for k in range(S):
        solver.Add(sum(z[c][k] for c in range(C)) >= 1.0)
        solver.Add(x[k] >= sum(z[c][k] * float(tables.unit_least_s[first[c]] / work)
                               for c in range(C)))
    once = [solver.NumVar(0.0, solver.infinity(), f"S[{r}]") for r in range(pp)]
    slowest = solver.NumVar(0.0, solver.infinity(), "slowest")
    mine = [[k for k in range(S) if ranks[k] == r] for r in range(pp)]
    for r in range(pp):
        solver.Add(slowest >= once[r])
        solver.Add(once[r] >= sum(z[c][k] * float(tables.unit_step_least_s[first[c]] / work)
                                  for k in mine[r] for c in range(C)))
    scale = float(t.min(axis=1) @ tables.counts.sum(axis=1))
    norm = m * work
    # each with the per-step parts and without: an option cheap in one may be dear in the
    # other, and either row holds
    for with_step in (False, True):
        priced = t + tables.step_s if with_step else t
        for lam in scale / budget_bytes * np.geomspace(1e-2, 1e2, MEMORY_LAMBDAS):
            cost = {f: (tables.least_by_unit(priced + lam * (w + f * a))
                        + edges)[first] / norm for f in set(flights)}
            if not all(np.isfinite(v).all() for v in cost.values()):
                continue
            for r in range(pp):
                solver.Add(sum(x[k] for k in mine[r])
                           + (once[r] * (1.0 / m) if with_step else 0.0)
                           - sum(z[c][k] * float(cost[flights[k]][c]) for k in mine[r]
                                 for c in range(C))
                           >= -lam * budget_bytes / norm)
    if held:
        _held_rows(solver, x, z, once, problem, m, mine, budget_bytes, flights, first, count,
                   scale, norm)
    return slowest


def _held_rows(solver, x, z, once, problem, m: int, mine, budget_bytes, flights, first,
               count, scale: float, norm: float) -> None:
    """The second memory row of each rank (planner.pipeline.held_row) in _memory_rows'
    form: per multiplier λ and τ, m·Σ_{k on r} x_k + S_r >= Σ z[c, k]·c_λτ(c, f_k) +
    4λτ - λ·budget, where rank r's binary y[r, τ] picks its τ (the others' rows lifted
    by their own largest left side, so they bind nothing)."""
    tables = problem.tables
    t = m * tables.microbatch_s + tables.step_s
    edges = m * tables.edge_least_s
    C = len(first)
    lams = scale / budget_bytes * np.geomspace(1e-2, 1e2, HELD_LAMBDAS)
    priced = {f: held_row.lagrangian_by_unit(tables, t, f, lams, one=True)
              for f in set(flights)}
    taus = len(next(iter(priced.values()))[1])
    for r, stages in enumerate(mine):
        y = [solver.BoolVar(f"tau[{r},{i}]") for i in range(taus)]
        solver.Add(sum(y) == 1)
        for j, lam in enumerate(lams):
            for i in range(taus):
                cost = {f: (value[i, j] + edges)[first] / norm
                        for f, (value, _) in priced.items()}
                if not all(np.isfinite(v).all() for v in cost.values()):
                    continue
                rest = float(priced[flights[stages[0]]][1][i, j]) / norm
                lift = sum(float(count[c]) * max(float(cost[f][c]) for f in cost)
                           for c in range(C)) + rest
                solver.Add(sum(x[k] for k in stages) + once[r] * (1.0 / m)
                           - sum(z[c][k] * float(cost[flights[k]][c]) for k in stages
                                 for c in range(C))
                           >= rest - lam * budget_bytes / norm - lift * (1 - y[i]))
