"""Pipeline stages for one mesh shape: cut the layers into contiguous stages and pick each
layer's strategy over its tensor-parallel group, for the fastest pipelined step that fits.

The data is free of torch (like planner.problem), so tests can compare the integer program
with brute force. Layers come in `units` (runs of layers owned by one top-level module, in
topological order); a stage is a contiguous run of units. For a schedule with `m`
microbatches over `pp` stages (GPipe and 1F1B alike: the same bubble, different memory):

    step  =  Σ_k T_k  +  (m - 1) · max_k T_k   +   max_k S_k

    T_k   per-microbatch time of stage k: its layers' forward + backward on one microbatch,
          the collectives inside its tp group, the layout changes on edges into its layers,
          and the point-to-point transfers at its cuts (forward activation + its gradient)
    S_k   once per step: the gradient all-reduce over the dp group and the optimizer

The first microbatch crosses every stage, forward and back (Σ_k T_k); the other m - 1
follow at the pace of the slowest stage. With balanced stages this is the textbook
(m + pp - 1)·T; with unbalanced ones it is what the schedule takes, where pricing every
stage at the slowest one's pace over-priced a 2-stage MLP (one 16 M-parameter layer against
4 M) by 60% on 2 processes.

Memory per device of stage k: weights, gradients and optimizer state of its layers plus
each layer's activations times the microbatches the schedule keeps in flight there
(GPipe: all m; 1F1B: min(m, pp - k), the first stage the most).

The integer program (SCIP through pywraplp, edge variables continuous as in planner.ilp):

    x[l,s] ∈ {0,1}  layer l runs strategy s          Σ_s x[l,s] = 1
    e[k,i,j] ∈ [0,1] edge k's marginals equal x       (as planner.ilp)
    z[u,k] ∈ {0,1}  unit u lies in stage ≥ k         z[u,k] ≤ z[u+1,k], z[u,k+1] ≤ z[u,k]
    y[u,k] = z[u,k] - z[u,k+1]   unit u in stage k;  every stage gets at least one unit
    A_u, G_u, W_u, V_u   unit u's per-microbatch time, per-step time, weight and activation
                         memory: linear in x and e
    v[u,k] ≥ A_u - Mᴬ_u (1 - y[u,k]),  Σ_k v[u,k] ≥ A_u     (the same for G with w)
    T_k = Σ_u v[u,k] + cut times;  C ≥ T_k;  S ≥ Σ_u w[u,k]
    Σ_u q[u,k] ≤ budget,  q[u,k] ≥ W_u + f_k·V_u - Mᵐ_uk (1 - y[u,k])
    min (m - 1)·C + Σ_k T_k + S

The big-M constants are each expression's own maximum, and Σ_k v[u,k] ≥ A_u hands the LP
the balanced-stage bound C ≥ Σ_u A_u / pp. With one stage there is no cut to choose and
the step is additive over layers and edges: that is planner.ilp's problem, solved there
with its reductions (seconds to minutes faster on large models).
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace

import numpy as np
from ortools.linear_solver import pywraplp

from planner import ilp
from planner.problem import Edge, Infeasible, Node, Option, Problem

SCHEDULES = ("1F1B", "GPipe")
_GB = 1e9


@dataclass(frozen=True)
class LayerOptions:
    """One layer's candidate strategies inside a stage, each priced per microbatch (time),
    per step (gradient sync and optimizer) and per device (memory)."""

    name: str
    unit: int
    strategies: tuple[str, ...]
    microbatch_s: np.ndarray  # forward + backward on one microbatch, with its own collectives
    step_s: np.ndarray  # once per step: gradient all-reduce over the dp group + optimizer
    weight_bytes: np.ndarray  # parameters + gradients + optimizer state on one device
    activation_bytes: np.ndarray  # kept for backward, per microbatch in flight


@dataclass(frozen=True)
class StageProblem:
    """Layers in topological order, grouped in `units`; `edges` price layout changes per
    microbatch (charged to the consumer's stage); `cut_s[u]` is the point-to-point time per
    microbatch (activation forward, its gradient backward) of a cut right before unit u."""

    layers: tuple[LayerOptions, ...]
    edges: tuple[Edge, ...]
    units: tuple[str, ...]
    cut_s: tuple[float, ...]

    def unit_layers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.units]
        for i, layer in enumerate(self.layers):
            out[layer.unit].append(i)
        return out


def in_flight(schedule: str, pp: int, microbatches: int, stage: int) -> int:
    """Microbatches whose activations stage `stage` holds at once: GPipe runs every forward
    before any backward; 1F1B starts backward after pp - stage forwards."""
    if schedule == "GPipe":
        return microbatches
    if schedule == "1F1B":
        return min(microbatches, pp - stage)
    raise ValueError(f"schedule: {schedule!r} is not one of {SCHEDULES}")


@dataclass(frozen=True)
class StageTimes:
    """A full assignment priced by the cost model (what evaluate() returns)."""

    step_s: float
    microbatch_s: tuple[float, ...]  # T_k
    send_s: tuple[float, ...]  # the cut part of T_k
    once_s: tuple[float, ...]  # S_k
    weight_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]  # already times the microbatches in flight

    @property
    def memory_bytes(self) -> tuple[float, ...]:
        return tuple(w + a for w, a in zip(self.weight_bytes, self.activation_bytes))


def evaluate(problem: StageProblem, starts: tuple[int, ...], choice, microbatches: int,
             schedule: str) -> StageTimes:
    """The cost model, plainly: price stages starting at units `starts` (starts[0] == 0)
    with strategy `choice[l]` per layer. The definition the integer program must match."""
    pp = len(starts)
    bounds = list(starts) + [len(problem.units)]
    stage_of_unit = [k for k in range(pp) for _ in range(bounds[k], bounds[k + 1])]
    stage = [stage_of_unit[layer.unit] for layer in problem.layers]
    mb = [0.0] * pp
    once = [0.0] * pp
    weights = [0.0] * pp
    acts = [0.0] * pp
    for i, layer in enumerate(problem.layers):
        c, k = choice[i], stage[i]
        mb[k] += float(layer.microbatch_s[c])
        once[k] += float(layer.step_s[c])
        weights[k] += float(layer.weight_bytes[c])
        acts[k] += float(layer.activation_bytes[c]) * in_flight(schedule, pp, microbatches, k)
    for e in problem.edges:
        mb[stage[e.dst]] += float(e.cost_s[choice[e.src], choice[e.dst]])
    send = [0.0] * pp
    for k in range(1, pp):
        t = problem.cut_s[starts[k]]
        send[k - 1] += t
        send[k] += t
    total = [a + b for a, b in zip(mb, send)]
    step = sum(total) + (microbatches - 1) * max(total) + max(once)
    return StageTimes(step, tuple(total), tuple(send), tuple(once), tuple(weights), tuple(acts))


def brute_force(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                budget_bytes: float | None):
    """(StageTimes, starts, choice) of the best assignment by enumeration, or None when
    nothing fits; for tests on small instances."""
    best = None
    U = len(problem.units)
    for cuts in itertools.combinations(range(1, U), pp - 1):
        starts = (0, *cuts)
        for choice in itertools.product(*(range(len(l.strategies)) for l in problem.layers)):
            t = evaluate(problem, starts, choice, microbatches, schedule)
            if budget_bytes is not None and max(t.memory_bytes) > budget_bytes * (1 + 1e-9):
                continue
            if best is None or t.step_s < best[0].step_s - 1e-15:
                best = (t, starts, choice)
    return best


class TimeLimit(RuntimeError):
    """The solver ran out of time before it found (or ruled out) an answer."""

    def __init__(self, bound_s: float):
        super().__init__(f"time limit with no answer; bound {bound_s:.6g} s")
        self.bound_s = bound_s


@dataclass(frozen=True)
class StageSolution:
    starts: tuple[int, ...]  # first unit of each stage
    choice: tuple[int, ...]  # option index per layer
    times: StageTimes
    status: str  # "optimal" or "feasible"
    bound_s: float
    seconds: float
    num_variables: int
    num_constraints: int


def solve_stages(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                 budget_bytes: float | None, time_limit_s: float = 60.0,
                 relative_gap: float = 1e-9, cutoff_s: float | None = None
                 ) -> StageSolution | None:
    """The best stage cut and strategies for this shape; None when nothing fits the budget
    (or, with `cutoff_s`, nothing beats it)."""
    start = time.perf_counter()
    U = len(problem.units)
    if pp > U:
        return None
    if pp == 1:
        return _solve_one_stage(problem, microbatches, schedule, budget_bytes, time_limit_s,
                                cutoff_s, start)
    given = problem
    # in units of the largest single time: SCIP drops coefficients below 1e-9 (planner.ilp)
    unit_s = _time_unit_s(problem)
    problem = _in_units(problem, unit_s)
    solver = pywraplp.Solver.CreateSolver("SCIP") or pywraplp.Solver.CreateSolver("CBC")
    inf = solver.infinity()
    units = problem.unit_layers()

    # --- variables: one strategy per layer ---------------------------------------------
    x = []
    for i, layer in enumerate(problem.layers):
        n = len(layer.strategies)
        if n == 1:
            x.append([1.0])
            continue
        row = [solver.BoolVar(f"x[{i},{s}]") for s in range(n)]
        solver.Add(sum(row) == 1, f"one_strategy[{i}]")
        x.append(row)

    # --- per-unit linear expressions ----------------------------------------------------
    def dot(values, xs):
        return sum(float(v) * xi for v, xi in zip(values, xs) if v != 0.0)

    A = [0.0] * U  # per-microbatch time
    A_max = [0.0] * U
    G = [0.0] * U
    G_max = [0.0] * U
    W = [0.0] * U
    V = [0.0] * U
    W_max = [0.0] * U
    V_max = [0.0] * U
    for u, members in enumerate(units):
        for i in members:
            L = problem.layers[i]
            A[u] += dot(L.microbatch_s, x[i])
            G[u] += dot(L.step_s, x[i])
            W[u] += dot(L.weight_bytes / _GB, x[i])
            V[u] += dot(L.activation_bytes / _GB, x[i])
            A_max[u] += float(L.microbatch_s.max())
            G_max[u] += float(L.step_s.max())
            W_max[u] += float(L.weight_bytes.max()) / _GB
            V_max[u] += float(L.activation_bytes.max()) / _GB
    for k, edge in enumerate(problem.edges):
        cost = np.asarray(edge.cost_s, float)
        if not cost.any():
            continue
        u = problem.layers[edge.dst].unit
        A_max[u] += float(cost.max())
        xs, xd = x[edge.src], x[edge.dst]
        if len(xs) == 1 or len(xd) == 1:  # one side fixed: linear in the other
            A[u] += dot(cost[:, 0], xs) if len(xd) == 1 else dot(cost[0, :], xd)
            continue
        a, b = cost[:, 0], cost[0, :] - cost[0, 0]
        if np.abs(cost - a[:, None] - b[None, :]).max() <= 1e-12 * np.abs(cost).max():
            A[u] += dot(a, xs) + dot(b, xd)  # additive: no pair variables needed
            continue
        e = [[solver.NumVar(0, 1, f"e[{k},{i},{j}]") for j in range(len(xd))]
             for i in range(len(xs))]
        for i in range(len(xs)):
            solver.Add(sum(e[i]) == xs[i], f"edge_src[{k},{i}]")
        for j in range(len(xd)):
            solver.Add(sum(e[i][j] for i in range(len(xs))) == xd[j], f"edge_dst[{k},{j}]")
        A[u] += sum(float(cost[i, j]) * e[i][j] for i in range(len(xs))
                    for j in range(len(xd)) if cost[i, j] != 0.0)

    C = solver.NumVar(0, inf, "C")  # the slowest stage's per-microbatch time
    S = solver.NumVar(0, inf, "S")  # the slowest stage's once-per-step time
    budget = None if budget_bytes is None else budget_bytes / _GB
    flight = [in_flight(schedule, pp, microbatches, k) for k in range(pp)]

    # --- stage cut: z[u][k] = unit u in stage >= k (k = 1..pp-1) --------------------
    z = [[1.0] + [solver.BoolVar(f"z[{u},{k}]") for k in range(1, pp)] + [0.0]
         for u in range(U)]
    for k in range(1, pp):
        solver.Add(z[0][k] == 0, f"first_unit_in_stage0[{k}]")
        solver.Add(z[U - 1][k] == 1, f"last_unit_in_last_stage[{k}]")
        for u in range(U - 1):
            solver.Add(z[u][k] <= z[u + 1][k], f"contiguous[{u},{k}]")
        if k + 1 < pp:
            for u in range(U):
                solver.Add(z[u][k + 1] <= z[u][k], f"nested[{u},{k}]")
            solver.Add(sum(z[u][k] for u in range(U))
                       >= sum(z[u][k + 1] for u in range(U)) + 1, f"stage_nonempty[{k}]")
    y = [[z[u][k] - z[u][k + 1] for k in range(pp)] for u in range(U)]
    # cut k sits before the unit u where z[u][k] - z[u-1][k] = 1
    cut = [0.0] + [sum(problem.cut_s[u] * (z[u][k] - z[u - 1][k])
                       for u in range(1, U) if problem.cut_s[u]) for k in range(1, pp)]

    v = [[solver.NumVar(0, inf, f"v[{u},{k}]") for k in range(pp)] for u in range(U)]
    w = [[solver.NumVar(0, inf, f"w[{u},{k}]") for k in range(pp)] for u in range(U)]
    for u in range(U):
        for k in range(pp):
            solver.Add(v[u][k] >= A[u] - A_max[u] * (1 - y[u][k]), f"unit_time[{u},{k}]")
            solver.Add(w[u][k] >= G[u] - G_max[u] * (1 - y[u][k]), f"unit_once[{u},{k}]")
        solver.Add(sum(v[u]) >= A[u], f"unit_time_sum[{u}]")
        solver.Add(sum(w[u]) >= G[u], f"unit_once_sum[{u}]")
    stage_time = []  # T_k
    for k in range(pp):
        sends = (cut[k] if k > 0 else 0.0) + (cut[k + 1] if k + 1 < pp else 0.0)
        stage_time.append(sum(v[u][k] for u in range(U)) + sends)
        solver.Add(C >= stage_time[k], f"stage_time[{k}]")
        solver.Add(S >= sum(w[u][k] for u in range(U)), f"stage_once[{k}]")
    if budget is not None:
        for k in range(pp):
            q = [solver.NumVar(0, inf, f"q[{u},{k}]") for u in range(U)]
            for u in range(U):
                big = W_max[u] + flight[k] * V_max[u]
                solver.Add(q[u] >= W[u] + flight[k] * V[u] - big * (1 - y[u][k]),
                           f"unit_memory[{u},{k}]")
            solver.Add(sum(q) <= budget, f"memory[{k}]")

    objective = sum(stage_time) + (microbatches - 1) * C + S
    solver.Minimize(objective)
    if cutoff_s is not None:
        solver.Add(objective <= cutoff_s / unit_s, "cutoff")
    solver.SetSolverSpecificParametersAsString(
        f"limits/gap = {relative_gap}\n")
    solver.SetTimeLimit(max(1, int((time_limit_s - (time.perf_counter() - start)) * 1000)))
    status = solver.Solve()
    if status == pywraplp.Solver.NOT_SOLVED:
        raise TimeLimit(solver.Objective().BestBound() * unit_s)
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        return None

    choice = tuple(0 if len(row) == 1 else int(np.argmax([r.solution_value() for r in row]))
                   for row in x)
    starts = (0, *(next(u for u in range(U) if z[u][k].solution_value() > 0.5)
                   for k in range(1, pp)))
    times = evaluate(given, starts, choice, microbatches, schedule)
    return StageSolution(
        starts=starts, choice=choice, times=times,
        status="optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
        bound_s=min(solver.Objective().BestBound() * unit_s, times.step_s),
        seconds=time.perf_counter() - start, num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints())


def _time_unit_s(problem: StageProblem) -> float:
    largest = max((float(max(l.microbatch_s.max(), l.step_s.max())) for l in problem.layers),
                  default=0.0)
    for e in problem.edges:
        largest = max(largest, float(np.abs(e.cost_s).max(initial=0.0)))
    largest = max(largest, *problem.cut_s, 0.0)
    return largest if largest > 0.0 else 1.0


def _in_units(problem: StageProblem, unit_s: float) -> StageProblem:
    if unit_s == 1.0:
        return problem
    layers = tuple(replace(l, microbatch_s=l.microbatch_s / unit_s, step_s=l.step_s / unit_s)
                   for l in problem.layers)
    edges = tuple(replace(e, cost_s=np.asarray(e.cost_s, float) / unit_s)
                  for e in problem.edges)
    return replace(problem, layers=layers, edges=edges,
                   cut_s=tuple(c / unit_s for c in problem.cut_s))


def _solve_one_stage(problem: StageProblem, microbatches: int, schedule: str,
                     budget_bytes: float | None, time_limit_s: float,
                     cutoff_s: float | None, start: float) -> StageSolution | None:
    """One stage: no cut to choose, so the step is m·(Σ per-microbatch time) + Σ per-step
    time, additive over layers and edges. That is planner.ilp's problem exactly, whose
    reductions (dominance, additive-edge folding, reduced-cost fixing) prove it in well
    under a second where the stage MIP above took minutes on large models."""
    flight = in_flight(schedule, 1, microbatches, 0)
    nodes = tuple(
        Node(layer.name, tuple(
            Option(name, microbatches * float(layer.microbatch_s[i]) + float(layer.step_s[i]),
                   float(layer.weight_bytes[i]) + flight * float(layer.activation_bytes[i]))
            for i, name in enumerate(layer.strategies)))
        for layer in problem.layers)
    edges = tuple(Edge(e.src, e.dst, microbatches * np.asarray(e.cost_s, float))
                  for e in problem.edges)
    try:
        solution = ilp.solve(Problem(nodes, edges, budget_bytes), time_limit_s,
                             cutoff_s=cutoff_s)
    except Infeasible as error:  # nothing fits the budget, or nothing beats the cutoff
        if error.family not in ("memory", "cutoff"):
            raise  # a numerical problem in the model is a bug, not an answer
        return None
    times = evaluate(problem, (0,), solution.choice, microbatches, schedule)
    if cutoff_s is not None and times.step_s > cutoff_s:
        return None
    return StageSolution(
        starts=(0,), choice=solution.choice, times=times, status=solution.status,
        bound_s=min(solution.bound_s, times.step_s), seconds=time.perf_counter() - start,
        num_variables=solution.num_variables, num_constraints=solution.num_constraints)


def lower_bound(problem: StageProblem, pp: int, microbatches: int) -> float:
    """A bound no cut or strategy beats, without a solve. Each unit costs at least the sum of
    its layers' cheapest options and of the cheapest entry of each edge into it; the best
    contiguous split of those minima into pp stages (the linear-partition dynamic program,
    with the cut transfers) bounds the slowest stage; the per-step part is at least its
    smallest total shared evenly."""
    U = len(problem.units)
    a = np.zeros(U)
    for layer in problem.layers:
        a[layer.unit] += float(layer.microbatch_s.min())
    for e in problem.edges:
        a[problem.layers[e.dst].unit] += float(np.asarray(e.cost_s).min())
    once = sum(float(l.step_s.min()) for l in problem.layers) / pp
    if pp == 1:
        return microbatches * float(a.sum()) + once
    if pp > U:
        return math.inf
    prefix = np.concatenate([[0.0], np.cumsum(a)])
    cut = problem.cut_s
    # best[k][j]: the smallest possible slowest stage when units [0, j) form k stages,
    # counting the transfer at each stage's own cuts (the one at j is added by the caller)
    best = np.full((pp + 1, U + 1), math.inf)
    best[0][0] = 0.0
    for k in range(1, pp + 1):
        for j in range(k, U - (pp - k) + 1):
            out_cut = cut[j] if j < U else 0.0
            for i in range(k - 1, j):
                in_cut = cut[i] if i > 0 else 0.0
                stage = prefix[j] - prefix[i] + in_cut + out_cut
                value = max(best[k - 1][i], stage)
                if value < best[k][j]:
                    best[k][j] = value
    # Σ_k T_k is at least every unit's cheapest time; max_k T_k at least the best split's
    return float(a.sum()) + (microbatches - 1) * float(best[pp][U]) + once


def min_memory_bytes(problem: StageProblem, pp: int, microbatches: int, schedule: str) -> float:
    """A bound on the largest stage's memory: the smallest total, shared evenly, with the
    fewest microbatches any stage keeps in flight."""
    f = min(in_flight(schedule, pp, microbatches, k) for k in range(pp))
    total = sum(float((l.weight_bytes + f * l.activation_bytes).min()) for l in problem.layers)
    return total / pp
