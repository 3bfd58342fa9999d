"""The stage problem with one stage per rank (GPipe, 1F1B) solved exactly by pricing stage
intervals once: where planner.pipeline.stage_dp's labels carry each open stage's memory and pile
up past 10^5 on deep pipelines, here a stage's memory is settled inside its interval.

The objective is the integer program's (planner.pipeline.stages):

    Σ_k T_k  +  (m - 1)·max_k T_k  +  max_k S_k      s.t.  W_k + f_k·V_k ≤ budget

Two levels:

- An interval: units [i, j) as stage k (f_k microbatches in flight, a cut transfer in
  before i where k > 0 and out after j where k < pp - 1), given the options of the
  earlier layers whose edges reach into it (the incoming state). Its units' strategy
  choices are combined unit by unit from stage_dp's per-unit Pareto sets, keeping per
  outgoing state the Pareto set of (T, S, memory) with memory under the budget; at every
  end j the (T, S) front is read off. Intervals are cached by (f, cut in, incoming state,
  the units' signatures): a transformer's identical blocks give one interval per length.
- The outer program: labels (Σ T, max T, max S) per (stages placed, next unit, state),
  extended by one interval's (T, S) point at a time, Pareto-filtered. Every term of the
  objective is non-decreasing in each label entry, so dropping dominated labels is exact.

Both levels drop what cannot beat the incumbent: a stage with per-microbatch time T and
per-step time S gives an objective of at least T + R + (m - 1)·max(T, R / (pp - 1)) + S,
R the least time of every unit outside it (and, with a cutoff on the simulated step,
m·T + S is at most the cutoff); the outer program bounds what is left by the intervals'
own least times (suffix_bounds). A
narrow pass first (a few points per front: a plan, not a proof) gives that incumbent; the
exact pass then proves it or finds better. Past the deadline or size limits it raises
stage_dp.TooLarge and the caller falls back to the integer program.
"""

from __future__ import annotations

import itertools
import math
import time

import numpy as np

from planner.pipeline.stage_dp import DPSolution, TooLarge, _Units, front

_GB = 1e9
MAX_POINTS = 200_000  # candidate points of one front before filtering, before giving up
NARROW = 6  # points per front and labels per group kept in the narrow pass


def _merged(parts: list[tuple], narrow: bool, score):
    """The labels grown into one group, `parts` of (three cost columns, payload, the
    previous label's index, the point's index, ...): the columns and those indices
    concatenated, `part` (which of `parts` each row came from), and the rows on their
    Pareto front (`front`), in the narrow pass only the NARROW least by `score(columns)`."""
    columns = tuple(np.concatenate([p[c] for p in parts]) for c in range(3))
    part = np.concatenate([np.full(len(p[0]), n) for n, p in enumerate(parts)])
    prev = np.concatenate([p[4] for p in parts])
    pt = np.concatenate([p[5] for p in parts])
    keep = front(np.stack(columns, 1))
    if narrow and len(keep) > NARROW:
        value = score(*(c[keep] for c in columns))
        keep = keep[np.argsort(value, kind="stable")[:NARROW]]
    return columns, part, prev, pt, keep


class _Front:
    """Points (T, S, M) of one interval at one end and outgoing state; `back[p]` is
    (previous front, its point, unit, the unit's options) for reading the choice out."""

    __slots__ = ("T", "S", "M", "back", "ts")

    def __init__(self, T, S, M, back):
        self.T, self.S, self.M, self.back = T, S, M, back
        self.ts = front(np.stack([T, S], 1)) if len(T) else np.arange(0)

    def choices(self, p: int) -> dict[int, tuple]:
        out = {}
        node, i = self, p
        while node.back[i] is not None:
            prev, j, u, ch = node.back[i]
            out[u] = ch
            node, i = prev, j
        return out


class _Solver:
    def __init__(self, problem, pp, m, flights, budget_bytes, cutoff_s, deadline):
        self.units = _Units(problem)
        self.U, self.pp, self.m = len(problem.units), pp, m
        self.flights = flights
        self.budget = math.inf if budget_bytes is None else budget_bytes / _GB * (1 + 1e-9)
        self.cutoff = math.inf if cutoff_s is None else cutoff_s * (1 + 1e-9)
        self.deadline = deadline
        self.cut = [float(c) for c in problem.cut_s]
        self.replay = float(problem.replay_s)  # every stage after the first pays it
        least = np.zeros(self.U)  # each unit's least per-microbatch time
        for l in problem.layers:
            least[l.unit] += float(l.microbatch_s.min())
        for e in problem.edges:
            least[problem.layers[e.dst].unit] += float(np.asarray(e.cost_s).min())
        self.prefix = np.concatenate([[0.0], np.cumsum(least)])
        sig_ids: dict = {}
        self.sig = [sig_ids.setdefault(self.units.signature(u), len(sig_ids))
                    for u in range(self.U)]
        self.intervals: dict = {}
        self._unit_cache: dict = {}

    def _check_time(self, where: str) -> None:
        if time.perf_counter() > self.deadline:
            raise TooLarge(f"out of time {where}")

    def unit_points(self, u: int, state: tuple, f: int) -> dict:
        """{outgoing state: (points, A, G, W + f·V)}: stage_dp's per-unit Pareto set,
        filtered again with the memory at f microbatches in flight (one column fewer)."""
        key = (self.sig[u], state, f)
        hit = self._unit_cache.get(key)
        if hit is None:
            hit = {}
            for s_out, pts in self.units.points(u, state).items():
                a = np.array([p[0] for p in pts])
                g = np.array([p[1] for p in pts])
                w = np.array([p[2] + f * p[3] for p in pts])
                keep = np.sort(front(np.stack([a, g, w], 1)))
                keep = keep[w[keep] <= self.budget]
                hit[s_out] = ([pts[r] for r in keep], a[keep], g[keep], w[keep])
            self._unit_cache[key] = hit
        return hit

    def interval(self, k: int, i: int, state: tuple, incumbent: float, narrow: bool):
        """[{outgoing state: _Front} for j = i+1, i+2, ...]: stage k from unit i."""
        f = self.flights[k]
        cut_in = self.cut[i] + self.replay if k > 0 else 0.0
        last_end = self.U if k == self.pp - 1 else self.U - (self.pp - 1 - k)
        key = (f, cut_in, state, narrow)
        outside = self.prefix[-1]
        fronts = {state: _Front(np.zeros(1), np.zeros(1), np.zeros(1), [None])}
        out = []
        for u in range(i, last_end):
            key = key + (self.sig[u],)
            hit = self.intervals.get(key)
            if hit is not None:
                fronts = hit
                out.append(fronts)
                continue
            self._check_time(f"pricing stage {k} from unit {i}")
            rest = outside - (self.prefix[u + 1] - self.prefix[i])
            share = rest / max(self.pp - 1, 1)
            grown: dict = {}
            for s, fr in fronts.items():
                for s_out, (pts, a, g, w) in self.unit_points(u, s, f).items():
                    T = (fr.T[:, None] + a[None, :]).ravel()
                    S = (fr.S[:, None] + g[None, :]).ravel()
                    M = (fr.M[:, None] + w[None, :]).ravel()
                    lead = self.m * (T + cut_in) + S
                    # the other stages share `rest` at least: the largest takes its share
                    value = T + cut_in + rest + (self.m - 1) * np.maximum(T + cut_in, share) + S
                    ok = (M <= self.budget) & (lead <= self.cutoff) & (value < incumbent)
                    idx = np.flatnonzero(ok)
                    if len(idx):
                        grown.setdefault(s_out, []).append(
                            (T[idx], S[idx], M[idx], fr, idx // len(pts), idx % len(pts), pts))
            fronts = {}
            for s_out, parts in grown.items():
                points = sum(len(p[0]) for p in parts)
                if points > MAX_POINTS:
                    raise TooLarge(f"{points} points pricing stage {k} from unit {i}")
                (T, S, M), part, prev, pt, keep = _merged(
                    parts, narrow, lambda T, S, M: self.m * T + S)
                back = [(parts[part[r]][3], int(prev[r]), u, parts[part[r]][6][pt[r]][4])
                        for r in keep]
                fronts[s_out] = _Front(T[keep], S[keep], M[keep], back)
            self.intervals[key] = fronts
            out.append(fronts)
            if not fronts:
                break
        return out

    def suffix_bounds(self, incumbent: float) -> dict | None:
        """{(k, i, state): (least Σ T, least max T)} of stages k.. over units i.. entering
        with `state`, from the intervals' own least T (each least separately: both bound
        every completion below `incumbent`, the intervals having dropped only points that
        cannot beat it); None where the states at a cut are too many to price each."""
        U, pp = self.U, self.pp
        out = {(pp, U, ()): (0.0, 0.0)}
        for k in range(pp - 1, -1, -1):
            for i in ([0] if k == 0 else range(k, U - (pp - 1 - k))):
                counts = [len(self.units.problem.layers[s].strategies)
                          for s in self.units.open[i]]
                if math.prod(counts) > 16:
                    return None
                cut_in = self.cut[i] + self.replay if k > 0 else 0.0
                for state in itertools.product(*(range(c) for c in counts)):
                    best_sum = best_max = math.inf
                    for n, fronts in enumerate(self.interval(k, i, state, incumbent, False)):
                        j = i + n + 1
                        cut_out = self.cut[j] if k < pp - 1 else 0.0
                        for s_out, fr in fronts.items():
                            after = out.get((k + 1, j, s_out))
                            if after is None or not len(fr.T):
                                continue
                            t = float(fr.T.min()) + cut_in + cut_out
                            best_sum = min(best_sum, t + after[0])
                            best_max = min(best_max, max(t, after[1]))
                    out[(k, i, state)] = (best_sum, best_max)
        return out

    def run(self, incumbent: float, narrow: bool, bounds: dict | None = None):
        """(objective, starts, choice) of the best plan below `incumbent`, or None.
        Labels per (next unit, state): arrays sumT, maxT, maxS and back-references."""
        groups = {(0, ()): (np.zeros(1), np.zeros(1), np.zeros(1), [None])}
        for k in range(self.pp):
            groups = self._kept(self._placed(groups, k, incumbent, narrow, bounds), k, narrow)
            if not groups:
                return None
        return self._best(groups)

    def _placed(self, groups: dict, k: int, incumbent: float, narrow: bool,
                bounds: dict | None) -> dict:
        """Stage k placed after each label, from its next unit to every end its intervals
        reach, where the objective's bound stays below `incumbent` and the cutoff holds."""
        U, pp, m = self.U, self.pp, self.m
        grown: dict = {}
        for (i, state), (sumT, maxT, maxS, back) in groups.items():
            fronts_by_end = self.interval(k, i, state, incumbent, narrow)
            for n, fronts in enumerate(fronts_by_end):
                j = i + n + 1
                if k == pp - 1 and j != U:
                    continue
                cut_out = self.cut[j] if k < pp - 1 else 0.0
                cut_in = self.cut[i] + self.replay if k > 0 else 0.0
                rest = self.prefix[-1] - self.prefix[j]
                share = rest / (pp - 1 - k) if k < pp - 1 else 0.0
                for s_out, fr in fronts.items():
                    if bounds is not None:
                        rest, share = bounds.get((k + 1, j, s_out), (math.inf, math.inf))
                        if not math.isfinite(rest):
                            continue
                    pts = fr.ts
                    t = fr.T[pts] + cut_in + cut_out
                    s = fr.S[pts]
                    nsum = (sumT[:, None] + t[None, :]).ravel()
                    nmax = np.maximum(maxT[:, None], t[None, :]).ravel()
                    nS = np.maximum(maxS[:, None], s[None, :]).ravel()
                    value = nsum + rest + (m - 1) * np.maximum(nmax, share) + nS
                    ok = (value < incumbent) & (m * nmax + nS <= self.cutoff)
                    idx = np.flatnonzero(ok)
                    if len(idx):
                        grown.setdefault((j, s_out), []).append(
                            (nsum[idx], nmax[idx], nS[idx], back, idx // len(pts),
                             pts[idx % len(pts)], fr, i))
        return grown

    def _kept(self, grown: dict, k: int, narrow: bool) -> dict:
        """Per (next unit, state) the labels merged and kept (_merged)."""
        m = self.m
        groups = {}
        for key, parts in grown.items():
            self._check_time(f"placing stage {k}")
            (sumT, maxT, maxS), part, prev, pt, keep = _merged(
                parts, narrow, lambda sumT, maxT, maxS: sumT + (m - 1) * maxT + maxS)
            back = [(parts[part[r]][3], int(prev[r]), parts[part[r]][6], int(pt[r]),
                     parts[part[r]][7]) for r in keep]
            groups[key] = (sumT[keep], maxT[keep], maxS[keep], back)
        return groups

    def _best(self, groups: dict):
        """(objective, starts, choice) of the least label that ends at the last unit,
        read back through its references; None where none does."""
        best = None
        for (j, _), (sumT, maxT, maxS, back) in groups.items():
            if j != self.U:
                continue
            value = sumT + (self.m - 1) * maxT + maxS
            r = int(np.argmin(value))
            if best is None or value[r] < best[0]:
                best = (float(value[r]), back, r)
        if best is None:
            return None
        value, back, r = best
        choice = [0] * len(self.units.problem.layers)
        starts = []
        while back[r] is not None:
            prev_back, prev_r, fr, p, i = back[r]
            for u, ch in fr.choices(p).items():
                for layer, o in zip(self.units.members[u], ch):
                    choice[layer] = o
            starts.append(i)
            back, r = prev_back, prev_r
        return value, tuple(reversed(starts)), tuple(choice)


def solve(problem, pp: int, microbatches: int, flights: list[int],
          budget_bytes: float | None, cutoff_s: float | None = None,
          deadline: float = math.inf) -> DPSolution | None:
    """The least objective over cuts into pp stages (one per rank, stage k keeping
    `flights[k]` microbatches in flight) and strategies, as planner.pipeline.stage_dp.solve: None
    when nothing fits (or nothing has m·max T + max S under `cutoff_s`)."""
    if pp > len(problem.units) or any(not members for members in problem.unit_layers()):
        raise TooLarge("a unit without layers")
    solver = _Solver(problem, pp, microbatches, flights, budget_bytes, cutoff_s, deadline)
    first = solver.run(math.inf, narrow=True)
    incumbent = math.inf if first is None else first[0] * (1 + 1e-9)
    bounds = solver.suffix_bounds(incumbent)
    found = solver.run(incumbent, narrow=False, bounds=bounds)
    found = found or first
    if found is None:
        return None
    value, starts, choice = found
    return DPSolution(starts, choice, value)
