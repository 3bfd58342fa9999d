"""The integer program that picks one strategy per layer.

    min  Σ_n Σ_i t[n,i]·x[n,i]  +  Σ_k Σ_(i,j) c[k,i,j]·e[k,i,j]
    s.t. Σ_i x[n,i] = 1                            one_strategy[n]
         Σ_j e[k,i,j] = x[src(k),i]                edge_src[k,i]
         Σ_i e[k,i,j] = x[dst(k),j]                edge_dst[k,j]
         Σ_n Σ_i m[n,i]·x[n,i] ≤ budget            memory
         x binary,  e continuous in [0, 1]

At integral x the marginal constraints force e[k,i,j] = x[src,i]·x[dst,j], so e needs no
integrality; on a tree without the memory row the LP relaxation is already integral.

Before the integer program is built, the problem shrinks by steps that each keep an
optimal answer (REDUCTIONS): single-option nodes become constants, edges whose cost splits
into a producer part plus a consumer part fold into node times, dominated options go, a
memory row nobody can break goes, and options whose LP bound exceeds the cost of a known
plan go (reduced-cost fixing, with GLOP's LP and a rounded plan). The answer is mapped
back to the indices of the original options. OR-Tools' SCIP backend solves the integer
program (CBC when SCIP is missing).
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass, field, replace

import numpy as np
from ortools.linear_solver import pywraplp

from planner.numerics import mip_solver, time_unit_s
from planner.problem import Infeasible, Problem, Solution
from planner.ties import expand, merge_ties

# Each keeps an optimal answer; leaving one out only makes the integer program bigger.
REDUCTIONS = frozenset(
    {
        "fix_single_option",  # a node with one option is a constant, not a binary
        "fold_additive_edges",  # c[i,j] = a[i] + b[j] (all-zero included) moves into node times
        "drop_dominated",  # an option no better in time, memory and every edge row goes
        "drop_slack_memory",  # a memory row that even the largest assignment meets goes
        "reduced_cost_fixing",  # an option whose LP bound exceeds a known plan's cost goes
    }
)

RELATIVE_GAP = 1e-9  # "optimal" means proven to this relative gap
_GB = 1e9


def solve(
    problem: Problem,
    time_limit_s: float = 60.0,
    *,
    reductions: Collection[str] = REDUCTIONS,
    cutoff_s: float | None = None,
) -> Solution:
    """Pick one option per node minimising total time within the memory budget.

    Example::

        solution = solve(problem, time_limit_s=10)
        solution.choice  # one index per node, into that node's original options
        solution.status, solution.objective_s, solution.bound_s  # "optimal": bound == objective

    Raises `Infeasible` (family "memory") when even the smallest-memory option of every
    node exceeds the budget. With `cutoff_s` only plans faster than it are of interest
    (a search that holds a better plan elsewhere): raises `Infeasible` (family "cutoff")
    as soon as the LP bound, or the search, proves there is none. `reductions` is for
    measuring them; leave the default.
    """
    start = time.perf_counter()
    if problem.ties:  # solved as one node per tie group, answered per original node
        merged, picks = merge_ties(problem)
        solution = solve(merged, time_limit_s, reductions=reductions, cutoff_s=cutoff_s)
        choice = expand(solution.choice, picks, len(problem.nodes))
        return replace(solution, choice=choice, objective_s=problem.cost_of(choice))
    _validate(problem, reductions)
    if not problem.nodes:
        return Solution((), 0.0, 0.0, "optimal", time.perf_counter() - start, "none")
    _check_memory_fits(problem)
    unit_s = time_unit_s(problem.times())
    cutoff = None if cutoff_s is None else cutoff_s / unit_s
    solution = _solve_in_units(_forbidden_as_penalty(problem, unit_s).in_units(unit_s),
                               time_limit_s, frozenset(reductions), start, cutoff)
    solution = _from_units(solution, problem, unit_s)
    if not math.isfinite(solution.objective_s):
        raise Infeasible(_unrealizable_message(problem, solution.choice), family="layout")
    return solution


def _unrealizable_message(problem: Problem, choice) -> str:
    """Which data flow no assignment can realize: an edge every pair of whose options is
    infinite, or else the first infinite one of the solver's best assignment, by name."""
    hopeless = [e for e in problem.edges if not np.isfinite(e.cost_s).any()]
    chosen = [e for e in problem.edges
              if not math.isfinite(float(e.cost_s[choice[e.src], choice[e.dst]]))]
    edge = (hopeless or chosen)[0]
    src, dst = problem.nodes[edge.src], problem.nodes[edge.dst]
    gives = sorted({o.gives or o.strategy for o in src.options})
    takes = sorted({o.takes or o.strategy for o in dst.options})
    more = len(hopeless or chosen) - 1
    return (f"every assignment needs a layout change that cannot be made: {src.name!r} "
            f"gives {' or '.join(gives)} and {dst.name!r} takes {' or '.join(takes)}"
            + (f" ({more} more such edges)" if more else "")
            + "; an op outside modules of a torch.export graph runs on what each rank "
              "holds (a module hands its output on split by rows) and cannot change layouts")


# --- time units --------------------------------------------------------------------------
# SCIP treats coefficients below 1e-9 as zero (numerics/epsilon). A layer of a small model
# takes a microsecond, a pointwise op a nanosecond: in seconds the solver would ignore them
# and report objectives that disagree with the plan. The solver therefore works in units of
# the largest single time in the problem (numerics.time_unit_s, Problem.in_units, as the
# stage MIP does); the answer comes back in seconds.

_SECONDS_KEYS = ("lp_bound_s", "heuristic_s", "solver_objective_s")


# An infinite edge cost marks a pair of options that cannot meet (a layout change the
# executor cannot make). The solver sees a penalty this many time units high: more than
# any plan of a million layers costs, so never chosen while another plan exists.
_FORBIDDEN_UNITS = 1e6


def _forbidden_as_penalty(problem: Problem, unit_s: float) -> Problem:
    if all(np.isfinite(e.cost_s).all() for e in problem.edges):
        return problem
    edges = tuple(replace(e, cost_s=np.where(np.isfinite(e.cost_s), e.cost_s,
                                             _FORBIDDEN_UNITS * unit_s))
                  for e in problem.edges)
    return replace(problem, edges=edges)


def _from_units(solution: Solution, problem: Problem, unit_s: float) -> Solution:
    stats = dict(solution.stats)
    for key in _SECONDS_KEYS:
        if stats.get(key) is not None:
            stats[key] *= unit_s
    stats["time_unit_s"] = unit_s
    objective_s = problem.cost_of(solution.choice)
    bound_s = objective_s if solution.status == "optimal" else min(
        solution.bound_s * unit_s, objective_s)
    return replace(solution, objective_s=objective_s, bound_s=bound_s, stats=stats)


def _solve_in_units(problem: Problem, time_limit_s: float, reductions: frozenset[str],
                    start: float, cutoff: float | None = None) -> Solution:
    """solve() on a problem whose times are already scaled to the solver's units."""
    reduced = _reduce(problem, reductions)
    incumbent = _heuristic_choice(reduced)
    if "reduced_cost_fixing" in reductions and reduced.free_nodes():
        incumbent = _reduced_cost_fixing(reduced, problem, incumbent)
        _simplify(reduced, reductions)
        incumbent = _within_kept(reduced, incumbent)
        lp_bound = reduced.stats.get("lp_bound_s", -math.inf)
        if cutoff is not None and lp_bound > cutoff * (1 + RELATIVE_GAP):
            raise _cut_off(lp_bound, cutoff)

    solver, backend = mip_solver()
    model = _Model(solver, reduced)
    _variables(model)
    _one_strategy_per_node(model)
    _edge_consistency(model)
    _memory_limit(model)
    _objective(model)
    _cutoff(model, cutoff)
    _hint(model, incumbent)
    status = _solve(model, time_limit_s - (time.perf_counter() - start))
    return _read(model, status, problem, incumbent, backend, start)


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
        cost = np.asarray(edge.cost_s, float)
        if np.isnan(cost).any() or (cost == -np.inf).any():
            raise ValueError(f"edge {k} has a NaN or -inf entry in cost_s; +inf (a pair "
                             f"that cannot meet) is the only non-finite cost allowed")
    budget = problem.memory_budget_bytes
    if budget is not None and math.isnan(budget):
        raise ValueError("memory_budget_bytes is NaN; give bytes per device or None")


def _check_memory_fits(problem: Problem) -> None:
    """Memory is the only constraint that couples nodes, so the problem is feasible exactly
    when the smallest-memory option of every node fits."""
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
    A fixed node has one option and no edges; its cost is in `constant_s`. Any assignment
    of kept options costs `constant_s` + its reduced cost, exactly as in the original."""

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

    def keep_only(self, n: int, alive: np.ndarray, incident: list[tuple[int, int]]) -> None:
        """Drop node n's options where `alive` is False, from the node and its edges."""
        self.keep[n] = self.keep[n][alive]
        self.time_s[n] = self.time_s[n][alive]
        self.memory_bytes[n] = self.memory_bytes[n][alive]
        for u, v in incident:
            cost = self.edges[(u, v)]
            self.edges[(u, v)] = cost[alive, :] if u == n else cost[:, alive]


def _reduce(problem: Problem, reductions: frozenset[str]) -> _Reduced:
    r = _Reduced(
        names=_unique_names(problem),
        keep=[np.arange(len(node.options)) for node in problem.nodes],
        time_s=[np.array([o.time_s for o in node.options], float) for node in problem.nodes],
        memory_bytes=[
            np.array([o.memory_bytes for o in node.options], float) for node in problem.nodes
        ],
        fixed=[False] * len(problem.nodes),
        edges={},
        budget_bytes=problem.memory_budget_bytes,
    )
    r.stats = {"dropped_dominated": 0, "fixed_nodes": 0, "folded_edges": 0, "passes": 0}

    # Parallel edges add up and a self-loop is a diagonal: neither needs its own variables.
    for edge in problem.edges:
        cost = np.asarray(edge.cost_s, float)
        if edge.src == edge.dst:
            r.time_s[edge.src] = r.time_s[edge.src] + np.diag(cost)
            continue
        if edge.src < edge.dst:
            key = (edge.src, edge.dst)
        else:
            key, cost = (edge.dst, edge.src), cost.T
        r.edges[key] = r.edges[key] + cost if key in r.edges else cost.copy()

    _simplify(r, reductions)
    return r


def _simplify(r: _Reduced, reductions: frozenset[str]) -> None:
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


def _unique_names(problem: Problem) -> list[str]:
    """Node names for the model's rows and columns; CBC aborts the process on a repeated
    name, so a repeated node name gets its index."""
    seen: dict[str, int] = {}
    for node in problem.nodes:
        seen[node.name] = seen.get(node.name, 0) + 1
    return [
        node.name if seen[node.name] == 1 else f"{node.name}#{n}"
        for n, node in enumerate(problem.nodes)
    ]


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
        if np.abs(residual).max() > 1e-12 * np.abs(cost).max():
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
        r.keep_only(n, alive, by_node[n])
        r.stats["dropped_dominated"] += int((~alive).sum())
        changed = True
    return changed


def _heuristic_choice(r: _Reduced) -> tuple[int, ...]:
    """A feasible plan (original option indices): fastest option per node if that fits,
    else smallest memory, which fits whenever anything does."""
    fastest = [int(keep[np.argmin(t)]) for keep, t in zip(r.keep, r.time_s)]
    if r.budget_bytes is None or _free_memory(r, fastest) <= r.budget_bytes:
        return tuple(fastest)
    return tuple(int(keep[np.argmin(m)]) for keep, m in zip(r.keep, r.memory_bytes))


def _within_kept(r: _Reduced, choice: tuple[int, ...]) -> tuple[int, ...]:
    """`choice` with each option that dominance dropped replaced by the node's
    smallest-memory kept option: its dominator has no more memory, so neither has that one,
    and the plan still fits."""
    return tuple(
        c if c in keep else int(keep[np.argmin(memory)])
        for c, keep, memory in zip(choice, r.keep, r.memory_bytes)
    )


def _free_memory(r: _Reduced, choice: tuple[int, ...] | list[int]) -> float:
    """Memory of the free nodes' part of `choice` (original indices)."""
    return math.fsum(
        r.memory_bytes[n][np.searchsorted(r.keep[n], choice[n])] for n in r.free_nodes()
    )


def _reduced_cost_fixing(
    r: _Reduced, problem: Problem, incumbent: tuple[int, ...]
) -> tuple[int, ...]:
    """Solve the LP relaxation (GLOP, fast), round it to a plan of cost U, and drop every
    option whose LP bound when chosen exceeds U: no plan better than U can use it.

    The bound is recomputed here from GLOP's duals, whatever their accuracy: for any row
    duals y (μ ≤ 0 on the memory row), z(x) ≥ y·b + μ·β + Σ_n min_i rc[n,i] + Σ_k min rc_e[k]
    holds for every plan, with rc = c - Aᵀy; choosing option i of node n replaces node n's
    minimum by rc[n,i]. Returns the better of the rounded plan and `incumbent`."""
    lp = pywraplp.Solver.CreateSolver("GLOP")
    if lp is None:
        return incumbent
    # Dual simplex: 4x fewer seconds than GLOP's default primal on a 3,000-node chain.
    lp.SetSolverSpecificParametersAsString("use_dual_simplex:true")
    model = _Model(lp, r)
    _variables(model, integer=False)
    _one_strategy_per_node(model)
    _edge_consistency(model)
    _memory_limit(model)
    _objective(model)
    if lp.Solve() != pywraplp.Solver.OPTIMAL:
        return incumbent

    # The bound, from the duals, in the model's (scaled) units.
    free = list(model.x)
    y_one = {n: model.rows[("one", n)].dual_value() for n in free}
    mu = min(0.0, model.rows["memory"].dual_value()) if "memory" in model.rows else 0.0
    rc = {n: r.time_s[n] - y_one[n] - mu * model.memory_coefficients.get(n, 0.0) for n in free}
    min_e = 0.0
    for k, (u, v) in enumerate(model.e):
        y_src = np.array([row.dual_value() for row in model.rows[("src", k)]])
        y_dst = np.array([row.dual_value() for row in model.rows[("dst", k)]])
        rc[u] = rc[u] + y_src
        rc[v] = rc[v] + y_dst
        min_e += float((r.edges[(u, v)] - y_src[:, None] - y_dst[None, :]).min())
    lower = (
        r.constant_s
        + math.fsum(y_one.values())
        + mu * model.memory_rhs
        + min_e
        + math.fsum(rc[n].min() for n in free)
    )

    # U: the LP solution rounded (each node's largest value), made to fit, improved.
    rounded = {n: int(np.argmax([v.solution_value() for v in xs])) for n, xs in model.x.items()}
    plan = list(incumbent)
    for n, i in _local_search(r, rounded).items():
        plan[n] = int(r.keep[n][i])
    budget = problem.memory_budget_bytes
    fits = budget is None or problem.memory_of(plan) <= budget
    best = min((tuple(plan), incumbent) if fits else (incumbent,), key=problem.cost_of)
    upper = problem.cost_of(best)

    margin = RELATIVE_GAP * max(1.0, abs(upper))  # to drop: generous, keeps more
    proven = upper - lower <= RELATIVE_GAP * abs(upper)  # to stop: strictly relative
    by_node = r.incident()
    dropped = 0
    for n in free:
        keep = r.keep[n]
        chosen = np.searchsorted(keep, best[n])
        if proven:  # the LP bound proves the plan optimal: keep just it
            alive = np.arange(len(keep)) == chosen
        else:
            alive = lower - rc[n].min() + rc[n] <= upper + margin
            alive[chosen] = True  # the plan itself stays, whatever the rounding says
        if not alive.all():
            r.keep_only(n, alive, by_node[n])
            dropped += int((~alive).sum())
    r.stats.update(
        dropped_by_reduced_cost=dropped,
        lp_bound_s=float(lower),
        heuristic_s=upper,
        lp_wall_s=lp.wall_time() / 1e3,
    )
    return best


def _local_search(r: _Reduced, start: dict[int, int], sweeps: int = 5) -> dict[int, int]:
    """A good plan near `start` (kept-option index per free node): while over budget, make
    the move to a smaller-memory option that costs least time per byte still needed; then
    sweep the nodes, each to its fastest option that fits given its neighbours, while any
    sweep helps."""
    plan = dict(start)
    by_node = r.incident()

    def local_cost(n: int) -> np.ndarray:  # time of each option of n, neighbours as planned
        cost = r.time_s[n].copy()
        for u, v in by_node[n]:
            cost += r.edges[(u, v)][:, plan[v]] if u == n else r.edges[(u, v)][plan[u], :]
        return cost

    budget = r.budget_bytes
    used = math.fsum(r.memory_bytes[n][i] for n, i in plan.items())
    if budget is not None and used > budget:
        # Every (node, option) move in flat arrays; a move's cost per byte counts at most
        # the bytes still missing, so one move that closes the gap cheaply beats a string
        # of small ones that each look cheap per byte.
        nodes = list(plan)
        offset = dict(zip(nodes, np.cumsum([0] + [len(r.keep[n]) for n in nodes])))
        extra = np.zeros(offset[nodes[-1]] + len(r.keep[nodes[-1]]))
        saved = np.zeros_like(extra)

        def update(n: int) -> None:
            cost = local_cost(n)
            at = slice(offset[n], offset[n] + len(cost))
            extra[at] = cost - cost[plan[n]]
            saved[at] = r.memory_bytes[n][plan[n]] - r.memory_bytes[n]

        for n in nodes:
            update(n)
        owner = np.repeat(nodes, [len(r.keep[n]) for n in nodes])
        while used > budget:
            useful = saved > 0
            if not useful.any():
                break
            counted = np.minimum(np.where(useful, saved, 1.0), used - budget)
            score = np.where(useful, extra / counted, np.inf)
            move = int(np.argmin(score))
            n = int(owner[move])
            used -= saved[move]
            plan[n] = move - offset[n]
            update(n)
            for u, v in by_node[n]:
                update(v if u == n else u)
        if used > budget:  # rounding left it over: the smallest-memory plan always fits
            plan = {n: int(np.argmin(r.memory_bytes[n])) for n in plan}
            used = math.fsum(r.memory_bytes[n][i] for n, i in plan.items())

    for _ in range(sweeps):
        improved = False
        for n in plan:
            cost = local_cost(n)
            if budget is not None:
                room = budget - (used - r.memory_bytes[n][plan[n]])
                cost = np.where(r.memory_bytes[n] <= room, cost, np.inf)
            i = int(np.argmin(cost))
            if cost[i] < cost[plan[n]]:
                used += r.memory_bytes[n][i] - r.memory_bytes[n][plan[n]]
                plan[n] = i
                improved = True
        if not improved:
            break
    return plan


# --- the model ---------------------------------------------------------------------------


@dataclass
class _Model:
    solver: pywraplp.Solver
    reduced: _Reduced
    x: dict[int, list] = field(default_factory=dict)  # free node -> one var per kept option
    e: dict[tuple[int, int], np.ndarray] = field(default_factory=dict)  # edge -> var matrix
    rows: dict = field(default_factory=dict)  # ("one", n), ("src", k), ("dst", k), "memory"
    memory_coefficients: dict[int, np.ndarray] = field(default_factory=dict)
    memory_rhs: float = 0.0


def _variables(m: _Model, integer: bool = True) -> None:
    r = m.reduced
    for n in r.free_nodes():
        m.x[n] = [m.solver.Var(0.0, 1.0, integer, f"x[{r.names[n]},{o}]") for o in r.keep[n]]
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
        m.rows[("one", n)] = row


def _edge_consistency(m: _Model) -> None:
    for k, ((u, v), e) in enumerate(m.e.items()):
        m.rows[("src", k)] = []
        for i, x_ui in enumerate(m.x[u]):
            row = m.solver.Constraint(0.0, 0.0, f"edge_src[{k},{i}]")
            row.SetCoefficient(x_ui, -1.0)
            for var in e[i, :]:
                row.SetCoefficient(var, 1.0)
            m.rows[("src", k)].append(row)
        m.rows[("dst", k)] = []
        for j, x_vj in enumerate(m.x[v]):
            row = m.solver.Constraint(0.0, 0.0, f"edge_dst[{k},{j}]")
            row.SetCoefficient(x_vj, -1.0)
            for var in e[:, j]:
                row.SetCoefficient(var, 1.0)
            m.rows[("dst", k)].append(row)


def _memory_limit(m: _Model) -> None:
    """Σ m·x ≤ budget, written as Σ (m - min m)·x ≤ budget - Σ min m and divided by the
    largest coefficient: bytes up to 1e12 become numbers in [0, 1], whatever the units."""
    r = m.reduced
    if r.budget_bytes is None:
        return
    free = list(m.x)
    spread = {n: r.memory_bytes[n] - r.memory_bytes[n].min() for n in free}
    scale = max((s.max() for s in spread.values()), default=0.0)
    if scale <= 0.0:
        return  # every option of every free node has the same memory, and it fits
    slack = r.budget_bytes - math.fsum(r.memory_bytes[n].min() for n in free)
    m.memory_rhs = slack / scale
    row = m.solver.Constraint(-m.solver.infinity(), m.memory_rhs, "memory")
    for n in free:
        m.memory_coefficients[n] = spread[n] / scale
        for var, coefficient in zip(m.x[n], m.memory_coefficients[n]):
            if coefficient:
                row.SetCoefficient(var, float(coefficient))
    m.rows["memory"] = row
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


def _cutoff(m: _Model, cutoff: float | None) -> None:
    """objective ≤ cutoff: lets the solver discard every branch that cannot beat it."""
    if cutoff is None:
        return
    objective = m.solver.Objective()
    row = m.solver.Constraint(-m.solver.infinity(), cutoff - m.reduced.constant_s, "cutoff")
    for var in m.solver.variables():
        coefficient = objective.GetCoefficient(var)
        if coefficient:
            row.SetCoefficient(var, coefficient)
    m.rows["cutoff"] = row


def _cut_off(bound: float, cutoff: float) -> Infeasible:
    # in the solver's units: only the fact matters to the caller, which knows its cutoff
    return Infeasible(f"no plan is faster than the cutoff (bound {bound:.6g} >= cutoff "
                      f"{cutoff:.6g}, in units of the largest time)", family="cutoff")


def _hint(m: _Model, choice: tuple[int, ...]) -> None:
    r = m.reduced
    at = {n: int(np.searchsorted(r.keep[n], choice[n])) for n in m.x}
    variables, values = [], []
    for n, xs in m.x.items():
        variables += xs
        values += [float(i == at[n]) for i in range(len(xs))]
    for (u, v), e in m.e.items():
        product = np.zeros(e.shape)
        product[at[u], at[v]] = 1.0
        variables += list(e.ravel())
        values += list(product.ravel())
    m.solver.SetHint(variables, values)


def _solve(m: _Model, time_limit_s: float) -> int:
    m.solver.SetTimeLimit(max(1, int(time_limit_s * 1000)))
    params = pywraplp.MPSolverParameters()
    params.SetDoubleParam(params.RELATIVE_MIP_GAP, RELATIVE_GAP)
    return m.solver.Solve(params)


def _read(
    m: _Model,
    status: int,
    problem: Problem,
    incumbent: tuple[int, ...],
    backend: str,
    start: float,
) -> Solution:
    r = m.reduced
    solver = m.solver
    if status == pywraplp.Solver.INFEASIBLE and "cutoff" in m.rows:
        raise _cut_off(math.inf, m.rows["cutoff"].ub() + r.constant_s)
    if status == pywraplp.Solver.INFEASIBLE:
        # _check_memory_fits passed, so the smallest-memory assignment satisfies every row.
        raise Infeasible(
            f"the solver found no assignment although the smallest-memory one fits "
            f"(status {status}); a numerical problem in the model",
            family="model",
        )
    # Bounds on the reduced problem: the solver's, else every node and edge at its cheapest.
    cheapest = (
        r.constant_s
        + math.fsum(r.time_s[n].min() for n in r.free_nodes())
        + math.fsum(c.min() for c in r.edges.values())
    )
    if status in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE):
        choice = list(incumbent)
        for n, xs in m.x.items():
            choice[n] = int(r.keep[n][int(np.argmax([v.solution_value() for v in xs]))])
        for n in range(len(r.names)):
            if r.fixed[n]:
                choice[n] = int(r.keep[n][0])
        choice = tuple(choice)
        solver_objective = r.constant_s + solver.Objective().Value()
        solver_bound = r.constant_s + solver.Objective().BestBound()
        reduced_bound = max(solver_bound, cheapest)  # SCIP says -1e20 before its first LP
    else:
        # Time ran out before any incumbent (CBC takes no hint): answer with the heuristic.
        choice = incumbent
        solver_objective = None
        reduced_bound = cheapest
    # Reduced-cost fixing dropped only options of plans dearer than its plan (heuristic_s),
    # so a bound on the reduced problem holds for the original up to that cost; the LP
    # bound holds for the original as it stands.
    bound = max(
        min(reduced_bound, r.stats.get("heuristic_s", math.inf)),
        r.stats.get("lp_bound_s", -math.inf),
    )

    choice = prefer_less_memory(problem, choice)
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

    # The gap is the solver's own measure, so compare the bound with the solver's
    # objective, not with the recomputed one.
    reference = solver_objective if solver_objective is not None else objective_s
    closed = reference - bound <= RELATIVE_GAP * max(abs(reference), 1e-9)
    if closed or status == pywraplp.Solver.OPTIMAL:
        status_name = "optimal"
        bound_s = objective_s if closed else min(bound, objective_s)
    else:
        status_name, bound_s = "feasible", min(bound, objective_s)

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


def prefer_less_memory(problem: Problem, choice: tuple[int, ...]) -> tuple[int, ...]:
    """Among plans of the same time, the one that uses less memory: move a node to an option
    with less memory wherever that costs no time, given its neighbours' options.

    Why: ties are common (a model input split by rows or passed whole costs the same when
    the first layer slices it locally), and the solver breaks them arbitrarily; the user
    should not have to load the whole batch on every device for nothing. Each move keeps
    the objective and lowers memory, so the answer stays optimal and within budget."""
    choice = list(choice)
    incident: list[list] = [[] for _ in problem.nodes]
    for edge in problem.edges:
        incident[edge.src].append(edge)
        if edge.dst != edge.src:
            incident[edge.dst].append(edge)

    def local_s(n: int, option: int) -> float:
        total = problem.nodes[n].options[option].time_s
        for edge in incident[n]:
            i = option if edge.src == n else choice[edge.src]
            j = option if edge.dst == n else choice[edge.dst]
            total += float(edge.cost_s[i, j])
        return total

    for n, node in enumerate(problem.nodes):
        now_s = local_s(n, choice[n])
        slack = 1e-12 * max(1.0, abs(now_s))
        for option in sorted(range(len(node.options)), key=lambda o: node.options[o].memory_bytes):
            if node.options[option].memory_bytes >= node.options[choice[n]].memory_bytes:
                break
            if local_s(n, option) <= now_s + slack:
                choice[n] = option
                break
    return tuple(choice)
