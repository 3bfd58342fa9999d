"""The stage program: planner.pipeline.stages' stage cut and strategies as one integer program (SCIP
through pywraplp, edge variables continuous as in planner.ilp), on a problem whose times
are in units of its largest (StageProblem.in_units: SCIP drops coefficients below 1e-9). Each
family of variables and rows has one builder, named in the right column:

    x[l,s] ∈ {0,1}  layer l runs strategy s          Σ_s x[l,s] = 1                _strategies
    Σ_{s recomputed} x[l,s] equal for every layer l of a block offered recomputed
                    whole (planner.pipeline.block_recompute; StageProblem.linked_units)    _strategies
    A_u, G_u, W_u, V_u  unit u's per-microbatch time, per-step time, weight and
                    activation memory: linear in x and e                          _unit_sums
    e[k,i,j] ∈ [0,1] edge k's marginals equal x (as planner.ilp), where its cost
                    is not additive over its two ends                             _edge_time
    z[u,k] ∈ {0,1}  unit u lies in stage ≥ k         z[u,k] ≤ z[u+1,k],
                    z[u,k+1] ≤ z[u,k], every stage at least one unit                _cuts
    y[u,k] = z[u,k] - z[u,k+1]   unit u in stage k                                  _cuts
    v[u,k] ≥ A_u - Mᴬ_u (1 - y[u,k]),  Σ_k v[u,k] ≥ A_u  (the same for G with w)   _stage_times
    T_k = Σ_u v[u,k] + cut times (only where stages k-1, k sit on different ranks)
    C ≥ Σ_{k on r} T_k;  S ≥ Σ_{k on r} Σ_u w[u,k]                                 _stage_times
    Σ_{k on r} Σ_u q[u,k] ≤ budget,  q[u,k] ≥ W_u + f_k·V_u - Mᵐ_uk (1 - y[u,k])  _memory
    min Σ_k T_k + (m - 1)·C + S (one chunk per rank);
        m·C + κ·D + S, D ≥ T_k (chunks)                                             _objective
    m·C + S ≤ cutoff, and with one chunk Σ_{j<r} T_j + m·T_r + S ≤ cutoff            _objective

The big-M constants are each expression's own maximum, and Σ_k v[u,k] ≥ A_u hands the LP
the balanced-stage bound C ≥ Σ_u A_u / pp. What the objective stands in for, and why the
cutoff rows bound the simulated step, is planner.pipeline.stages' docstring; stages.solve_stages
decides when this program runs (one stage, or one stage per rank without linked blocks,
is solved exactly faster elsewhere), gives it its start and reads its answer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from ortools.linear_solver import pywraplp

from planner.numerics import mip_solver

_GB = 1e9


@dataclass
class StageProgram:
    """The built program and what its answer is read from."""

    solver: pywraplp.Solver
    x: list  # per layer: [1.0] (one option) or its BoolVars
    z: list  # per unit: [1.0, z[u,1], ..., z[u,S-1], 0.0]

    def hint(self, starts, choice) -> None:
        """Start the solve from a plan: stages starting at units `starts`, options `choice`."""
        variables, values = [], []
        for row, c in zip(self.x, choice):
            if len(row) > 1:
                variables += row
                values += [float(s == c) for s in range(len(row))]
        for u, row in enumerate(self.z):
            for k in range(1, len(row) - 1):
                if not isinstance(row[k], float):
                    variables.append(row[k])
                    values.append(float(u >= starts[k]))
        self.solver.SetHint(variables, values)

    def answer(self) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(stage starts, option per layer) of the solver's solution."""
        choice = tuple(0 if len(row) == 1 else int(np.argmax([r.solution_value() for r in row]))
                       for row in self.x)
        U, S = len(self.z), len(self.z[0]) - 1
        starts = (0, *(next(u for u in range(U) if self.z[u][k].solution_value() > 0.5)
                       for k in range(1, S)))
        return starts, choice


def build(problem, microbatches: int, flights, ranks, kappa: float | None,
          budget_bytes: float | None, cutoff: float | None, relative_gap: float
          ) -> StageProgram:
    """The program of `problem` (in time units) cut into len(ranks) stages, stage k on rank
    ranks[k] keeping flights[k] microbatches in flight; `kappa` the schedule's bubble in
    chunk times where ranks hold several stages (None: one each); `cutoff` in time units."""
    solver, _ = mip_solver(relative_gap)
    x = _strategies(solver, problem)
    sums = _unit_sums(solver, problem, x, budget_bytes is not None)
    z, y = _cuts(solver, len(problem.units), len(ranks))
    T, C, S = _stage_times(solver, problem, sums, z, y, ranks)
    if budget_bytes is not None:
        _memory(solver, sums, y, flights, ranks, budget_bytes / _GB)
    _objective(solver, T, C, S, microbatches, kappa, cutoff)
    return StageProgram(solver, x, z)


@dataclass
class _UnitSums:
    """Per unit: its time per microbatch (A), per step (G), weights (W) and activations (V)
    in GB, each an expression in x (a variable where it is long) with its largest value."""

    A: list
    G: list
    W: list
    V: list
    A_max: list
    G_max: list
    W_max: list
    V_max: list


def _strategies(solver, problem) -> list:
    """x: one option per layer; a block recomputed whole picks recomputed options in all
    its layers or in none."""
    x = []
    for i, layer in enumerate(problem.layers):
        n = len(layer.strategies)
        if n == 1:
            x.append([1.0])
            continue
        row = [solver.BoolVar(f"x[{i},{s}]") for s in range(n)]
        solver.Add(sum(row) == 1, f"one_strategy[{i}]")
        x.append(row)
    for u, members in problem.linked_units().items():
        picked = [sum(xi for xi, r in zip(x[i], problem.layers[i].recomputed) if r)
                  for i in members]
        for i, p in zip(members[1:], picked[1:]):
            solver.Add(p == picked[0], f"recompute_whole[{u},{i}]")
    return x


def _dot(values, xs):
    return sum(float(v) * xi for v, xi in zip(values, xs) if v != 0.0)


def _unit_sums(solver, problem, x, with_memory: bool) -> _UnitSums:
    """A, G, W, V of every unit (edges charged to their consumer's unit), each unit's sum
    one named variable: the big-M rows repeat them for every stage, and pywraplp reads an
    expression's terms again at every row (a 48-block GPT at pp 8 x 2 chunks: 2.4 s of
    rows built in Python, past the chunked MIP's 2 s, so SCIP never ran; named, the same
    rows are four terms each)."""
    U = len(problem.units)
    sums = _UnitSums(*([0.0] * U for _ in range(8)))
    for u, members in enumerate(problem.unit_layers()):
        for i in members:
            L = problem.layers[i]
            sums.A[u] += _dot(L.microbatch_s, x[i])
            sums.G[u] += _dot(L.step_s, x[i])
            sums.W[u] += _dot(L.weight_bytes / _GB, x[i])
            sums.V[u] += _dot(L.activation_bytes / _GB, x[i])
            sums.A_max[u] += float(L.microbatch_s.max())
            sums.G_max[u] += float(L.step_s.max())
            sums.W_max[u] += float(L.weight_bytes.max()) / _GB
            sums.V_max[u] += float(L.activation_bytes.max()) / _GB
    for k, edge in enumerate(problem.edges):
        cost = np.asarray(edge.cost_s, float)
        if cost.any():
            u = problem.layers[edge.dst].unit
            sums.A_max[u] += float(cost.max())
            sums.A[u] += _edge_time(solver, k, cost, x[edge.src], x[edge.dst])

    def named(expression, name: str):
        if isinstance(expression, (int, float)):
            return float(expression)
        var = solver.NumVar(-solver.infinity(), solver.infinity(), name)
        solver.Add(var == expression, f"{name}_sum")
        return var

    sums.A = [named(a, f"A[{u}]") for u, a in enumerate(sums.A)]
    sums.G = [named(g, f"G[{u}]") for u, g in enumerate(sums.G)]
    if with_memory:
        sums.W = [named(w, f"W[{u}]") for u, w in enumerate(sums.W)]
        sums.V = [named(a, f"V[{u}]") for u, a in enumerate(sums.V)]
    return sums


def _edge_time(solver, k: int, cost: np.ndarray, xs, xd):
    """Edge k's time: linear in one side where the other is fixed or the cost is additive
    over the two (no pair variables), else over its pair marginals e[k,i,j]."""
    if len(xs) == 1 or len(xd) == 1:
        return _dot(cost[:, 0], xs) if len(xd) == 1 else _dot(cost[0, :], xd)
    a, b = cost[:, 0], cost[0, :] - cost[0, 0]
    if np.abs(cost - a[:, None] - b[None, :]).max() <= 1e-12 * np.abs(cost).max():
        return _dot(a, xs) + _dot(b, xd)
    e = [[solver.NumVar(0, 1, f"e[{k},{i},{j}]") for j in range(len(xd))]
         for i in range(len(xs))]
    for i in range(len(xs)):
        solver.Add(sum(e[i]) == xs[i], f"edge_src[{k},{i}]")
    for j in range(len(xd)):
        solver.Add(sum(e[i][j] for i in range(len(xs))) == xd[j], f"edge_dst[{k},{j}]")
    return sum(float(cost[i, j]) * e[i][j] for i in range(len(xs)) for j in range(len(xd))
               if cost[i, j] != 0.0)


def _cuts(solver, U: int, S: int):
    """(z, y): z[u][k] = unit u in stage >= k (k = 1..S-1; 1 at k = 0, 0 at k = S), the
    stages contiguous, nested and none empty; y[u][k] = unit u in stage k."""
    z = [[1.0] + [solver.BoolVar(f"z[{u},{k}]") for k in range(1, S)] + [0.0]
         for u in range(U)]
    for k in range(1, S):
        solver.Add(z[0][k] == 0, f"first_unit_in_stage0[{k}]")
        solver.Add(z[U - 1][k] == 1, f"last_unit_in_last_stage[{k}]")
        for u in range(U - 1):
            solver.Add(z[u][k] <= z[u + 1][k], f"contiguous[{u},{k}]")
        if k + 1 < S:
            for u in range(U):
                solver.Add(z[u][k + 1] <= z[u][k], f"nested[{u},{k}]")
            solver.Add(sum(z[u][k] for u in range(U))
                       >= sum(z[u][k + 1] for u in range(U)) + 1, f"stage_nonempty[{k}]")
    y = [[z[u][k] - z[u][k + 1] for k in range(S)] for u in range(U)]
    return z, y


def _stage_times(solver, problem, sums: _UnitSums, z, y, ranks):
    """(T, C, S): each stage's time per microbatch T_k (its units' v and its cut
    transfers: cut k sits before the unit u where z[u][k] - z[u-1][k] = 1, and a cut
    between stages on one rank, the turn of a V, sends nothing), the busiest rank's C and
    the slowest rank's once-per-step S."""
    inf = solver.infinity()
    U, n = len(z), len(ranks)
    cut = [0.0] + [sum(problem.cut_s[u] * (z[u][k] - z[u - 1][k])
                       for u in range(1, U) if problem.cut_s[u])
                   if ranks[k - 1] != ranks[k] else 0.0 for k in range(1, n)]
    v = [[solver.NumVar(0, inf, f"v[{u},{k}]") for k in range(n)] for u in range(U)]
    w = [[solver.NumVar(0, inf, f"w[{u},{k}]") for k in range(n)] for u in range(U)]
    for u in range(U):
        for k in range(n):
            solver.Add(v[u][k] >= sums.A[u] - sums.A_max[u] * (1 - y[u][k]),
                       f"unit_time[{u},{k}]")
            solver.Add(w[u][k] >= sums.G[u] - sums.G_max[u] * (1 - y[u][k]),
                       f"unit_once[{u},{k}]")
        solver.Add(sum(v[u]) >= sums.A[u], f"unit_time_sum[{u}]")
        solver.Add(sum(w[u]) >= sums.G[u], f"unit_once_sum[{u}]")
    T = []
    for k in range(n):
        sends = ((cut[k] + problem.replay_s if k > 0 else 0.0)
                 + (cut[k + 1] if k + 1 < n else 0.0))
        T.append(sum(v[u][k] for u in range(U)) + sends)
    C = solver.NumVar(0, inf, "C")
    S = solver.NumVar(0, inf, "S")
    for r in range(max(ranks) + 1):
        on = [k for k in range(n) if ranks[k] == r]
        solver.Add(C >= sum(T[k] for k in on), f"rank_time[{r}]")
        solver.Add(S >= sum(w[u][k] for u in range(U) for k in on), f"rank_once[{r}]")
    return T, C, S


def _memory(solver, sums: _UnitSums, y, flights, ranks, budget_gb: float) -> None:
    """Each rank's weights and activations in flight within the budget, q[u][k] the
    memory of unit u where it sits in stage k."""
    inf = solver.infinity()
    for r in range(max(ranks) + 1):
        q = []
        for k in (k for k in range(len(ranks)) if ranks[k] == r):
            for u in range(len(y)):
                q.append(solver.NumVar(0, inf, f"q[{u},{k}]"))
                big = sums.W_max[u] + flights[k] * sums.V_max[u]
                solver.Add(q[-1] >= sums.W[u] + flights[k] * sums.V[u] - big * (1 - y[u][k]),
                           f"unit_memory[{u},{k}]")
        solver.Add(sum(q) <= budget_gb, f"memory[{r}]")


def _objective(solver, T, C, S, m: int, kappa: float | None, cutoff: float | None) -> None:
    """The linear stand-in for the step (module docstring) and, with `cutoff`, the rows
    no plan that beats it can break."""
    if kappa is None:
        objective = sum(T) + (m - 1) * C + S
    else:
        D = solver.NumVar(0, solver.infinity(), "D")  # the largest stage: fill and drain
        for k, t in enumerate(T):
            solver.Add(D >= t, f"stage_time[{k}]")
        objective = m * C + kappa * D + S
    solver.Minimize(objective)
    if cutoff is None:
        return
    solver.Add(m * C + S <= cutoff, "cutoff")
    if kappa is None:
        for r in range(1, len(T)):
            solver.Add(sum(T[:r]) + m * T[r] + S <= cutoff, f"cutoff[{r}]")
