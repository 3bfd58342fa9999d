"""An exact solver for the stage problem with one stage per rank (GPipe, 1F1B): the same
optimum as planner.pipeline.stages' integer program, without SCIP and without its time limits.

The integer program minimises (planner.pipeline.stages)

    Σ_k T_k  +  (m - 1)·max_k T_k  +  max_k S_k      s.t.  W_k + f_k·V_k ≤ budget

and on deep pipelines of large models it ran into its time limits (a 48-block GPT over 64
devices: 65 solves took 6 minutes and proved few). Every term is non-decreasing in each
stage's (T, S, memory), so a label-setting dynamic program over the units in order is
exact: a label is a partial assignment of units 0..u to stages 0..k, summarised by

    (Σ T so far, max T of closed stages, max S of closed stages, T, S, memory of stage k)

and a label no worse in all six than another with the same (stage, open edge sources)
can be dropped: whatever completes the worse one completes the better one no worse.

Inside a unit the layers' strategies are chosen the same way: labels (A, G, W, V) per
unit (per-microbatch time, per-step time, weights, activations), Pareto-filtered per
assignment of the layers whose edges still reach forward. That inner set is computed once
per distinct unit (a transformer's blocks are the same unit 48 times) and incoming
assignment, and is small (a handful of points per block).

Where the frontier of open edge sources grows too wide, labels pile up past a limit, or
the deadline passes, `solve` raises `TooLarge` and the caller falls back to the integer
program. Measured limit: on the 48-block GPT at pp 8 (18 points per block: data parallel
or FSDP per weight, trading time, per-step time and memory) one stage's (T, S, memory)
front reaches ~10^4 points and the labels ~10^5, minutes of Python: it falls back there.
planner.pipeline.stage_intervals, tried first, prices each stage interval once instead (its
(T, S) front under the memory cap, shared by identical blocks) and runs the outer program
on (Σ T, max T, max S) over cut positions; it reuses this module's per-unit sets.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

_GB = 1e9
MAX_FRONTIER_STATES = 256  # assignments of open edge sources carried between units
MAX_LABELS = 5_000  # labels alive at one unit boundary before giving up


class TooLarge(RuntimeError):
    """The dynamic program would be too wide for this problem: use the integer program."""


@dataclass(frozen=True)
class DPSolution:
    starts: tuple[int, ...]
    choice: tuple[int, ...]
    objective_s: float


def front(costs: np.ndarray) -> np.ndarray:
    """Indices of the rows of `costs` (n, d) no other row is <= in every column (of equal
    rows the first), in lexicographic order. Two columns: one sweep; more: blocks of rows
    checked against those kept, in numpy."""
    n, d = costs.shape
    if n <= 1:
        return np.arange(n)
    order = np.lexsort(costs.T[::-1])
    c = costs[order]
    if d == 2:  # sorted by the first column: kept where the second drops below all before
        best = np.minimum.accumulate(c[:, 1])
        keep = np.ones(n, bool)
        keep[1:] = c[1:, 1] < best[:-1]
        return order[keep]
    if n > 256:  # drop at once what one of a few points dominates (argmins of weighted
        # sums: on the front), so the exact pass below sees fewer rows
        scale = c.max(axis=0) - c.min(axis=0)
        scale[scale <= 0] = 1.0
        weights = np.random.default_rng(0).random((d, 64)) + 0.05
        for _ in range(2):
            pick = np.unique(np.argmin((c / scale) @ weights, axis=0))
            beaten = (c[:, None, :] >= c[pick][None, :, :]).all(axis=2).any(axis=1)
            beaten[pick] = False
            c, order = c[~beaten], order[~beaten]
        n = len(c)
    kept_rows: list[np.ndarray] = []
    kept = np.empty((0, d))
    for s in range(0, n, 512):
        block = c[s:s + 512]
        beaten = (block[:, None, :] >= block[None, :, :]).all(axis=2)
        beaten = np.tril(beaten, -1).any(axis=1)
        if len(kept):
            beaten |= (block[:, None, :] >= kept[None, :, :]).all(axis=2).any(axis=1)
        rows = np.flatnonzero(~beaten)
        kept_rows.append(s + rows)
        kept = np.vstack([kept, block[rows]])
    return order[np.concatenate(kept_rows)]


def _pareto(points: list, dims: int) -> list:
    """Points (tuples whose first `dims` entries are costs) no other point is <= in every
    cost; of equal points the first (`front`)."""
    if len(points) <= 1:
        return points
    return [points[r] for r in front(np.array([p[:dims] for p in points]))]


class _Units:
    """Per unit: its layers, the edges into them, and which earlier layers' options its
    edges read (the frontier), so a unit's inner Pareto set can be computed and reused."""

    def __init__(self, problem):
        self.problem = problem
        L = len(problem.layers)
        unit = [l.unit for l in problem.layers]
        if any(b < a for a, b in zip(unit, unit[1:])):
            raise TooLarge("layers are not grouped by unit in order")
        self.members = problem.unit_layers()
        self.into: list[list] = [[] for _ in range(L)]  # per dst layer: (src, cost)
        last_use = [-1] * L  # the last layer reading each layer
        for e in problem.edges:
            if e.src >= e.dst:
                raise TooLarge("an edge runs backwards")
            cost = np.asarray(e.cost_s, float)
            if not np.isfinite(cost).all():
                raise TooLarge("an edge with an infinite cost")
            self.into[e.dst].append((e.src, cost))
            last_use[e.src] = max(last_use[e.src], e.dst)
        self.last_use = last_use
        # open[u]: layers before unit u read by unit u or later (their options carried)
        self.open = []
        for members in self.members:
            first = members[0] if members else L
            self.open.append(tuple(i for i in range(first) if last_use[i] >= first))
        self.open.append(())
        self._cache: dict = {}

    def signature(self, u: int) -> tuple:
        base = self.members[u][0]
        layers = tuple((l.microbatch_s.tobytes(), l.step_s.tobytes(), l.weight_bytes.tobytes(),
                        l.activation_bytes.tobytes())
                       for l in (self.problem.layers[i] for i in self.members[u]))
        edges = tuple((s - base, d - base, c.tobytes(), c.shape)
                      for d in self.members[u] for s, c in self.into[d])
        out = tuple(i - base for i in self.open[u + 1])
        into = tuple(i - base for i in self.open[u])
        uses = tuple(min(self.last_use[i], 10**9) - base for i in self.members[u])
        return layers, edges, out, into, uses

    def points(self, u: int, state: tuple) -> dict:
        """{outgoing state: [(A, G, W, V, options of the unit's layers)]}: the Pareto set
        of the unit's strategy choices given the options `state` of open[u]."""
        key = (self.signature(u), state)
        hit = self._cache.get(key)
        if hit is not None:
            return hit
        members = self.members[u]
        end = members[-1]
        labels = {tuple(zip(self.open[u], state)): [(0.0, 0.0, 0.0, 0.0, ())]}
        for i in members:
            layer = self.problem.layers[i]
            grown: dict = {}
            for live, group in labels.items():
                known = dict(live)
                for o in range(len(layer.strategies)):
                    extra = sum(float(c[known[s], o]) for s, c in self.into[i])
                    alive = {s: v for s, v in known.items() if self.last_use[s] > i}
                    if self.last_use[i] > i:
                        alive[i] = o
                    nkey = tuple(sorted(alive.items()))
                    bucket = grown.setdefault(nkey, [])
                    a, g = float(layer.microbatch_s[o]) + extra, float(layer.step_s[o])
                    w = float(layer.weight_bytes[o]) / _GB
                    v = float(layer.activation_bytes[o]) / _GB
                    for A, G, W, V, ch in group:
                        bucket.append((A + a, G + g, W + w, V + v, ch + (o,)))
            labels = {k: _pareto(b, 4) for k, b in grown.items()}
            if len(labels) > MAX_FRONTIER_STATES:
                raise TooLarge(f"{len(labels)} frontier states inside unit {u}")
        out_layers = self.open[u + 1]
        result: dict = {}
        for live, group in labels.items():
            known = dict(live)
            assert all(s in known for s in out_layers if s <= end)
            result.setdefault(tuple(known[s] for s in out_layers), []).extend(group)
        result = {k: _pareto(b, 4) for k, b in result.items()}
        self._cache[key] = result
        return result


def solve(problem, pp: int, microbatches: int, flights: list[int],
          budget_bytes: float | None, cutoff_s: float | None = None,
          deadline: float = math.inf) -> DPSolution | None:
    """The least objective over cuts into pp stages (one per rank, stage k keeping
    `flights[k]` microbatches in flight) and strategies; None when nothing fits (or,
    with `cutoff_s`, when every plan has m·max T + max S above it: the simulated step
    cannot beat the cutoff). Past `deadline` (time.perf_counter()) it raises TooLarge.
    A narrow pass first (a few labels per state: a plan, not a
    proof) gives an incumbent; the exact pass then drops every label whose bound cannot
    beat it, which keeps deep pipelines of repeated blocks to a few thousand labels."""
    if pp > len(problem.units) or any(not members for members in problem.unit_layers()):
        raise TooLarge("a unit without layers")
    units = _Units(problem)
    first = _pass(units, pp, microbatches, flights, budget_bytes, cutoff_s, math.inf, 8,
                  deadline)
    if first is None:  # the narrow pass can miss a plan that fits: the exact one decides
        return _pass(units, pp, microbatches, flights, budget_bytes, cutoff_s, math.inf,
                     None, deadline)
    found = _pass(units, pp, microbatches, flights, budget_bytes, cutoff_s,
                  first.objective_s * (1 + 1e-9), None, deadline)
    return found or first


def _pass(units: _Units, pp: int, microbatches: int, flights: list[int],
          budget_bytes: float | None, cutoff_s: float | None, incumbent: float,
          beam: int | None, deadline: float = math.inf) -> DPSolution | None:
    """One sweep over the units: exact (beam None) below `incumbent`, or keeping the
    `beam` labels of least bound per state. A label is (sumT, maxT, maxS, T, S, mem,
    back), keyed by (its stage, the open-source options)."""
    problem = units.problem
    sweep = _Sweep(units, pp, microbatches, flights,
                   math.inf if budget_bytes is None else budget_bytes / _GB * (1 + 1e-9),
                   math.inf if cutoff_s is None else cutoff_s * (1 + 1e-9), incumbent,
                   _rest(problem), deadline)
    labels: dict = {(0, ()): [(0.0, 0.0, 0.0, 0.0, 0.0, 0.0, None)]}
    for u in range(len(problem.units)):
        labels = sweep.kept(sweep.grown(labels, u), u, beam)
        if not labels:
            return None
    return sweep.best(labels)


def _rest(problem) -> np.ndarray:
    """rest[u]: the least the units after u add to Σ T (each layer's cheapest option and
    edge)."""
    least = np.zeros(len(problem.units) + 1)
    for l in problem.layers:
        least[l.unit] += float(l.microbatch_s.min())
    for e in problem.edges:
        least[problem.layers[e.dst].unit] += float(np.asarray(e.cost_s).min())
    return np.concatenate([np.cumsum(least[::-1])[::-1][1:], [0.0]])


@dataclass
class _Sweep:
    """One pass's fixed numbers and its steps per unit: grow the labels, keep those that
    may win, and at the end read the best plan out."""

    units: _Units
    pp: int
    m: int
    flights: list[int]
    budget: float  # GB, +inf for none
    cutoff: float
    incumbent: float
    rest: np.ndarray
    deadline: float

    def bound(self, lab, u: int, k: int) -> float:
        """No completion of label `lab` (units ..u in stages ..k) has a smaller objective:
        stages k.. share at least T + rest, so the largest is at least its share."""
        sumT, maxT, maxS, T, S = lab[:5]
        share = (T + self.rest[u]) / (self.pp - k)
        return sumT + self.rest[u] + (self.m - 1) * max(maxT, T, share) + max(maxS, S)

    def grown(self, labels: dict, u: int) -> dict:
        """Each label extended by unit u's option points, in its stage or opening the
        next (the cut's transfer and the replay paid there), where it fits, stays under
        the cutoff and may beat the incumbent."""
        problem, pp, m = self.units.problem, self.pp, self.m
        U = len(problem.units)
        cut, replay = float(problem.cut_s[u]), float(problem.replay_s)
        grown: dict = {}
        grown_count = 0
        for (k, state), group in labels.items():
            if time.perf_counter() > self.deadline:
                raise TooLarge(f"out of time at unit {u}")
            grown_count += len(group)
            if grown_count > MAX_LABELS:
                raise TooLarge(f"over {MAX_LABELS} labels into unit {u}")
            pts = self.units.points(u, state)
            moves = [(k, False)] + ([(k + 1, True)] if u > 0 and k + 1 < pp else [])
            for nk, opens in moves:
                if U - u < pp - nk or (not opens and U - u - 1 < pp - 1 - nk):
                    continue  # too few units left for the stages still to open
                f = self.flights[nk]
                for out_state, plist in pts.items():
                    bucket = grown.setdefault((nk, out_state), [])
                    for lab in group:
                        sumT, maxT, maxS, T, S, mem, _ = lab
                        if opens:  # close stage k at this cut, open stage k + 1
                            maxT, maxS = max(maxT, T + cut), max(maxS, S)
                            sumT, T, S, mem = sumT + 2 * cut + replay, cut + replay, 0.0, 0.0
                        for A, G, W, V, ch in plist:
                            nmem = mem + W + f * V
                            if nmem > self.budget:
                                continue
                            nT, nS = T + A, S + G
                            if m * max(maxT, nT) + max(maxS, nS) > self.cutoff:
                                continue
                            new = (sumT + A, maxT, maxS, nT, nS, nmem, (lab, u, opens, ch))
                            if self.bound(new, u, nk) < self.incumbent:
                                bucket.append(new)
                    if len(bucket) > 4 * MAX_LABELS:
                        raise TooLarge(f"over {4 * MAX_LABELS} labels grown at unit {u}")
        return grown

    def kept(self, grown: dict, u: int, beam: int | None) -> dict:
        """Per state the Pareto-least labels (with a beam, those of least bound)."""
        labels = {}
        total = 0
        for key, bucket in grown.items():
            if not bucket:
                continue
            if beam is not None:
                bucket = sorted(bucket, key=lambda lab: self.bound(lab, u, key[0]))[:beam * 4]
            labels[key] = _pareto(bucket, 6)
            if beam is not None:
                labels[key] = labels[key][:beam] if len(labels[key]) <= beam else sorted(
                    labels[key], key=lambda lab: self.bound(lab, u, key[0]))[:beam]
            total += len(labels[key])
        if total > MAX_LABELS:
            raise TooLarge(f"{total} labels after unit {u}")
        if time.perf_counter() > self.deadline:
            raise TooLarge(f"out of time after unit {u} ({total} labels)")
        return labels

    def best(self, labels: dict) -> DPSolution | None:
        """The least objective over the labels that end in the last stage, read back
        through their parents into stage starts and options."""
        best = None  # (objective, label)
        for (k, _), group in labels.items():
            if k != self.pp - 1:
                continue
            for lab in group:
                sumT, maxT, maxS, T, S, _, _ = lab
                value = sumT + (self.m - 1) * max(maxT, T) + max(maxS, S)
                if best is None or value < best[0]:
                    best = (value, lab)
        if best is None:
            return None
        choice = [0] * len(self.units.problem.layers)
        starts = []
        lab = best[1]
        while lab[6] is not None:
            parent, u, opens, ch = lab[6]
            for i, o in zip(self.units.members[u], ch):
                choice[i] = o
            if opens:
                starts.append(u)
            lab = parent
        return DPSolution((0, *reversed(starts)), tuple(choice), best[0])
