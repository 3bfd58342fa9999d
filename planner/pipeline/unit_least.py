"""Each unit's least per-microbatch time with its layers' options taken together.

The stage bounds priced a unit (a transformer block) as Σ each layer's least time plus Σ
each edge's least layout change. A block cannot have both at once: its layers' least
options disagree on layouts (the attention's least is column-parallel, the layer after it
is least replicated), and the edges between them then pay gathers that the separate
minima never see. On a 48-block GPT over 64 A100s that slack kept one pipelined shape's
bound 0.09% under the best plan, and the search from calling its answer optimal.

The joint least is a min-sum problem on the unit's own graph: one variable per layer (its
option), a unary term per layer (its time), a pairwise term per edge inside the unit, and
for an edge from outside the unit its least over the source's options (the source's unit
prices its own options; the sum over units stays below any whole assignment's time). It is
solved exactly by variable elimination, smallest table first: a block keeps a few layers
alive at a time (the residual stream), so the tables stay small. A unit whose tables would
grow past ELIMINATION_LIMIT entries keeps the separate minima, which are still a bound.

A block offered recomputed whole (planner.pipeline.block_recompute) runs all its recomputed options
or none: each of the two is solved with the other's options barred, and the lesser kept.
Repeated units (a transformer's blocks) are solved once.
"""

from __future__ import annotations

import heapq
import itertools
import math

import numpy as np

# entries of the largest intermediate table; past it a unit keeps the separate minima
ELIMINATION_LIMIT = 1 << 20


def unit_least_s(problem) -> np.ndarray:
    """Per unit of a planner.pipeline.stages.StageProblem: the least over its layers' options of
    Σ their microbatch times + Σ the edges into its layers (module docstring). At least
    `layer_least_s + edge_least_s` of its tables, and a lower bound on the unit's part of
    any stage's per-microbatch time."""
    U = len(problem.units)
    layers_of = problem.unit_layers()
    unit_of = [layer.unit for layer in problem.layers]
    edges_into: list[list] = [[] for _ in range(U)]
    for e in problem.edges:
        edges_into[unit_of[e.dst]].append(e)
    out = np.zeros(U)
    solved: dict[tuple, float] = {}
    # repeated units share their arrays (planner.search.build): told apart by identity
    # first, their bytes read once per distinct unit (a 405 B Llama: 126 blocks alike)
    same: dict[tuple, float] = {}
    arrays = [(id(layer.microbatch_s), id(layer.recomputed)) for layer in problem.layers]
    for u in range(U):
        local = {layer: k for k, layer in enumerate(layers_of[u])}
        ident = (tuple([arrays[i] for i in layers_of[u]]),
                 tuple([(local.get(e.src), local[e.dst], id(e.cost_s))
                        for e in edges_into[u]]))
        if ident in same:
            out[u] = same[ident]
            continue
        inner, outer = [], []
        for e in edges_into[u]:
            cost = np.asarray(e.cost_s, float)
            if e.src in local:
                inner.append((e.src, e.dst, cost))
            else:
                outer.append((e.dst, cost.min(axis=0)))
        unary = [np.asarray(problem.layers[i].microbatch_s, float).copy()
                 for i in layers_of[u]]
        for dst, least in outer:
            unary[local[dst]] += least
        pairs = [(local[s], local[d], c) for s, d, c in inner]
        flags = [problem.layers[i].recomputed for i in layers_of[u]]
        key = _key(unary, pairs, flags)
        if key not in solved:
            solved[key] = _with_linked_blocks(unary, pairs, flags)
        out[u] = same[ident] = solved[key]
    return out


def _key(unary, pairs, flags) -> tuple:
    return (tuple(a.tobytes() for a in unary),
            tuple((s, d, c.shape, c.tobytes()) for s, d, c in pairs),
            tuple(None if f is None else np.asarray(f).tobytes() for f in flags))


def _with_linked_blocks(unary, pairs, flags) -> float:
    """The least with a recomputed block's layers all recomputed or all plain."""
    if all(f is None for f in flags):
        return _separable_or_joint(unary, pairs)
    best = math.inf
    for recompute in (False, True):
        barred = [a if f is None else np.where(np.asarray(f, bool) == recompute, a, math.inf)
                  for a, f in zip(unary, flags)]
        best = min(best, _separable_or_joint(barred, pairs))
    return best


def _separable_or_joint(unary, pairs) -> float:
    joint = min_sum(unary, pairs)
    if joint is not None:
        return joint
    return float(sum(a.min() for a in unary) + sum(c.min() for _, _, c in pairs))


def min_sum(unary: list[np.ndarray], pairs: list[tuple[int, int, np.ndarray]],
            limit: int = ELIMINATION_LIMIT) -> float | None:
    """min over x of Σ_i unary[i][x_i] + Σ_(s, d, c) c[x_s, x_d], exactly, by variable
    elimination (each step eliminates the variable whose joined table is smallest, kept in
    a heap: a unit of 800 layers in a chain took 23 s when every step looked at every
    variable); None where some step's table would pass `limit` entries."""
    domains = [len(a) for a in unary]
    factors: dict[int, tuple[tuple[int, ...], np.ndarray]] = {}
    of: list[set[int]] = [set() for _ in unary]  # variable -> its factors
    near: list[set[int]] = [set() for _ in unary]  # variable -> those it shares one with
    ids = itertools.count()

    def add(scope: tuple[int, ...], table: np.ndarray) -> None:
        k = next(ids)
        factors[k] = (scope, table)
        for v in scope:
            of[v].add(k)
            near[v].update(w for w in scope if w != v)

    for i, a in enumerate(unary):
        add((i,), a)
    for s, d, c in pairs:
        add((s, d), c)

    def size(v: int) -> int:
        return domains[v] * math.prod(domains[w] for w in near[v])

    heap = [(size(v), v) for v in range(len(unary))]
    heapq.heapify(heap)
    gone: set[int] = set()
    total = 0.0
    while heap:
        entries, v = heapq.heappop(heap)
        if v in gone or entries != size(v):  # eliminated, or a stale entry
            continue
        if entries > limit:
            return None
        scope = sorted(near[v] | {v})
        table = np.zeros([domains[w] for w in scope])
        for k in of[v]:
            s, f = factors.pop(k)
            table = table + _aligned(s, f, scope, domains)
            for w in s:
                if w != v:
                    of[w].discard(k)
        gone.add(v)
        rest = tuple(w for w in scope if w != v)
        for w in rest:
            near[w].discard(v)
        reduced = table.min(axis=scope.index(v))
        if rest:
            add(rest, reduced)
            for w in rest:
                heapq.heappush(heap, (size(w), w))
        else:
            total += float(reduced)
    return total


def _aligned(scope_of_f: tuple[int, ...], f: np.ndarray, scope: list[int],
             domains: list[int]) -> np.ndarray:
    """`f` over `scope_of_f`, its axes in `scope`'s order, broadcastable over `scope`."""
    order = sorted(range(len(scope_of_f)), key=lambda k: scope.index(scope_of_f[k]))
    f = np.transpose(f, order) if len(order) > 1 else f
    return f.reshape([domains[w] if w in scope_of_f else 1 for w in scope])
