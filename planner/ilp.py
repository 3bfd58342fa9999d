"""The integer program that picks one strategy per layer.

    min  Σ_n Σ_i t[n,i]·x[n,i]  +  Σ_k Σ_(i,j) c[k,i,j]·e[k,i,j]
    s.t. Σ_i x[n,i] = 1                            one_strategy[n]
         Σ_j e[k,i,j] = x[src(k),i]                edge_src[k]
         Σ_i e[k,i,j] = x[dst(k),j]                edge_dst[k]
         Σ_n Σ_i m[n,i]·x[n,i] ≤ budget            memory
         x binary,  e continuous in [0, 1]

At integral x the marginal constraints force e[k,i,j] = x[src,i]·x[dst,j], so e needs no
integrality; on a tree without the memory row the LP relaxation is already integral.

Before building the model, `_reduce` shrinks the problem with steps that each keep an
optimal answer reachable (see REDUCTIONS); the answer is mapped back to the indices of the
original options. OR-Tools' SCIP backend solves it (CBC when SCIP is missing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field

import numpy as np
from ortools.linear_solver import pywraplp

from planner.problem import Infeasible, Problem, Solution

# Each keeps the optimum: dropping one only makes the model bigger.
REDUCTIONS = frozenset(
    {
        "fix_single_option",  # a node with one option is a constant, not a binary
        "fold_additive_edges",  # c[i,j] = a[i] + b[j] (all-zero included) moves into node times
        "drop_dominated",  # an option no better in time, memory and every edge row is dropped
        "drop_slack_memory",  # a memory row that even the largest assignment meets is dropped
    }
)

RELATIVE_GAP = 1e-9  # "optimal" means proven to this relative gap
FEASIBILITY_TOL = 1e-9  # SCIP's numerics/feastol, in the scaled memory units below
_GB = 1e9


def solve(
    problem: Problem,
    time_limit_s: float = 60.0,
    *,
    reductions: Collection[str] = REDUCTIONS,
) -> Solution:
    """Pick one option per node minimising total time within the memory budget.

    >>> solution = solve(problem, time_limit_s=10)
    >>> solution.choice, solution.status, solution.objective_s, solution.bound_s

    Raises `Infeasible` (family "memory") when even the smallest-memory option of every
    node exceeds the budget. `reductions` is for measuring them; leave the default.
    """
    start = time.perf_counter()
    _validate(problem, reductions)
    if not problem.nodes:
        return Solution((), 0.0, 0.0, "optimal", time.perf_counter() - start, "none")
    _check_memory_fits(problem)

    reduced = _reduce(problem, frozenset(reductions))
    solver, backend = _create_solver()
    model = _Model(solver, reduced)
    _variables(model)
    _one_strategy_per_node(model)
    _edge_consistency(model)
    _memory_limit(model)
    _objective(model)
    _hint(model, _heuristic_choice(reduced))
    status = _solve(model, time_limit_s - (time.perf_counter() - start))
    return _read(model, status, problem, backend, start)


# --- input checks ------------------------------------------------------------------------


def _validate(problem: Problem, reductions: Collection[str]) -> None:
    unknown = set(reductions) - REDUCTIONS
    if unknown:
        raise ValueError(f"unknown reductions {sorted(unknown)}; valid: {sorted(REDUCTIONS)}")
    for node in problem.nodes:
        if not node.options:
            raise ValueError(f"node {node.name!r} has no options; give it at least one")
        for option in node.options:
            if not (math.isfinite(option.time_s) and math.isfinite(option.memory_bytes)):
                raise ValueError(
                    f"node {node.name!r} option {option.strategy!r} has time_s="
                    f"{option.time_s}, memory_bytes={option.memory_bytes}; both must be finite"
                )
    n = len(problem.nodes)
    for k, edge in enumerate(problem.edges):
        if not (0 <= edge.src < n and 0 <= edge.dst < n):
            raise ValueError(f"edge {k} joins {edge.src} -> {edge.dst}; nodes are 0..{n - 1}")
        shape = (len(problem.nodes[edge.src].options), len(problem.nodes[edge.dst].options))
        if np.shape(edge.cost_s) != shape:
            raise ValueError(f"edge {k} has cost_s of shape {np.shape(edge.cost_s)}, needs {shape}")
        if not np.all(np.isfinite(edge.cost_s)):
            raise ValueError(f"edge {k} has a non-finite entry in cost_s")
    budget = problem.memory_budget_bytes
    if budget is not None and math.isnan(budget):
        raise ValueError("memory_budget_bytes is NaN; give bytes per device or None")


def _check_memory_fits(problem: Problem) -> None:
    """The only coupling constraint is memory, so the problem is feasible exactly when the
    smallest-memory option of every node fits."""
    budget = problem.memory_budget_bytes
    if budget is None:
        return
    smallest = [min(o.memory_bytes for o in node.options) for node in problem.nodes]
    needed = math.fsum(smallest)
    if needed <= budget:
        return
    largest = sorted(range(len(smallest)), key=lambda n: -smallest[n])[:3]
    names = ", ".join(f"{problem.nodes[n].name} {_gb(smallest[n])}" for n in largest)
    raise Infeasible(
        f"needs at least {_gb(needed)} per device (every layer at its smallest-memory "
        f"strategy), has {_gb(budget)}; largest layers: {names}; "
        "add devices, allow more sharding, or shrink the batch",
        family="memory",
    )


def _gb(num_bytes: float) -> str:
    gb = num_bytes / _GB
    return f"{gb:.1f} GB" if abs(gb) >= 0.1 else f"{gb:.3g} GB"


# --- reductions --------------------------------------------------------------------------


@dataclass
class _Reduced:
    """The problem after reductions. Node n keeps original options `keep[n]`; `time_s[n]`
    and `memory_bytes[n]` are per kept option, with folded edge costs added to the times.
    A fixed node has one option and no edges; its cost is in `constant_s`."""

    names: list[str]
    keep: list[np.ndarray]
    time_s: list[np.ndarray]
    memory_bytes: list[np.ndarray]
    fixed: list[bool]
    edges: dict[tuple[int, int], np.ndarray]  # (u, v) with u < v -> cost over kept options
    constant_s: float = 0.0
    budget_bytes: float | None = None  # left for the free nodes; None: no memory row
    stats: dict = field(default_factory=dict)

    def free_nodes(self) -> list[int]:
        return [n for n, fixed in enumerate(self.fixed) if not fixed]

    def incident(self) -> list[list[tuple[int, int]]]:
        by_node: list[list[tuple[int, int]]] = [[] for _ in self.names]
        for u, v in self.edges:
            by_node[u].append((u, v))
            by_node[v].append((u, v))
        return by_node


def _reduce(problem: Problem, reductions: frozenset[str]) -> _Reduced:
    r = _Reduced(
        names=[node.name for node in problem.nodes],
        keep=[np.arange(len(node.options)) for node in problem.nodes],
        time_s=[np.array([o.time_s for o in node.options], float) for node in problem.nodes],
        memory_bytes=[
            np.array([o.memory_bytes for o in node.options], float) for node in problem.nodes
        ],
        fixed=[False] * len(problem.nodes),
        edges={},
        budget_bytes=problem.memory_budget_bytes,
    )
    r.stats = {"dropped_options": 0, "fixed_nodes": 0, "folded_edges": 0, "passes": 0}

    # Parallel edges add up and a self-loop is a diagonal: neither needs its own variables.
    for edge in problem.edges:
        cost = np.asarray(edge.cost_s, float)
        if edge.src == edge.dst:
            r.time_s[edge.src] = r.time_s[edge.src] + np.diag(cost)
            continue
        key, cost = ((edge.src, edge.dst), cost) if edge.src < edge.dst else (
            (edge.dst, edge.src),
            cost.T,
        )
        r.edges[key] = r.edges[key] + cost if key in r.edges else cost.copy()

    # Each step can enable another (a dropped option makes an edge additive, a folded edge
    # makes an option dominated), so repeat until nothing changes.
    changed = True
    while changed:
        r.stats["passes"] += 1
        changed = False
        if "drop_slack_memory" in reductions:
            changed |= _drop_slack_memory(r)
        if "fold_additive_edges" in reductions:
            changed |= _fold_additive_edges(r)
        if "fix_single_option" in reductions:
            changed |= _fix_single_option_nodes(r)
        if "drop_dominated" in reductions:
            changed |= _drop_dominated(r)
    return r


def _drop_slack_memory(r: _Reduced) -> bool:
    if r.budget_bytes is None:
        return False
    largest = math.fsum(r.memory_bytes[n].max() for n in r.free_nodes())
    if largest > r.budget_bytes:
        return False
    r.budget_bytes = None
    r.stats["memory_row_dropped"] = True
    return True


def _fold_additive_edges(r: _Reduced) -> bool:
    """c[i,j] = a[i] + b[j] (an all-zero matrix, a constant, or a cost that depends on one
    side only) costs the same whatever the other side picks: add a to u, b to v."""
    changed = False
    for (u, v), cost in list(r.edges.items()):
        a = cost[:, 0]
        b = cost[0, :] - cost[0, 0]
        residual = cost - a[:, None] - b[None, :]
        if np.abs(residual).max() > 1e-12 * max(1.0, np.abs(cost).max()):
            continue
        r.time_s[u] = r.time_s[u] + a
        r.time_s[v] = r.time_s[v] + b
        del r.edges[(u, v)]
        r.stats["folded_edges"] += 1
        changed = True
    return changed


def _fix_single_option_nodes(r: _Reduced) -> bool:
    """A node with one option is a constant: its edges become costs on its neighbours'
    options, its memory comes off the budget."""
    changed = False
    by_node = r.incident()
    for n in r.free_nodes():
        if len(r.keep[n]) != 1:
            continue
        for u, v in by_node[n]:
            if (u, v) not in r.edges:
                continue
            cost = r.edges.pop((u, v))
            if u == n:
                r.time_s[v] = r.time_s[v] + cost[0, :]
            else:
                r.time_s[u] = r.time_s[u] + cost[:, 0]
        r.constant_s += float(r.time_s[n][0])
        if r.budget_bytes is not None:
            r.budget_bytes -= float(r.memory_bytes[n][0])
        r.fixed[n] = True
        r.stats["fixed_nodes"] += 1
        changed = True
    return changed


def _drop_dominated(r: _Reduced) -> bool:
    """Option a of a node is dominated by option b when b is no worse in time, in memory
    (while a memory row exists) and in every entry of every incident edge's cost row: any
    answer using a stays as good, and within memory, with b instead. Of equal options the
    lower index stays."""
    changed = False
    by_node = r.incident()
    for n in r.free_nodes():
        k = len(r.keep[n])
        if k < 2:
            continue
        columns = [r.time_s[n][:, None]]
        if r.budget_bytes is not None:
            columns.append(r.memory_bytes[n][:, None])
        for u, v in by_node[n]:
            columns.append(r.edges[(u, v)] if u == n else r.edges[(u, v)].T)
        f = np.hstack(columns)  # one row of facts per option; lower is better
        no_worse = np.all(f[:, None, :] <= f[None, :, :], axis=2)  # [b, a]: b ≤ a everywhere
        better = np.any(f[:, None, :] < f[None, :, :], axis=2)
        earlier = np.arange(k)[:, None] < np.arange(k)[None, :]
        dominates = no_worse & (better | earlier)
        np.fill_diagonal(dominates, False)
        alive = ~dominates.any(axis=0)
        if alive.all():
            continue
        r.keep[n] = r.keep[n][alive]
        r.time_s[n] = r.time_s[n][alive]
        r.memory_bytes[n] = r.memory_bytes[n][alive]
        for u, v in by_node[n]:
            if u == n:
                r.edges[(u, v)] = r.edges[(u, v)][alive, :]
            else:
                r.edges[(u, v)] = r.edges[(u, v)][:, alive]
        r.stats["dropped_options"] += int((~alive).sum())
        changed = True
    return changed


def _heuristic_choice(r: _Reduced) -> dict[int, int]:
    """A feasible start (kept-option index per free node): fastest per node if that fits,
    else smallest memory, which fits whenever anything does."""
    free = r.free_nodes()
    fastest = {n: int(np.argmin(r.time_s[n])) for n in free}
    if r.budget_bytes is None or math.fsum(
        r.memory_bytes[n][i] for n, i in fastest.items()
    ) <= r.budget_bytes:
        return fastest
    return {n: int(np.argmin(r.memory_bytes[n])) for n in free}


# --- the model ---------------------------------------------------------------------------


@dataclass
class _Model:
    solver: pywraplp.Solver
    reduced: _Reduced
    x: dict[int, list] = field(default_factory=dict)  # free node -> one var per kept option
    e: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # edge -> var matrix


def _create_solver() -> tuple[pywraplp.Solver, str]:
    solver = pywraplp.Solver.CreateSolver("SCIP")
    if solver is not None:
        # The memory row is scaled to coefficients ≤ 1; the default 1e-6 would let it
        # overflow by a millionth of the largest per-layer memory spread.
        solver.SetSolverSpecificParametersAsString(f"numerics/feastol = {FEASIBILITY_TOL}\n")
        return solver, "SCIP"
    solver = pywraplp.Solver.CreateSolver("CBC")
    if solver is None:
        raise RuntimeError("OR-Tools has neither SCIP nor CBC; reinstall ortools")
    return solver, "CBC"


def _variables(m: _Model) -> None:
    r = m.reduced
    for n in r.free_nodes():
        m.x[n] = [m.solver.BoolVar(f"x[{r.names[n]},{o}]") for o in r.keep[n]]
    for k, ((u, v), cost) in enumerate(r.edges.items()):
        m.e[(u, v)] = np.array(
            [
                [m.solver.NumVar(0.0, 1.0, f"e[{k},{i},{j}]") for j in range(cost.shape[1])]
                for i in range(cost.shape[0])
            ],
            dtype=object,
        )


def _one_strategy_per_node(m: _Model) -> None:
    for n, xs in m.x.items():
        row = m.solver.Constraint(1.0, 1.0, f"one_strategy[{m.reduced.names[n]}]")
        for var in xs:
            row.SetCoefficient(var, 1.0)


def _edge_consistency(m: _Model) -> None:
    for k, ((u, v), e) in enumerate(m.e.items()):
        for i, x_ui in enumerate(m.x[u]):
            row = m.solver.Constraint(0.0, 0.0, f"edge_src[{k}]")
            row.SetCoefficient(x_ui, -1.0)
            for var in e[i, :]:
                row.SetCoefficient(var, 1.0)
        for j, x_vj in enumerate(m.x[v]):
            row = m.solver.Constraint(0.0, 0.0, f"edge_dst[{k}]")
            row.SetCoefficient(x_vj, -1.0)
            for var in e[:, j]:
                row.SetCoefficient(var, 1.0)


def _memory_limit(m: _Model) -> None:
    """Σ m·x ≤ budget, written as Σ (m - min m)·x ≤ budget - Σ min m and divided by the
    largest coefficient: bytes up to 1e12 become numbers in [0, 1], whatever the units."""
    r = m.reduced
    if r.budget_bytes is None:
        return
    free = r.free_nodes()
    spread = [r.memory_bytes[n] - r.memory_bytes[n].min() for n in free]
    scale = max((s.max() for s in spread), default=0.0)
    slack = r.budget_bytes - math.fsum(r.memory_bytes[n].min() for n in free)
    if scale <= 0.0:
        return  # every option of every free node has the same memory, and it fits
    row = m.solver.Constraint(-m.solver.infinity(), slack / scale, "memory")
    for n, s in zip(free, spread):
        for var, coefficient in zip(m.x[n], s / scale):
            if coefficient:
                row.SetCoefficient(var, float(coefficient))
    r.stats["memory_scale_bytes"] = float(scale)


def _objective(m: _Model) -> None:
    objective = m.solver.Objective()
    for n, xs in m.x.items():
        for var, t in zip(xs, m.reduced.time_s[n]):
            objective.SetCoefficient(var, float(t))
    for key, e in m.e.items():
        for var, c in zip(e.ravel(), m.reduced.edges[key].ravel()):
            if c:
                objective.SetCoefficient(var, float(c))
    objective.SetMinimization()


def _hint(m: _Model, choice: dict[int, int]) -> None:
    variables, values = [], []
    for n, xs in m.x.items():
        variables += xs
        values += [float(i == choice[n]) for i in range(len(xs))]
    for (u, v), e in m.e.items():
        product = np.zeros(e.shape)
        product[choice[u], choice[v]] = 1.0
        variables += list(e.ravel())
        values += list(product.ravel())
    m.solver.SetHint(variables, values)


def _solve(m: _Model, time_limit_s: float) -> int:
    m.solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, RELATIVE_GAP)
    return m.solver.Solve(params)


def _read(m: _Model, status: int, problem: Problem, backend: str, start: float) -> Solution:
    r = m.reduced
    solver = m.solver
    if status == pywraplp.Solver.INFEASIBLE:
        # _check_memory_fits passed, so the smallest-memory assignment satisfies every row.
        raise Infeasible(
            f"the solver found no assignment although the smallest-memory one fits "
            f"(status {status}); a numerical problem in the model",
            family="model",
        )
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        picked = {n: max(range(len(xs)), key=lambda i: xs[i].solution_value()) for n, xs in m.x.items()}
        solver_objective = r.constant_s + solver.Objective().Value()
        solver_bound = r.constant_s + solver.Objective().BestBound()
    else:
        # Time ran out before any incumbent (CBC takes no hint): answer with the heuristic
        # and the trivial bound, each layer and edge at its cheapest.
        picked = _heuristic_choice(r)
        solver_objective = None
        solver_bound = (
            r.constant_s
            + math.fsum(r.time_s[n].min() for n in r.free_nodes())
            + math.fsum(c.min() for c in r.edges.values())
        )

    choice = tuple(
        int(r.keep[n][picked[n]] if n in picked else r.keep[n][0]) for n in range(len(r.names))
    )
    objective_s = problem.cost_of(choice)
    if solver_objective is not None:
        assert math.isclose(objective_s, solver_objective, rel_tol=1e-6, abs_tol=1e-9), (
            f"solver objective {solver_objective} disagrees with the recomputed {objective_s}"
        )
    if problem.memory_budget_bytes is not None:
        used = problem.memory_of(choice)
        assert used <= problem.memory_budget_bytes * (1 + 1e-9) + 1e-9, (
            f"choice uses {used} bytes, budget {problem.memory_budget_bytes}"
        )

    # The gap is the solver's own measure, so compare its bound with its objective, not
    # with the recomputed one.
    reference = solver_objective if solver_objective is not None else objective_s
    closed = reference - solver_bound <= RELATIVE_GAP * max(abs(reference), 1e-9)
    if closed or status == pywraplp.Solver.OPTIMAL:
        status_name = "optimal"
        bound_s = objective_s if closed else min(solver_bound, objective_s)
    else:
        status_name, bound_s = "feasible", min(solver_bound, objective_s)

    stats = dict(r.stats)
    stats.update(
        solver_status=int(status),
        solver_objective_s=solver_objective,
        solver_wall_s=solver.wall_time() / 1000.0,
        free_nodes=len(m.x),
        edges_in_model=len(m.e),
    )
    return Solution(
        choice=choice,
        objective_s=objective_s,
        bound_s=bound_s,
        status=status_name,
        seconds=time.perf_counter() - start,
        backend=backend,
        num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
        stats=stats,
    )
