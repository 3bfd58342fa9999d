"""Pipeline stages for one mesh shape: cut the layers into contiguous stages and pick each
layer's strategy over its tensor-parallel group, for the fastest pipelined step that fits.

The data is free of torch (like planner.problem), so tests can compare the integer program
with brute force. Layers come in `units` (runs of layers owned by one top-level module, in
topological order); a stage is a contiguous run of units. With `v` chunks per rank
(virtual stages, planner.pipeline.schedules) there are pp·v stages, stage k on rank
placement(k); with v = 1, stage k is rank k.

The price of a cut is the simulation of the schedule's own action lists
(planner.pipeline.schedules.price: the same one the timeline picture draws):

    step  =  makespan(schedule, T_0 .. T_{pp·v-1})  +  max_r Σ_{k on r} S_k

The integer program cannot hold a simulation; it minimises a linear stand-in, `objective`:

    GPipe, 1F1B   Σ_k T_k  +  (m - 1) · max_k T_k  +  max_k S_k     (GPipe: the makespan
                  exactly; 1F1B: an upper bound, exact for balanced stages)
    v > 1         m · max_r R_r  +  κ · max_k T_k  +  max_r Σ_{k on r} S_k
                  R_r = Σ_{k on r} T_k, κ the schedule's bubble in chunk times with equal
                  chunks (schedules.uniform_bubble); the fill and drain go at the pace of
                  the largest chunk (with the mean instead, the program cut chunks of one
                  module, and the simulated bubble came back as large as 1F1B's)

and `lower_bound` and the cutoff use bounds the simulation cannot beat (a rank does all its
work m·R_r; with one stage per rank, rank r also waits Σ_{j<r} T_j for the first forward
to reach it and the last backward to leave). Its terms:

    T_k   per-microbatch time of stage k: its layers' forward + backward on one microbatch,
          the collectives inside its tp group, the layout changes on edges into its layers,
          and the point-to-point transfers at its cuts (forward activation + its gradient)
    S_k   once per step: the gradient all-reduce over the dp group and the optimizer

The first microbatch crosses every stage, forward and back (Σ_k T_k); the other m - 1
follow at the pace of the slowest stage. With balanced stages this is the textbook
(m + pp - 1)·T; with unbalanced ones it is what the schedule takes, where pricing every
stage at the slowest one's pace over-priced a 2-stage MLP (one 16 M-parameter layer against
4 M) by 60% on 2 processes.

Memory per device of rank r: weights, gradients and optimizer state of its stages' layers
plus each layer's activations times the microbatches the schedule keeps in flight at its
stage (GPipe: all m; 1F1B: min(m, pp - k), the first stage the most; the others: counted
from their action lists, schedules.in_flight).

The integer program that minimises `objective` over the cut and the options is
planner.pipeline.stage_mip (its variables and rows, each family with its builder). With one stage
there is no cut to choose and the step is additive over layers and edges: that is
planner.ilp's problem, solved there with its reductions (seconds to minutes faster on
large models); with one stage per rank and no linked blocks, planner.pipeline.stage_dp and
planner.pipeline.stage_intervals solve it exactly by dynamic programming.
"""

from __future__ import annotations

import functools
import itertools
import math
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

import numpy as np
from ortools.linear_solver import pywraplp

from planner import ilp
from planner.pipeline import (
    held_row, schedules, stage_dp, stage_intervals, stage_loads, stage_mip, unit_least,
)
from planner.numerics import time_unit_s
from planner.per_object import once_per_object
from planner.problem import Edge, Infeasible, Node, Option, Problem
from planner.pipeline.schedules import SCHEDULES

# the dynamic program's share of a solve before the integer program takes over: it proves
# small and medium pipelines in well under it, and on the largest (a 48-block GPT at pp 8)
# it would take minutes (planner.pipeline.stage_dp), so it must give up early
DP_SECONDS = 1.0
# units x stages of a stage program that Python writes in a second, about (its rows are
# per unit and stage): a 405 B Llama at pp 32 (129 units) took some 8 s before SCIP ran.
# A solve with less time left than its rows need keeps its start plan, where it has one
MIP_UNIT_STAGES_PER_S = 500


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
    # per option: is it the block-recomputed variant (planner.pipeline.block_recompute)? None: no
    # such variants. Recomputed options follow the plain ones, in the same order.
    recomputed: np.ndarray | None = None
    # per option, what the second memory row reads (planner.pipeline.held_row): of
    # weight_bytes the optimizer temporaries, and what its FSDP group gathers (0 where
    # none); None: zeros
    temp_bytes: np.ndarray | None = None
    gathered_bytes: np.ndarray | None = None

    def plain_index(self, c: int) -> int:
        """The plain option that recomputed option `c` checkpoints (`c` itself if plain)."""
        if self.recomputed is None or not self.recomputed[c]:
            return c
        return c - int((~self.recomputed).sum())


@dataclass(frozen=True)
class StageProblem:
    """Layers in topological order, grouped in `units`; `edges` price layout changes per
    microbatch (charged to the consumer's stage); `cut_s[u]` is the point-to-point time per
    microbatch (activation forward, its gradient backward) of a cut right before unit u;
    `replay_s` is what every stage but the first computes again per microbatch (a
    torch.export model's stages each rerun its positions, causal mask and rotary tables:
    executor.hf_stages), whatever the cut; `split_backward` is how much longer the layers
    run under a schedule that splits the backward into input and weight gradients
    (schedules.SPLIT_BACKWARD), measured on the model (profiler.whole_step), and
    `forward_share` the forward's share of a stage's per-microbatch time (schedules.parts;
    profiler.whole_step.forward_share), which every timeline and bound here follows."""

    layers: tuple[LayerOptions, ...]
    edges: tuple[Edge, ...]
    units: tuple[str, ...]
    cut_s: tuple[float, ...]
    replay_s: float = 0.0
    split_backward: float = 1.0
    forward_share: float = 1 / 3

    def for_schedule(self, schedule: str) -> "StageProblem":
        """The problem as `schedule` runs it: the layers' per-microbatch times longer by
        `split_backward` where it splits the backward (its transfers and per-step parts
        as they are). Every solver and evaluate() price a schedule through this."""
        if schedule not in schedules.SPLIT_BACKWARD or self.split_backward == 1.0:
            return self
        return self._split

    @functools.cached_property
    def _split(self) -> "StageProblem":
        f = self.split_backward
        longer = once_per_object(lambda t: t * f)  # shared arrays stay shared (tables)
        return replace(self, layers=tuple(replace(l, microbatch_s=longer(l.microbatch_s))
                                          for l in self.layers),
                       split_backward=1.0)

    @functools.cached_property
    def tables(self) -> "_Tables":
        """The options as padded arrays, made once: the bounds read them for every
        microbatch count and schedule of a shape (hundreds of times in a search)."""
        return _Tables.of(self)

    def times(self) -> Iterator[float]:
        """Every layer's, edge's and transfer's time: what planner.numerics.time_unit_s
        reads."""
        return itertools.chain(
            (t for l in self.layers for t in (l.microbatch_s.max(), l.step_s.max())),
            (c for e in self.edges for c in np.asarray(e.cost_s, float).ravel()),
            self.cut_s, (self.replay_s,))

    def in_units(self, unit_s: float) -> StageProblem:
        """The problem with every time in units of `unit_s` (the stage MIP's units)."""
        if unit_s == 1.0:
            return self
        layers = tuple(replace(l, microbatch_s=l.microbatch_s / unit_s,
                               step_s=l.step_s / unit_s) for l in self.layers)
        edges = tuple(replace(e, cost_s=np.asarray(e.cost_s, float) / unit_s)
                      for e in self.edges)
        return replace(self, layers=layers, edges=edges,
                       cut_s=tuple(c / unit_s for c in self.cut_s),
                       replay_s=self.replay_s / unit_s)

    def unit_layers(self) -> list[list[int]]:
        out: list[list[int]] = [[] for _ in self.units]
        for i, layer in enumerate(self.layers):
            out[layer.unit].append(i)
        return out

    def recomputable_units(self) -> dict[int, list[int]]:
        """{unit: its layers with recomputed options}: a block checkpointed whole
        (planner.pipeline.block_recompute)."""
        out: dict[int, list[int]] = {}
        for i, layer in enumerate(self.layers):
            if layer.recomputed is not None:
                out.setdefault(layer.unit, []).append(i)
        return out

    def linked_units(self) -> dict[int, list[int]]:
        """{unit: its layers with recomputed variants beside plain ones}: a block the solve
        may checkpoint, so its layers pick recomputed options all together or none. A
        block recomputed whatever the solve picks (every option recomputed: a job's
        "full" activation checkpointing) links nothing."""
        return {u: members for u, members in self.recomputable_units().items()
                if not all(self.layers[i].recomputed.all() for i in members)}

    def recomputed_units(self, choice) -> tuple[int, ...]:
        """The units whose layers run their recomputed options under `choice`."""
        return tuple(u for u, members in self.recomputable_units().items()
                     if self.layers[members[0]].recomputed[choice[members[0]]])

    def consistent(self, choice) -> bool:
        """Does `choice` recompute each linked unit's layers all together or not at all?"""
        return all(len({bool(self.layers[i].recomputed[choice[i]]) for i in members}) == 1
                   for members in self.linked_units().values())


# LayerOptions' per-option arrays, in its order after `strategies`: what tells a layer's
# options apart in the tables (identical layers share them: planner.search.build)
ARRAY_FIELDS = ("microbatch_s", "step_s", "weight_bytes", "activation_bytes", "recomputed",
                "temp_bytes", "gathered_bytes")
_ARRAYS_OF = attrgetter(*ARRAY_FIELDS)


@dataclass(frozen=True)
class _Tables:
    """A StageProblem's options padded to one width (time +inf, memory 0 past a layer's
    own), each distinct layer once (a transformer's blocks repeat) with its count per
    unit, and the least of each per layer and unit."""

    microbatch_s: np.ndarray  # (distinct, width)
    step_s: np.ndarray
    weight_bytes: np.ndarray
    activation_bytes: np.ndarray
    counts: np.ndarray  # (distinct, units): how many of each distinct layer a unit holds
    layer_least_s: np.ndarray  # per unit: Σ its layers' least microbatch time
    edge_least_s: np.ndarray  # per unit: Σ the least entry of each edge into it
    # per unit: its layers' and its edges' least taken together (planner.pipeline.unit_least), at
    # least layer_least_s + edge_least_s: what the bounds charge a unit per microbatch
    unit_least_s: np.ndarray
    unit_step_least_s: np.ndarray  # per unit: Σ its layers' least per-step time
    # (distinct, width): may the option be taken with the unit's layers all plain / all
    # recomputed (a block checkpointed whole: planner.pipeline.block_recompute)? Both True for every
    # option of a layer without recomputed variants.
    plain_ok: np.ndarray
    recomputed_ok: np.ndarray
    # (distinct, width): weight_bytes without the optimizer temporaries, and the bytes the
    # option's FSDP group gathers (planner.pipeline.held_row; 0 past a layer's own)
    rest_bytes: np.ndarray
    gathered_bytes: np.ndarray

    @staticmethod
    def of(problem: "StageProblem") -> "_Tables":
        U = len(problem.units)
        width = max(len(l.strategies) for l in problem.layers)
        # layers sharing their arrays (a transformer's blocks: planner.search.build) are
        # one row from the start; np.unique below merges equal values of the rest
        first: dict[tuple, int] = {}
        rep = np.array([first.setdefault(tuple(map(id, _ARRAYS_OF(l))), len(first))
                        for l in problem.layers])
        distinct = [problem.layers[i] for i in np.unique(rep, return_index=True)[1]]
        L = len(distinct)
        mb, step = np.full((L, width), math.inf), np.full((L, width), math.inf)
        w, a = np.zeros((L, width)), np.zeros((L, width))
        temp, gathered = np.zeros((L, width)), np.zeros((L, width))
        recomputed = np.full((L, width), 0.5)  # 0 plain, 1 recomputed, 0.5 either
        for i, l in enumerate(distinct):
            n = len(l.strategies)
            mb[i, :n], step[i, :n] = l.microbatch_s, l.step_s
            w[i, :n], a[i, :n] = l.weight_bytes, l.activation_bytes
            if l.recomputed is not None:
                recomputed[i, :n] = l.recomputed
            if l.temp_bytes is not None:
                temp[i, :n] = l.temp_bytes
            if l.gathered_bytes is not None:
                gathered[i, :n] = l.gathered_bytes
        unit = np.array([l.unit for l in problem.layers])
        layer_least = np.bincount(unit, weights=mb.min(axis=1)[rep], minlength=U)
        # padding is +inf, never the least
        step_by_unit = np.bincount(unit, weights=step.min(axis=1)[rep], minlength=U)
        # each edge's least into its consumer's unit, in the edges' order (as a loop adding
        # them would), each distinct matrix's least taken once
        least = once_per_object(lambda cost: float(np.asarray(cost).min()))
        edge_least = np.bincount(
            unit[[e.dst for e in problem.edges]].reshape(-1),
            weights=np.array([least(e.cost_s) for e in problem.edges], float).reshape(-1),
            minlength=U) if problem.edges else np.zeros(U)
        rows, inverse = np.unique(np.concatenate([mb, step, w, a, recomputed, w - temp,
                                                  gathered], 1), axis=0, return_inverse=True)
        counts = np.zeros((len(rows), U))
        np.add.at(counts, (inverse.ravel()[rep], unit), 1.0)
        mb, step, w, a, recomputed, rest, gathered = np.split(rows, 7, axis=1)
        joint = np.maximum(unit_least.unit_least_s(problem), layer_least + edge_least)
        return _Tables(mb, step, w, a, counts, layer_least, edge_least, joint, step_by_unit,
                       plain_ok=recomputed < 1, recomputed_ok=recomputed > 0,
                       rest_bytes=rest, gathered_bytes=gathered)

    @property
    def step_least_s(self) -> float:
        """Σ over layers of the least per-step time."""
        return float(self.unit_step_least_s.sum())

    def least_by_unit(self, priced: np.ndarray) -> np.ndarray:
        """(..., distinct, width) prices of the options -> (..., units): Σ over each
        unit's layers of the least price, a block recomputed whole taking the lesser of
        its layers all plain and all recomputed. Against each layer's least apart this is
        what the linked choice costs at least: a Lagrangian price of memory (the bounds
        below) would otherwise recompute a block's costly-to-keep layers alone, a
        selective recompute the executor does not run (a 70 B Llama, 4-chunk interleaved
        schedules: bounds some 20% under the plans)."""
        plain = _sum_by_unit(np.where(self.plain_ok, priced, math.inf).min(axis=-1),
                             self.counts)
        recomputed = _sum_by_unit(np.where(self.recomputed_ok, priced, math.inf)
                                  .min(axis=-1), self.counts)
        return np.minimum(plain, recomputed)

    def least_memory_by_unit(self, f: int) -> np.ndarray:
        """Per unit: Σ over its layers of the least weights + f·activations."""
        valid = np.isfinite(self.microbatch_s)
        return self.least_by_unit(np.where(valid, self.weight_bytes + f * self.activation_bytes,
                                           math.inf))


def _sum_by_unit(least: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """(..., distinct) -> (..., units) through the counts, +inf where a unit holds a layer
    at +inf (not inf·0 = nan where it holds none)."""
    finite = np.isfinite(least)
    total = np.where(finite, least, 0.0) @ counts
    return np.where((~finite).astype(float) @ counts > 0, math.inf, total)


def in_flight(schedule: str, pp: int, microbatches: int, stage: int, chunks: int = 1) -> int:
    """Microbatches whose activations global stage `stage` holds at once: GPipe runs every
    forward before any backward; 1F1B starts backward after pp - stage forwards; the
    multi-chunk schedules as their action lists say (planner.pipeline.schedules.in_flight)."""
    if schedule == "GPipe" and chunks == 1:
        return microbatches
    if schedule == "1F1B" and chunks == 1:
        return min(microbatches, pp - stage)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {SCHEDULES}")
    return _flights(schedule, pp, chunks, microbatches)[stage]


@functools.lru_cache(maxsize=4096)
def _flights(schedule: str, pp: int, chunks: int, microbatches: int) -> tuple[int, ...]:
    """schedules.in_flight, once per shape: it walks the action lists, and the search asks
    every stage of hundreds of shapes (5 s of a 10 s search before this cache)."""
    return schedules.in_flight(schedule, pp, chunks, microbatches)


@functools.lru_cache(maxsize=4096)
def _uniform_bubble(schedule: str, pp: int, chunks: int, microbatches: int,
                    forward: float = 1 / 3) -> float:
    """schedules.uniform_bubble (a simulation of the action lists), once per shape."""
    return schedules.uniform_bubble(schedule, pp, chunks, microbatches, forward)


def stage_ranks(schedule: str, pp: int, chunks: int) -> tuple[int, ...]:
    """The pipeline rank of each of the pp·chunks stages."""
    if chunks == 1:
        return tuple(range(pp))
    return schedules.placement(schedule, pp, chunks)


@dataclass(frozen=True)
class StageTimes:
    """A full assignment priced by the cost model (what evaluate() returns). Per-stage
    tuples run over the pp·chunks global stages; memory_bytes over the pp ranks."""

    step_s: float  # simulated makespan + the slowest rank's once-per-step part
    microbatch_s: tuple[float, ...]  # T_k
    send_s: tuple[float, ...]  # the cut part of T_k
    once_s: tuple[float, ...]  # S_k
    weight_bytes: tuple[float, ...]
    activation_bytes: tuple[float, ...]  # already times the microbatches in flight
    objective_s: float = 0.0  # the integer program's linear stand-in for step_s
    bubble_s: float = 0.0  # the busiest rank's idle time in the simulated schedule
    ranks: tuple[int, ...] = ()  # pipeline rank of each stage

    @property
    def memory_bytes(self) -> tuple[float, ...]:
        """Per pipeline rank: the stages it holds, weights and activations in flight."""
        ranks = self.ranks or tuple(range(len(self.weight_bytes)))
        out = [0.0] * (max(ranks) + 1)
        for r, w, a in zip(ranks, self.weight_bytes, self.activation_bytes):
            out[r] += w + a
        return tuple(out)


def evaluate(problem: StageProblem, starts: tuple[int, ...], choice, microbatches: int,
             schedule: str, chunks: int = 1) -> StageTimes:
    """The cost model, plainly: price stages starting at units `starts` (starts[0] == 0,
    pp·chunks of them) with strategy `choice[l]` per layer by simulating the schedule; also
    the integer program's objective for the same assignment, which it must match."""
    problem = problem.for_schedule(schedule)
    S = len(starts)
    pp = S // chunks
    ranks = stage_ranks(schedule, pp, chunks)
    bounds = list(starts) + [len(problem.units)]
    stage_of_unit = [k for k in range(S) for _ in range(bounds[k], bounds[k + 1])]
    stage = [stage_of_unit[layer.unit] for layer in problem.layers]
    mb = [0.0] * S
    once = [0.0] * S
    weights = [0.0] * S
    acts = [0.0] * S
    flight = [in_flight(schedule, pp, microbatches, k, chunks) for k in range(S)]
    for i, layer in enumerate(problem.layers):
        c, k = choice[i], stage[i]
        mb[k] += float(layer.microbatch_s[c])
        once[k] += float(layer.step_s[c])
        weights[k] += float(layer.weight_bytes[c])
        acts[k] += float(layer.activation_bytes[c]) * flight[k]
    for e in problem.edges:
        mb[stage[e.dst]] += float(e.cost_s[choice[e.src], choice[e.dst]])
    send = [0.0] * S
    for k in range(1, S):
        if ranks[k - 1] != ranks[k]:  # the turn of a V stays on one rank
            t = problem.cut_s[starts[k]]
            send[k - 1] += t
            send[k] += t
    total = [a + b + (problem.replay_s if k else 0.0) for k, (a, b) in enumerate(zip(mb, send))]
    once_rank = [sum(once[k] for k in range(S) if ranks[k] == r) for r in range(pp)]
    sim = schedules.price(schedule, pp, chunks, microbatches, total,
                          forward=problem.forward_share, record=False)
    step = sim.makespan_s + max(once_rank)
    if chunks == 1:
        objective = sum(total) + (microbatches - 1) * max(total) + max(once_rank)
    else:
        load = [sum(total[k] for k in range(S) if ranks[k] == r) for r in range(pp)]
        kappa = _uniform_bubble(schedule, pp, chunks, microbatches, problem.forward_share)
        objective = microbatches * max(load) + kappa * max(total) + max(once_rank)
    return StageTimes(step, tuple(total), tuple(send), tuple(once), tuple(weights), tuple(acts),
                      objective, sim.busiest_bubble_s, ranks)


def brute_force(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                budget_bytes: float | None, chunks: int = 1):
    """(StageTimes, starts, choice) of the assignment with the least objective (what the
    integer program minimises) by enumeration, or None when nothing fits; for tests on
    small instances."""
    return brute_force_budgets(problem, pp, microbatches, schedule, [budget_bytes], chunks)[0]


def brute_force_budgets(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                        budgets: Sequence[float | None], chunks: int = 1) -> list:
    """`brute_force` under each of `budgets` (None: no budget), in one enumeration."""
    best: list = [None] * len(budgets)
    U = len(problem.units)
    linked = sorted(problem.linked_units())

    def choices():
        """Every assignment that recomputes each linked unit whole or not at all."""
        for picked in itertools.product((False, True), repeat=len(linked)):
            on = {u for u, p in zip(linked, picked) if p}
            yield from itertools.product(*(
                range(len(l.strategies)) if l.unit not in linked else
                np.flatnonzero(l.recomputed == (l.unit in on)) for l in problem.layers))

    for cuts in itertools.combinations(range(1, U), pp * chunks - 1):
        starts = (0, *cuts)
        for choice in choices():
            t = evaluate(problem, starts, choice, microbatches, schedule, chunks)
            peak = max(t.memory_bytes)
            for i, budget in enumerate(budgets):
                if budget is not None and peak > budget * (1 + 1e-9):
                    continue
                if best[i] is None or t.objective_s < best[i][0].objective_s - 1e-15:
                    best[i] = (t, starts, choice)
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
    status: str  # "optimal" (the solver proved its objective) or "feasible"
    bound_s: float
    seconds: float
    num_variables: int
    num_constraints: int
    # the simulated step is proven least for this shape: the objective proven is the step
    # itself (one stage, or GPipe), or the bound meets it. Elsewhere the objective only
    # stands in for the step, from above (1F1B's and the chunked schedules' simulations
    # run shorter on uneven stages), and the shape stays open below its bound
    settles: bool = False


def solve_stages(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                 budget_bytes: float | None, time_limit_s: float = 60.0,
                 relative_gap: float = 1e-9, cutoff_s: float | None = None,
                 chunks: int = 1, method: str = "auto") -> StageSolution | None:
    """The best stage cut (pp·chunks stages) and strategies for this shape by the
    objective; None when nothing fits the budget (or, with `cutoff_s`, no assignment's
    simulated step can beat it: the cutoff bounds the simulation from below).
    `method` "mip" skips the dynamic program (tests compare the two)."""
    start = time.perf_counter()
    problem = problem.for_schedule(schedule)
    U = len(problem.units)
    S = pp * chunks
    if S > U:
        return None
    linked = problem.linked_units()
    if S == 1 and not linked:  # planner.ilp has no rows linking a block's layers
        return _solve_one_stage(problem, microbatches, schedule, budget_bytes, time_limit_s,
                                cutoff_s, start)
    # one stage per rank: exact by dynamic programming (planner.pipeline.stage_dp), which has no
    # rows linking a block's layers (a block recomputed whole): those go to the program
    if chunks == 1 and method != "mip" and not linked:
        solved = _solve_by_dp(problem, pp, microbatches, schedule, budget_bytes, cutoff_s,
                              start, start + min(time_limit_s / 2, DP_SECONDS))
        if solved != "too large":
            return solved
    given = problem
    # a block recomputed whole links its layers, which the exact fast solvers above cannot
    # hold: with every such block recomputed they can, and their plan starts the program
    start_plan = (_every_block_recomputed_plan(given, pp, microbatches, schedule,
                                               budget_bytes, chunks, time_limit_s / 2)
                  if linked and method != "mip" else None)
    if start_plan is not None:
        start_plan = start_plan[0], _fewer_recomputed(given, *start_plan, pp, microbatches,
                                                      schedule, chunks, budget_bytes)
    left_s = time_limit_s - (time.perf_counter() - start)
    if start_plan is not None and U * S > MIP_UNIT_STAGES_PER_S * left_s:
        return _start_only(given, start_plan, pp, microbatches, schedule, chunks,
                           budget_bytes, cutoff_s, start)
    # in units of the largest single time: SCIP drops coefficients below 1e-9 (planner.ilp)
    unit_s = time_unit_s(problem.times())
    flights = [in_flight(schedule, pp, microbatches, k, chunks) for k in range(S)]
    kappa = (None if chunks == 1 else
             _uniform_bubble(schedule, pp, chunks, microbatches, problem.forward_share))
    program = stage_mip.build(problem.in_units(unit_s), microbatches, flights,
                              stage_ranks(schedule, pp, chunks), kappa, budget_bytes,
                              None if cutoff_s is None else cutoff_s / unit_s, relative_gap)
    # a start: deep pipelines under a tight budget find none for minutes, and chunked ones
    # start from lopsided cuts (a 2-rank interleaved GPT: 2.77 s at 5 s, 1.60 s at 15 s)
    hint = start_plan or balanced_cut(given, pp, microbatches, schedule, budget_bytes, chunks)
    if hint is not None:
        program.hint(*hint)
    program.solver.SetTimeLimit(max(1, int((time_limit_s - (time.perf_counter() - start))
                                           * 1000)))
    status = program.solver.Solve()
    if status not in (pywraplp.Solver.OPTIMAL, pywraplp.Solver.FEASIBLE,
                      pywraplp.Solver.NOT_SOLVED):
        return None
    return _answer(given, program, status, hint, pp, microbatches, schedule, chunks,
                   budget_bytes, cutoff_s, unit_s, start)


def _answer(problem: StageProblem, program, status: int, hint, pp: int, microbatches: int,
            schedule: str, chunks: int, budget_bytes: float | None, cutoff_s: float | None,
            unit_s: float, start: float) -> StageSolution | None:
    """The stage program's answer: its solution, or out of time the start where that is
    the better plan (SCIP completes a partial start rarely within seconds), the least
    objective of the two that fits; bounded by the no-solve bound (and, for GPipe, whose
    objective is its makespan, by the program's own bound: for the others the objective
    only stands in for the step, from above)."""
    solver = program.solver

    def step_bound() -> float:
        bound = lower_bound(problem, pp, microbatches, schedule, chunks, budget_bytes)
        if schedule == "GPipe":
            bound = max(bound, solver.Objective().BestBound() * unit_s)
        return bound

    found = []
    if hint is not None and status != pywraplp.Solver.OPTIMAL:
        t = evaluate(problem, *hint, microbatches, schedule, chunks)
        if budget_bytes is None or max(t.memory_bytes) <= budget_bytes * (1 + 1e-9):
            found.append((t.objective_s, *hint, t))
    if status != pywraplp.Solver.NOT_SOLVED:
        starts, choice = program.answer()
        t = evaluate(problem, starts, choice, microbatches, schedule, chunks)
        found.append((t.objective_s, starts, choice, t))
    if not found:
        raise TimeLimit(step_bound())
    _, starts, choice, times = min(found, key=lambda f: f[0])
    if cutoff_s is not None and times.step_s > cutoff_s:
        if status == pywraplp.Solver.OPTIMAL and schedule == "GPipe" and chunks == 1:
            return None  # the objective is the step: nothing beats the cutoff
        # out of time with a plan that does not beat the cutoff: nothing is proven (an
        # interleaved zero-bubble GPT over 64 A100s was closed so at 5 s, and its MIP finds
        # a plan 4.5% faster than the search's best given 90 s); proven in the objective
        # that stands in for the step, the plan is returned, open below its bound
        if status != pywraplp.Solver.OPTIMAL:
            raise TimeLimit(step_bound())
    bound = step_bound()
    return StageSolution(
        starts=starts, choice=choice, times=times,
        status="optimal" if status == pywraplp.Solver.OPTIMAL else "feasible",
        bound_s=min(bound, times.step_s),
        seconds=time.perf_counter() - start, num_variables=solver.NumVariables(),
        num_constraints=solver.NumConstraints(),
        settles=bound >= times.step_s * (1 - 1e-9))


def quick_plan(problem: StageProblem, pp: int, microbatches: int, schedule: str,
               budget_bytes: float | None, chunks: int = 1) -> StageSolution | None:
    """A plan without the integer program, in a fraction of a second: the cut whose
    slowest stage is fastest with the least-memory options (balanced_cut), then each
    rank's options by planner.ilp on that cut (_fitting_choice). Not a proof ("feasible",
    with the no-solve bound): the search tries it on chunked shapes before their stage
    MIPs, which rarely find as good a plan in seconds (a 48-block GPT on 64 A100s:
    DualPipeV at pp 8 in 1.43 s against the best one-stage plan's 1.68 s, which the
    search returned before). Blocks offered recomputed whole are all recomputed, so that
    planner.ilp picks the ranks' options (the least-memory options the cut is found with
    made its plans some 60% slower on a 70 B Llama). None where nothing fits."""
    start = time.perf_counter()
    hint = None
    if problem.linked_units():  # its layers' options by planner.ilp, every block recomputed
        hint = _every_block_recomputed_plan(problem, pp, microbatches, schedule,
                                            budget_bytes, chunks, time_limit_s=None)
        if hint is not None:
            hint = hint[0], _fewer_recomputed(problem, *hint, pp, microbatches, schedule,
                                              chunks, budget_bytes)
    hint = hint or balanced_cut(problem, pp, microbatches, schedule, budget_bytes, chunks)
    if hint is None:
        return None
    times = evaluate(problem, *hint, microbatches, schedule, chunks)
    if budget_bytes is not None and max(times.memory_bytes) > budget_bytes * (1 + 1e-9):
        return None
    bound = lower_bound(problem, pp, microbatches, schedule, chunks, budget_bytes)
    return StageSolution(starts=hint[0], choice=hint[1], times=times, status="feasible",
                         bound_s=min(bound, times.step_s),
                         seconds=time.perf_counter() - start, num_variables=0,
                         num_constraints=0)


def _fewer_recomputed(problem: StageProblem, starts, choice, pp: int, m: int, schedule: str,
                      chunks: int, budget_bytes: float | None) -> tuple[int, ...]:
    """`choice` with blocks recomputed whole run plain again where their rank's memory
    still fits, the busiest rank's first: every block recomputed is what lets the ranks'
    options be chosen without the linking rows, but it leaves memory unused where only
    some blocks must be recomputed (a 70 B Llama over 256 H100s, 8 ranks of 4 chunks: 26 to
    42 of 83 GB held, every block's forward run twice)."""
    S = pp * chunks
    ranks = stage_ranks(schedule, pp, chunks)
    bounds = list(starts) + [len(problem.units)]
    rank_of_unit, flight_of_unit = [], []
    for k in range(S):
        f = in_flight(schedule, pp, m, k, chunks)
        for _ in range(bounds[k], bounds[k + 1]):
            rank_of_unit.append(ranks[k])
            flight_of_unit.append(f)
    choice = list(choice)
    load, held = [0.0] * pp, [0.0] * pp
    for i, l in enumerate(problem.layers):
        r, c = rank_of_unit[l.unit], choice[i]
        load[r] += m * float(l.microbatch_s[c])
        held[r] += float(l.weight_bytes[c]) + flight_of_unit[l.unit] * float(l.activation_bytes[c])
    gains = []  # (rank, time saved, bytes added, the unit's layers)
    linked = problem.linked_units()
    for u in problem.recomputed_units(choice):
        members = linked[u]
        f, saved, added = flight_of_unit[u], 0.0, 0.0
        for i in members:
            l, c = problem.layers[i], choice[i]
            p = l.plain_index(c)
            saved += m * float(l.microbatch_s[c] - l.microbatch_s[p])
            added += float(l.weight_bytes[p] - l.weight_bytes[c]) + f * float(
                l.activation_bytes[p] - l.activation_bytes[c])
        gains.append((rank_of_unit[u], saved, added, members))
    limit = math.inf if budget_bytes is None else budget_bytes * (1 - 1e-9)
    while gains:
        fitting = [g for g in gains if g[1] > 0 and held[g[0]] + g[2] <= limit]
        if not fitting:
            break
        r, saved, added, members = max(fitting, key=lambda g: (load[g[0]], g[1] / max(g[2], 1.0)))
        gains.remove((r, saved, added, members))
        load[r] -= saved
        held[r] += added
        for i in members:
            choice[i] = problem.layers[i].plain_index(choice[i])
    return tuple(choice)


def _start_only(problem: StageProblem, plan, pp: int, microbatches: int, schedule: str,
                chunks: int, budget_bytes: float | None, cutoff_s: float | None,
                start: float) -> StageSolution:
    """The start plan as the answer ("feasible", open below the no-solve bound) where the
    stage program's rows alone would take longer to write than the solve has left. A
    start that does not fit or does not beat `cutoff_s` proves nothing: TimeLimit, as a
    program out of time."""
    times = evaluate(problem, *plan, microbatches, schedule, chunks)
    bound = lower_bound(problem, pp, microbatches, schedule, chunks, budget_bytes)
    if (budget_bytes is not None and max(times.memory_bytes) > budget_bytes * (1 + 1e-9)
            or cutoff_s is not None and times.step_s > cutoff_s):
        raise TimeLimit(bound)
    return StageSolution(starts=plan[0], choice=plan[1], times=times, status="feasible",
                         bound_s=min(bound, times.step_s),
                         seconds=time.perf_counter() - start, num_variables=0,
                         num_constraints=0, settles=bound >= times.step_s * (1 - 1e-9))


def every_block_recomputed(problem: StageProblem):
    """(the problem with every block offered recomputed whole recomputed, and per layer
    the indices of the options it keeps): each such layer keeps its recomputed options
    only, so no row links a block's layers and planner.ilp, the dynamic program and
    quick plans solve it exactly. None where no layer is linked."""
    if not problem.linked_units():
        return None
    # identical layers (a transformer's blocks) share their arrays: each distinct one's
    # kept options and their figures made once, and so each distinct edge matrix cut once
    # (a layer or an edge at a time, DeepSeek-V3's quick plans took seconds each)
    kept = once_per_object(lambda recomputed, n: np.arange(n) if recomputed is None
                           else np.flatnonzero(recomputed))
    keep = [kept(l.recomputed, len(l.strategies)) for l in problem.layers]
    restricted = once_per_object(lambda k, *arrays, l: (
        tuple(l.strategies[o] for o in k), l.microbatch_s[k], l.step_s[k],
        l.weight_bytes[k], l.activation_bytes[k], None,
        None if l.temp_bytes is None else l.temp_bytes[k],
        None if l.gathered_bytes is None else l.gathered_bytes[k]))
    layers = tuple(l if l.recomputed is None else LayerOptions(
        l.name, l.unit, *restricted(k, l.strategies, *map(id, _ARRAYS_OF(l)), l=l))
        for l, k in zip(problem.layers, keep))
    cut = once_per_object(lambda cost, *ids, rows, cols:
                          np.asarray(cost, float)[np.ix_(rows, cols)])
    edges = tuple(Edge(e.src, e.dst, cut(e.cost_s, id(keep[e.src]), id(keep[e.dst]),
                                         rows=keep[e.src], cols=keep[e.dst]))
                  for e in problem.edges)
    return replace(problem, layers=layers, edges=edges), keep


def _every_block_recomputed_plan(problem: StageProblem, pp: int, microbatches: int,
                                 schedule: str, budget_bytes: float | None, chunks: int,
                                 time_limit_s: float | None):
    """(starts, choice) of the best plan with every linked block recomputed, in the
    problem's own option indices: exact by planner.ilp (one stage) or the dynamic program
    (one stage per rank) within `time_limit_s`, else a quick plan; None where none fits.
    Where memory binds, the stage program under a time limit often finds no plan at all
    (a 70 B Llama over 256 H100s: none in 5 s on most pipelined shapes): this is its start."""
    restricted, keep = every_block_recomputed(problem)
    found = None
    S = pp * chunks
    if time_limit_s is not None and S == 1:
        found = _solve_one_stage(restricted, microbatches, schedule, budget_bytes,
                                 time_limit_s, None, time.perf_counter())
    elif time_limit_s is not None and chunks == 1:
        now = time.perf_counter()
        found = _solve_by_dp(restricted, pp, microbatches, schedule, budget_bytes, None, now,
                             now + min(time_limit_s, DP_SECONDS))
        found = None if found == "too large" else found
    if found is not None:
        starts, choice = found.starts, found.choice
    else:
        cut = balanced_cut(restricted, pp, microbatches, schedule, budget_bytes, chunks)
        if cut is None:
            return None
        starts, choice = cut
    return tuple(starts), tuple(int(keep[i][c]) for i, c in enumerate(choice))


def _solve_by_dp(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                 budget_bytes: float | None, cutoff_s: float | None, start: float,
                 deadline: float):
    """The integer program's optimum by planner.pipeline.stage_dp, read out as the integer
    program would be; "too large" where the dynamic program declines or runs past
    `deadline` (DP_SECONDS or half the time limit: the integer program gets the rest)."""
    flights = [in_flight(schedule, pp, microbatches, k) for k in range(pp)]
    try:  # stage intervals priced once (deep pipelines), else labels per unit
        found = stage_intervals.solve(problem, pp, microbatches, flights, budget_bytes,
                                      cutoff_s, deadline)
    except stage_dp.TooLarge:
        try:
            found = stage_dp.solve(problem, pp, microbatches, flights, budget_bytes,
                                   cutoff_s, deadline)
        except stage_dp.TooLarge:
            return "too large"
    if found is None:
        return None
    times = evaluate(problem, found.starts, found.choice, microbatches, schedule)
    if cutoff_s is not None and times.step_s > cutoff_s and schedule == "GPipe":
        return None  # its objective is its step: nothing under the cutoff
    bound = lower_bound(problem, pp, microbatches, schedule, 1, budget_bytes)
    if schedule == "GPipe":  # its objective is its makespan: the optimum is the bound
        bound = max(bound, times.objective_s)
    return StageSolution(
        starts=found.starts, choice=found.choice, times=times, status="optimal",
        bound_s=min(bound, times.step_s), seconds=time.perf_counter() - start,
        num_variables=0, num_constraints=0, settles=bound >= times.step_s * (1 - 1e-9))


def balanced_cut(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                 budget_bytes: float | None, chunks: int = 1):
    """(starts, choice): with each layer's least-memory option, the cut into pp·chunks
    stages whose slowest stage is fastest among those that fit (with chunks, each stage in
    its rank's share of the budget), by dynamic programming over units; None when none
    fits. Cut transfers are left out: it is a start for the integer program, not its
    answer."""
    U = len(problem.units)
    S = pp * chunks
    # least memory; of a layer with recomputed variants (a block recomputed whole), the
    # least of those
    choice = tuple(int(np.argmin(np.where(l.recomputed if l.recomputed is not None else True,
                                          l.weight_bytes + l.activation_bytes, np.inf)))
                   for l in problem.layers)
    t, w, a = np.zeros(U + 1), np.zeros(U + 1), np.zeros(U + 1)
    for l, c in zip(problem.layers, choice):
        t[l.unit + 1] += l.microbatch_s[c]
        w[l.unit + 1] += l.weight_bytes[c]
        a[l.unit + 1] += l.activation_bytes[c]
    t, w, a = np.cumsum(t), np.cumsum(w), np.cumsum(a)
    budget = math.inf if budget_bytes is None else budget_bytes / chunks
    best = np.full((S + 1, U + 1), math.inf)  # best[k][b]: units [0, b) in k stages
    back = np.zeros((S + 1, U + 1), dtype=int)
    best[0][0] = 0.0
    for k in range(1, S + 1):
        f = in_flight(schedule, pp, microbatches, k - 1, chunks)
        for b in range(k, U - (S - k) + 1):
            starts_ = np.arange(k - 1, b)
            fits = (w[b] - w[starts_]) + f * (a[b] - a[starts_]) <= budget
            value = np.where(fits, np.maximum(best[k - 1][starts_], t[b] - t[starts_]), math.inf)
            j = int(np.argmin(value))
            best[k][b], back[k][b] = value[j], starts_[j]
    if not math.isfinite(best[S][U]):
        return None
    starts, b = [], U
    for k in range(S, 0, -1):
        b = int(back[k][b])
        starts.append(b)
    starts = tuple(reversed(starts))
    return starts, _fitting_choice(problem, starts, pp, microbatches, schedule, chunks,
                                   budget_bytes) or choice


def ilp_problem(problem: StageProblem, members, flights, m: int,
                budget_bytes: float | None, ties: tuple[tuple[int, ...], ...] = ()) -> Problem:
    """planner.ilp's problem of the layers `members` on one rank, layer members[n] with
    flights[n] microbatches in flight: each option at m·t + s and weights + f·activations,
    the edges between those layers at m times their cost; `ties`: groups of members (by
    layer index) that pick one strategy name (planner.ties)."""
    index = {i: n for n, i in enumerate(members)}
    nodes = []
    for i, f in zip(members, flights):
        l = problem.layers[i]
        nodes.append(Node(l.name, tuple(
            Option(name, m * float(l.microbatch_s[o]) + float(l.step_s[o]),
                   float(l.weight_bytes[o]) + f * float(l.activation_bytes[o]))
            for o, name in enumerate(l.strategies))))
    edges = tuple(Edge(index[e.src], index[e.dst], m * np.asarray(e.cost_s, float))
                  for e in problem.edges if e.src in index and e.dst in index)
    return Problem(tuple(nodes), edges, budget_bytes,
                   tuple(tuple(index[i] for i in group) for group in ties))


def _fitting_choice(problem: StageProblem, starts, pp: int, m: int, schedule: str,
                    chunks: int, budget_bytes: float | None, time_limit_s: float = 2.0):
    """On a cut, each rank's options by planner.ilp: the least m·t + s with the edges
    between its own layers, in the budget (the layers of its stages together, each with
    its stage's microbatches in flight): faster than the least-memory options the cut was
    found with, and what the integer program would pick if the cut were fixed, save the
    edges that cross ranks. A start for the integer program; None where a rank fits
    nothing or a layer's options are linked (a block recomputed whole)."""
    if problem.linked_units():
        return None
    S = pp * chunks
    ranks = stage_ranks(schedule, pp, chunks)
    bounds = list(starts) + [len(problem.units)]
    stage_of_unit = [k for k in range(S) for _ in range(bounds[k], bounds[k + 1])]
    flight = [in_flight(schedule, pp, m, k, chunks) for k in range(S)]
    rank_of = [ranks[stage_of_unit[l.unit]] for l in problem.layers]
    choice = [0] * len(problem.layers)
    for r in range(pp):
        mine = [i for i, q in enumerate(rank_of) if q == r]
        flights = [flight[stage_of_unit[problem.layers[i].unit]] for i in mine]
        try:
            got = ilp.solve(ilp_problem(problem, mine, flights, m, budget_bytes),
                            time_limit_s)
        except Infeasible:
            return None
        for i, c in zip(mine, got.choice):
            choice[i] = c
    return tuple(choice)


def _solve_one_stage(problem: StageProblem, microbatches: int, schedule: str,
                     budget_bytes: float | None, time_limit_s: float,
                     cutoff_s: float | None, start: float) -> StageSolution | None:
    """One stage: no cut to choose, so the step is m·(Σ per-microbatch time) + Σ per-step
    time, additive over layers and edges. That is planner.ilp's problem exactly, whose
    reductions (dominance, additive-edge folding, reduced-cost fixing) prove it in well
    under a second where the stage MIP above took minutes on large models."""
    flight = in_flight(schedule, 1, microbatches, 0)
    layers = range(len(problem.layers))
    try:
        solution = ilp.solve(ilp_problem(problem, layers, [flight] * len(layers),
                                         microbatches, budget_bytes),
                             time_limit_s, cutoff_s=cutoff_s)
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
        num_variables=solution.num_variables, num_constraints=solution.num_constraints,
        settles=solution.status == "optimal")


def lower_bound(problem: StageProblem, pp: int, microbatches: int, schedule: str = "1F1B",
                chunks: int = 1, budget_bytes: float | None = None) -> float:
    """A bound no cut or strategy's simulated step beats, without a solve. Each unit costs
    at least the sum of its layers' cheapest options and of the cheapest entry of each edge
    into it (a[u]); the per-step part is at least its smallest total shared evenly.
    With one stage per rank, rank r works m·T_r after waiting for the first forward and
    before the last backward passes the stages before it (Σ_{j<r} T_j): the best contiguous
    split of the minima under max_r (Σ_{j<r} T_j + m·T_r) (the linear-partition dynamic
    program, with the cut transfers) bounds every schedule; under 1F1B rank r also idles
    while the first and the last microbatch pass the stages after it (_one_f_one_b_idle),
    which makes the bound exact on balanced stages, (m + pp - 1)·T, and keeps splits that
    starve the later stages from looking cheap; GPipe's makespan is
    Σ_k T_k + (m - 1)·max_k T_k, bounded by the split with the least slowest stage. With
    `budget_bytes`, the split may only use stages whose least memory (each layer's least
    weights + in-flight activations at that stage) fits: the cut of any plan that fits is
    one of them, and a shape no split fits is infinitely bad (pruned unsolved). With
    chunks, a rank does m times its share of the work, at least m·Σ a / pp (with a budget:
    the Lagrangian bound of the whole model in pp budgets, shared), and the first
    microbatch passes every stage forward and back (2/3 of it where the weight gradients
    can wait), and units are whole: some rank holds k + 1 of the k·pp + 1 largest
    (stage_loads.packing_bound). The bubble is left out, and so is contiguity, which the
    search adds where it matters (stage_loads.busiest_rank_bound: a dynamic program per
    shape, too slow to run for every candidate)."""
    if pp * chunks > len(problem.units):
        return math.inf
    if pp == 1:
        return _one_stage_bound(problem, microbatches, schedule, budget_bytes)
    if chunks > 1:
        return _chunked_bound(problem, pp, microbatches, schedule, chunks, budget_bytes)
    return _one_chunk_bound(problem, pp, microbatches, schedule, budget_bytes)


def _one_stage_bound(problem: StageProblem, m: int, schedule: str,
                     budget_bytes: float | None) -> float:
    """lower_bound with one stage: the least work, or the Lagrangian bound of the model's
    memory row where that is more (+inf where its least memory does not fit)."""
    tables = problem.tables
    plain = m * float(tables.unit_least_s.sum()) + tables.step_least_s
    if budget_bytes is None:
        return plain
    f = in_flight(schedule, 1, m, 0)
    if not _spans_that_fit(problem, f, budget_bytes)[0, -1]:
        return math.inf
    edges_s = m * float(tables.edge_least_s.sum())
    dual = _dual_stage_bounds(problem, [f], m, budget_bytes, per_step=True)[f][0, -1]
    return max(plain, dual + edges_s)


def _chunked_bound(problem: StageProblem, pp: int, m: int, schedule: str, chunks: int,
                   budget_bytes: float | None) -> float:
    """lower_bound with chunks per rank: a rank's share of the work, one microbatch's
    chain (forwards down, input gradients up), the units packed whole, and with a budget
    the ranks' memory together: every stage holding at least one microbatch, the whole
    model's m·t + s under pp budgets, shared by the ranks (the busiest does at least its
    share of m·R_r + S_r)."""
    tables = problem.tables
    once = tables.step_least_s / pp
    sends = _least_sends_s(problem, schedule, pp, chunks)
    work = float(tables.unit_least_s.sum()) + sends
    share = schedules.parts(problem.forward_share)
    chain = (share["F"] + share["I"] if schedule in schedules.SPLIT_BACKWARD else 1.0) * work
    bound = max(m * work / pp + once, chain + once, stage_loads.packing_bound(
        problem, pp, m, schedule, chunks))
    if budget_bytes is None:
        return bound
    whole = _dual_stage_bounds(problem, [1], m, pp * budget_bytes, per_step=True)[1][0, -1]
    shared = (whole + m * (float(tables.edge_least_s.sum()) + sends)) / pp
    return max(bound, shared)


def _one_chunk_bound(problem: StageProblem, pp: int, m: int, schedule: str,
                     budget_bytes: float | None) -> float:
    """lower_bound with one stage per rank (its docstring): the best contiguous split of
    the stages' least times under the schedule's waits, with a budget only splits that fit
    and each stage at least its Lagrangian bound."""
    U = len(problem.units)
    tables = problem.tables
    a = tables.unit_least_s
    once = tables.step_least_s / pp
    prefix = np.concatenate([[0.0], np.cumsum(a)])
    cut = np.asarray(problem.cut_s, float)
    in_cut = np.concatenate([[0.0], cut[1:], [0.0]])[:, None]  # a stage from unit i
    outside = in_cut + in_cut.T  # ... to unit j: its cut transfers (none after the last)
    i_, j_ = np.arange(U + 1)[:, None], np.arange(U + 1)[None, :]
    body = prefix[j_] - prefix[i_] + outside  # stage [i, j)'s least T, times m below
    flights = [in_flight(schedule, pp, m, k) for k in range(pp)]
    stage_m = [m * body] * pp  # per position: m·T of a stage [i, j) there, at least
    fits, stage_ms = [True] * pp, None
    if budget_bytes is not None:
        edge_prefix = np.concatenate([[0.0], np.cumsum(tables.edge_least_s)])
        outside = outside + edge_prefix[j_] - edge_prefix[i_]
        fits, stage_m, stage_ms = _stages_that_fit(problem, pp, m, schedule, budget_bytes,
                                                   flights, body, outside, prefix)
    if schedule == "GPipe":  # Σ_k T_k + (m - 1)·max_k T_k, exactly
        slowest = _best_split(prefix, stage_m, fits, 0.0)
        if math.isinf(slowest):  # no split fits the budget (not inf·0 = nan where m = 1)
            return math.inf
        return float(a.sum()) + slowest * (m - 1) / m + once
    # 1F1B: rank k also idles while the first and the last microbatch go through the
    # stages after it (_one_f_one_b_idle)
    waits = [s + _one_f_one_b_idle(s / m, prefix[-1] - prefix, pp, m, k,
                                   problem.forward_share)
             for k, s in enumerate(stage_m)]
    bound = _best_split(prefix, waits, fits, 1.0) + once
    if stage_ms is None:
        return bound
    return max(bound, _best_split(prefix, stage_ms, fits, 1.0))


def _stages_that_fit(problem: StageProblem, pp: int, m: int, schedule: str,
                     budget_bytes: float, flights, body, outside, prefix):
    """(fits, stage_m, stage_ms) per stage position k and unit span [i, j): whether its
    least memory fits; m·T at least, or its layers' Lagrangian bound with the cheapest
    edges and its cuts; and m·T + S with the stage's own per-step part, priced with the
    same option per layer (the least m·t + s, not two separate least), under 1F1B with
    its idle spells at least 2R - w·T (R - w·f·T where the two are one, f the forward's
    share: _one_f_one_b_idle): (m - w)·T + S + 2R."""
    fitting = {f: _spans_that_fit(problem, f, budget_bytes) for f in set(flights)}
    fits = [fitting[f] for f in flights]
    dual = _dual_stage_bounds(problem, set(flights), m, budget_bytes)
    stage_m = [np.maximum(m * body, dual[f] + m * outside) for f in flights]

    def with_step(weight: float, f: int) -> np.ndarray:
        """weight·T + S of a stage at least, priced with the same options."""
        return (_dual_stage_bounds(problem, {f}, weight, budget_bytes, per_step=True)[f]
                + weight * outside)

    stage_ms = []
    after = (prefix[-1] - prefix)[None, :]
    for k, f in enumerate(flights):
        s = with_step(m, f)
        if schedule == "1F1B" and k < pp - 1:
            w = min(pp - k - 1, m)
            s = np.maximum(s, with_step(m - w, f) + 2 * after if m - 1 > w
                           else with_step(m - w * problem.forward_share, f) + after)
        stage_ms.append(s)
    return fits, stage_m, stage_ms


def _best_split(prefix: np.ndarray, stage, fits, weight: float) -> float:
    """min over contiguous splits into len(stage) stages that fit of
    max_k (weight·prefix before k + stage[k][i, j])."""
    U, pp = len(prefix) - 1, len(stage)
    i_, j_ = np.arange(U + 1)[:, None], np.arange(U + 1)[None, :]
    best = np.full(U + 1, math.inf)
    best[0] = 0.0
    for k in range(1, pp + 1):
        allowed = (i_ >= k - 1) & (j_ > i_) & (j_ <= U - (pp - k)) & fits[k - 1]
        value = np.maximum(best[:, None], weight * prefix[:, None] + stage[k - 1])
        best = np.where(allowed, value, math.inf).min(axis=0)
    return float(best[U])


def _one_f_one_b_idle(stage_s: np.ndarray, after_s: np.ndarray, pp: int, m: int,
                      k: int, forward: float = 1 / 3) -> np.ndarray:
    """[i, j] -> what rank k idles under 1F1B beyond its own m·T, at least, for a stage
    [i, j) taking `stage_s` per microbatch (at least) with `after_s[j]` of work after it
    (at least), in the simulation's split of a microbatch (forward f·T, backward (1-f)·T,
    f = `forward`: schedules.parts). Rank k runs w = min(pp - k - 1, m) forwards ahead.
    Microbatch 0's backward reaches it only after the stages after it, R, ran forward and
    back: it idles R - w·f·T beyond its w forwards between. The same holds at the end:
    between its last forward and the last microbatch's backward it has w backwards to do,
    idling R - w·(1-f)·T. The two idle spells are apart where its last forward comes after
    microbatch 0's backward (m - 1 > w). Both grow with R and the total with T (m·T + idle
    has slope m - w > 0), so lower bounds of each give a lower bound. With balanced stages
    this makes rank 0's bound the textbook (m + pp - 1)·T, where the first and last rank's
    waits alone gave m·T."""
    w = min(pp - k - 1, m)
    rest = after_s[None, :]
    start = np.maximum(rest - w * forward * stage_s, 0.0)
    end = np.maximum(rest - w * (1 - forward) * stage_s, 0.0)
    return start + end if m - 1 > w else np.maximum(start, end)


def _dual_stage_bounds(problem: StageProblem, flights, m: int, budget_bytes: float,
                       per_step: bool = False) -> dict[int, np.ndarray]:
    """{f: [i, j] -> a bound on m·(Σ layer times) of a stage of units [i, j) that fits the
    budget with f microbatches in flight}, by Lagrangian relaxation of its memory row:
    for any λ >= 0, Σ_l min_o (m·t_lo + λ·(w_lo + f·a_lo)) - λ·budget is at most the time
    of any choice that fits; the best of a geometric grid of λ is kept. Where memory binds
    (weights replicated do not fit, their sharded variants are slower) this is what the
    cheapest options miss: on a 48-block GPT over 64 A100s it is the exact optimum of the
    one-stage shape, twice the plain bound, and it prunes most pipelined shapes unsolved.
    `per_step`: add each option's once-per-step time (one stage: the whole step)."""
    U = len(problem.units)
    # a transformer's blocks repeat: each distinct layer priced once, counted per unit
    tables = problem.tables
    t = m * tables.microbatch_s + (tables.step_s if per_step else 0.0)
    mem_w, mem_a = tables.weight_bytes, tables.activation_bytes
    scale = float(np.nanmin(np.where(np.isfinite(t), t, np.nan), axis=1).sum())
    lams = np.concatenate([[0.0], scale / budget_bytes * np.geomspace(1e-3, 1e3,
                                                                 stage_loads.LAMBDAS)])
    idx = np.arange(U + 1)
    out = {}
    later = idx[None, :] > idx[:, None]
    span = np.empty((U + 1, U + 1))
    for f in flights:
        value = tables.least_by_unit(t[None] + lams[:, None, None] * (mem_w + f * mem_a)[None])
        prefix = np.concatenate([np.zeros((len(lams), 1)), np.cumsum(value, 1)], 1)
        # max over λ of [i, j] -> prefix[j] - prefix[i] - λ·budget, one λ at a time: the
        # search asks for thousands of these (a 405 B Llama: 6,600), and a table per λ
        # stays in cache where all of them at once did not (twice as fast)
        best = np.full((U + 1, U + 1), -math.inf)
        for row, lam in zip(prefix, lams):
            np.add.outer(-row, row - lam * budget_bytes, out=span)
            np.maximum(best, span, out=best)
        _held_row_bounds(tables, t, f, lams[1::2], budget_bytes, best)
        out[f] = np.maximum(best, 0.0) * later
    return out


def _held_row_bounds(tables, t: np.ndarray, f: int, lams: np.ndarray, budget_bytes: float,
                     best: np.ndarray) -> None:
    """`best` ([i, j]: a bound on a stage of units [i, j)) raised in place by the
    Lagrangian of its rank's second memory row (planner.pipeline.held_row: FSDP's
    backward beside the rows), the least over τ for each λ; nothing where no option
    gathers. Two values of τ (held_row.levels' `one`) and every other λ of the first
    row's: the search asks for thousands of these (a 70 B Llama: 3,600 in its ranking),
    and with every size as τ and every λ they doubled its ranking's time."""
    second = held_row.lagrangian_by_unit(tables, t, f, lams, one=True)
    if second is None:
        return
    value, once = second  # (τ, λ, units), (τ, λ)
    prefix = np.concatenate([np.zeros(value.shape[:2] + (1,)), np.cumsum(value, -1)], -1)
    # per τ, every λ at once: [λ, i, j] -> its span's Lagrangian; the least over τ
    low = None
    for row, extra in zip(prefix, once - lams[None, :] * budget_bytes):
        spans = (row + extra[:, None])[:, None, :] - row[:, :, None]
        low = spans if low is None else np.minimum(low, spans, out=low)
    np.maximum(best, low.max(axis=0), out=best)


def _least_memory_prefix(problem: StageProblem, flights) -> dict[int, np.ndarray]:
    """{f: prefix sums over units of Σ_layers min_option (weights + f·activations)}: the
    least memory a run of units can take with f microbatches in flight."""
    return {f: np.concatenate([[0.0], np.cumsum(problem.tables.least_memory_by_unit(f))])
            for f in set(flights)}


def _spans_that_fit(problem: StageProblem, f: int, budget_bytes: float) -> np.ndarray:
    """[i, j] -> whether a stage of units [i, j) with f microbatches in flight can fit the
    budget: its least memory by the stage rows, and by the second row
    (planner.pipeline.held_row), the least over τ."""
    U = len(problem.units)
    i_, j_ = np.arange(U + 1)[:, None], np.arange(U + 1)[None, :]
    limit = budget_bytes * (1 + 1e-9)
    first = _least_memory_prefix(problem, [f])[f]
    fits = first[j_] - first[i_] <= limit
    second = held_row.least_memory_by_unit(problem.tables, f)
    if second is not None:
        per_unit, once = second
        prefix = np.concatenate([np.zeros((len(once), 1)), np.cumsum(per_unit, -1)], -1)
        least = (prefix[:, None, :] - prefix[:, :, None] + once[:, None, None]).min(axis=0)
        fits &= least <= limit
    return fits


def _least_sends_s(problem: StageProblem, schedule: str, pp: int, chunks: int) -> float:
    """The least the transfers can add to Σ_k T_k: each cut between ranks is paid by both
    of its stages, and there are as many as hops between ranks (pp·v - 1 looped, one
    fewer for a V), each at least the cheapest cut."""
    ranks = stage_ranks(schedule, pp, chunks)
    hops = sum(ranks[k - 1] != ranks[k] for k in range(1, pp * chunks))
    cuts = sorted(problem.cut_s[1:])
    return 2 * float(sum(cuts[:hops]))


def estimate(problem: StageProblem, pp: int, microbatches: int, schedule: str,
             chunks: int = 1) -> float:
    """What the search drops chunked candidates by: the bound for one chunk per rank; with
    chunks, the objective on perfectly balanced chunks of the cheapest options (not a
    bound)."""
    if chunks == 1:
        return lower_bound(problem, pp, microbatches, schedule, chunks)
    tables = problem.tables
    total = float(tables.unit_least_s.sum())
    total += _least_sends_s(problem, schedule, pp, chunks)
    once = tables.step_least_s / pp
    kappa = _uniform_bubble(schedule, pp, chunks, microbatches, problem.forward_share)
    return microbatches * total / pp + kappa * total / (pp * chunks) + once


def min_memory_bytes(problem: StageProblem, pp: int, microbatches: int, schedule: str,
                     chunks: int = 1, fewest_in_flight: int | None = None) -> float:
    """A bound on the largest rank's memory: the smallest total, shared evenly, with the
    fewest microbatches any stage keeps in flight (from the schedule's order, simulated
    once per shape; or `fewest_in_flight` where given, e.g. one, which every stage holds
    at least)."""
    f = fewest_in_flight or min(in_flight(schedule, pp, microbatches, k, chunks)
                                for k in range(pp * chunks))
    return float(problem.tables.least_memory_by_unit(f).sum()) / pp
