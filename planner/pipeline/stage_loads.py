"""A lower bound on chunked pipeline shapes that keeps the units whole: the least, over
contiguous stage cuts, of the busiest rank's work.

The chunked bound of planner.pipeline.stages shares the model's work evenly over the ranks, as if a
stage could end inside a transformer block. Blocks are whole, and a rank holds two stages
(a V-shaped schedule: the first and the last, ZBV and DualPipeV; a looped one: r and
pp + r), so the busiest rank does more than its share: on a 48-block GPT over 8 ranks of a
DualPipeV, the rank with the embedding and the head holds six blocks too. Its step is at
least

    lead_r + Σ over its units of min over options (m·t + s) + m·(its cut transfers)

where lead_r is the forward of microbatch 0 through the stages before its first one (it
cannot start earlier), t a layer's per-microbatch time, s its once-per-step time (a rank
waits for its own gradient sync and update: step = makespan + the slowest rank's part),
and each layer's m·t + s priced with one option, not two separate minima (the cheapest
microbatch option, replicated, syncs the most gradients). The least over cuts of the
largest of these is found by bisection on the step: a cut whose every rank fits under
tau exists iff a dynamic program over the ranks in turn reaches the end, and with the
rank's two stages as its state the rank's term splits into a part of the old state and a
part of the new one, so each step is a two-dimensional running minimum (O(U²) per rank,
U units; looped placements add the start of the second lap to the state).

Valid for every choice (each unit costs at least its least), every memory budget (memory
is not read: the bound only relaxes) and every schedule with that placement (no schedule
runs a rank's actions faster than back to back). Not offered for four chunks per rank
(None): the state would be four-dimensional; there `packing_bound` (the units whole but in
any order, by pigeonhole, in O(U log U)) stands in, and planner.pipeline.stages' chunked bound
includes it for every shape.

The bubble is left out. Paths through a rank's fill and drain (its lead, one microbatch's
trips through the stages between and after its own) fit the same dynamic program, and
were tried, up to eight per rank at once: the best cut escapes them by shortening the
stages those trips cross (a 48-block GPT, ZBV at pp 8 with 8 microbatches: 1.306 s raised
to 1.348 s, against 1.516 s simulated on its balanced cut, which no cut found by local
search beats); what the fill really costs runs through several ranks.
"""

from __future__ import annotations

import math

import numpy as np

from planner.pipeline import held_row, schedules

SETTLED = 1e-6  # bisection stops at this relative width
# multipliers of a memory row in the Lagrangian bounds (here and stages._dual_stage_bounds),
# besides 0, over 1e-3 to 1e3 of the work's scale: on a 405 B Llama's one-chunk shapes 15
# give bounds within 0.2% of 31's in half the time; 9 lose up to 4%
LAMBDAS = 15
# multipliers of the memory rows in busiest_rank_bound's dynamic program, each a pass of
# its own, over 1e-2 to 1e2 of the work's scale (a factor 3 apart)
MEMORY_DP_LAMBDAS = 9


def busiest_rank_bound(problem, pp: int, microbatches: int, schedule: str, chunks: int,
                       low_s: float, high_s: float, within: float = SETTLED,
                       budget_bytes: float | None = None, flights=None) -> float | None:
    """A lower bound on this shape's step, at least `low_s` (a bound already known): the
    least busiest-rank work over cuts (module docstring), found to within `within` of
    `high_s` (0: no bisection, `low_s` where a cut fits under `high_s`); where no cut fits
    under `high_s` (e.g. the incumbent), `high_s` itself. None where not offered (one
    chunk per rank, or four). With `budget_bytes` and `flights` (per stage, its
    microbatches in flight), each rank's work is also at least its memory row's
    Lagrangian at each of MEMORY_DP_LAMBDAS multipliers (memory_terms), every cut held to
    all of them: a cut must fit every rank, which memory_bound's units in any order do
    not ask (a 70 B Llama's head keeps its logits for each of 32 microbatches in flight
    under interleaved zero bubble over 32 ranks: no rank can hold it, where memory_bound
    let no rank hold it at 8.0 s)."""
    fits = _feasibility(problem, pp, microbatches, schedule, chunks)
    if fits is None:
        return None
    if budget_bytes is not None and flights is not None:
        tables = problem.tables
        least = np.where(np.isfinite(tables.microbatch_s), tables.microbatch_s, np.inf)
        scale = microbatches * float(least.min(axis=1) @ tables.counts.sum(axis=1))
        each = [fits] + [_feasibility(problem, pp, microbatches, schedule, chunks,
                                      memory_terms(problem, pp, microbatches, schedule, lam,
                                                   budget_bytes, flights))
                         for lam in scale / budget_bytes * np.geomspace(1e-2, 1e2,
                                                                        MEMORY_DP_LAMBDAS)]

        def fits(tau: float) -> bool:
            """Whether a cut keeps every rank under tau by its work and every Lagrangian;
            the one that last said no asked first (a bisection's no is then one pass)."""
            for k, f in enumerate(each):
                if not f(tau):
                    each.insert(0, each.pop(k))
                    return False
            return True
    if not fits(high_s):
        return high_s
    low, high = low_s, high_s
    if within <= 0 or fits(low):
        return low
    while high - low > within * high:
        mid = (low + high) / 2
        low, high = (low, mid) if fits(mid) else (mid, high)
    return low


def packing_bound(problem, pp: int, microbatches: int, schedule: str, chunks: int) -> float:
    """The busiest rank's work with the units whole but in any order: of the k·pp + 1
    largest units (their m·t + s, each priced with one option) some rank holds k + 1, at
    least the k + 1 smallest of them (the pigeonhole bound of scheduling on identical
    machines), and like every rank it pays at least 2·chunks - 1 transfers per microbatch
    (each stage's cut in and out, but for the model's first and last stage; one fewer on a
    V, whose turn stays on a rank), each at least the least cut. Weaker than the dynamic
    program where that runs, but for any placement and chunks, in O(U log U): on a
    48-block GPT over 8 ranks, 6 blocks and the head."""
    m = microbatches
    work = np.sort(_unit_work(problem.tables, m))[::-1]
    best = float(work.sum()) / pp
    k = 0
    while k * pp < len(work):
        best = max(best, float(work[k * pp - k:k * pp + 1].sum()))
        k += 1
    cuts = np.asarray(problem.cut_s[1:], float)
    hops = 2 * chunks - (2 if schedule in schedules.V_SHAPED else 1)
    sends = hops * m * float(cuts.min()) if len(cuts) else 0.0
    return best + sends


def memory_bound(problem, pp: int, microbatches: int, schedule: str, chunks: int,
                 budget_bytes: float, flights) -> float:
    """A lower bound on a chunked shape's step that reads memory: each rank's own work
    where it must fit `budget_bytes`, the units whole but in any order. `flights[k]`: the
    microbatches stage k keeps in flight (stages.in_flight).

    Rank r keeps at least f_r = min over its stages of flights[k] microbatches of every
    layer it holds, so for any λ >= 0 its m·R_r + S_r is at least
    Σ over its units of c_λ(u) - λ·budget + its transfers, where c_λ(u) sums over u's
    layers min over options (m·t + s + λ·(w + f_r·a)) and m times its least edges (the
    Lagrangian of its memory row, as stages._dual_stage_bounds). A rank holding n units
    pays at least its n cheapest; the busiest rank is at least the least τ under which
    the ranks can hold all U units (some n_r with Σ n_r = U, each at least `chunks`).
    The chunked bound of planner.pipeline.stages shares the memory of all ranks with one
    microbatch in flight: on a 70 B Llama over 256 H100s it left shapes that keep four
    microbatches of every block at 8 s, against 18 s and more here. Each rank's second
    memory row (planner.pipeline.held_row: FSDP's backward beside the rows) is priced
    the same way, the least over its τ, and the larger of the two rows' bounds kept."""
    m = microbatches
    tables = problem.tables
    U = len(problem.units)
    if pp * chunks > U:
        return math.inf
    ranks = schedules.placement(schedule, pp, chunks) if chunks > 1 else tuple(range(pp))
    f_rank = [min(f for f, q in zip(flights, ranks) if q == r) for r in range(pp)]
    t = m * tables.microbatch_s + tables.step_s  # padding: +inf, never the least
    w, a = tables.weight_bytes, tables.activation_bytes
    edges = m * tables.edge_least_s
    cuts = np.asarray(problem.cut_s[1:], float)
    hops = 2 * chunks - (2 if schedule in schedules.V_SHAPED else 1)
    sends = hops * m * float(cuts.min()) if len(cuts) else 0.0
    scale = float(t.min(axis=1).sum())
    best = 0.0
    lams = np.concatenate([[0.0], scale / budget_bytes * np.geomspace(1e-3, 1e3, LAMBDAS)])
    second = {f: held_row.lagrangian_by_unit(tables, t, f, lams[1:]) for f in set(f_rank)}
    for k, lam in enumerate(lams):
        cheapest = {}  # f -> prefix sums of the units' c_λ, cheapest first
        for f in set(f_rank):
            cost = tables.least_by_unit(t + lam * (w + f * a)) + edges
            cheapest[f] = np.concatenate([[0.0], np.cumsum(np.sort(cost))])
            if second[f] is not None and lam > 0:  # the second row too, the larger kept
                value, once = second[f]
                held = np.concatenate([np.zeros((len(value), 1)),
                                       np.cumsum(np.sort(value[:, k - 1] + edges, -1), -1)], -1)
                cheapest[f] = np.maximum(cheapest[f], (held + once[:, k - 1, None]).min(axis=0))
        least = [cheapest[f] - lam * budget_bytes + sends for f in f_rank]  # [n]: n units
        tau = np.unique(np.concatenate([q[chunks:] for q in least]))
        held = np.array([np.searchsorted(q, tau, side="right") - 1 for q in least])
        ok = (held.sum(axis=0) >= U) & (held >= chunks).all(axis=0)
        if ok.any():
            best = max(best, float(tau[np.argmax(ok)]))
    return best


def _unit_work(tables, m: int) -> np.ndarray:
    """Per unit, at least what it adds to its rank's step: Σ over its layers of min over
    options (m·t + s), each layer's two parts priced with one option, and m times its least
    edges."""
    work = tables.least_by_unit(m * tables.microbatch_s + tables.step_s)
    # or the per-step least apart and the microbatch part with its edges taken together
    # (planner.pipeline.unit_least): both are bounds, the larger kept
    joint = m * tables.unit_least_s + tables.unit_step_least_s
    return np.maximum(work + m * tables.edge_least_s, joint)


def _feasibility(problem, pp: int, m: int, schedule: str, chunks: int, terms=None):
    """tau -> whether some cut keeps every rank's work under tau; None where not offered.
    `terms` (memory_terms): per rank, the prices of its two stages' units and a constant,
    in place of its units' least work."""
    if chunks != 2 or pp < 2:
        return None
    tables = problem.tables
    U = len(problem.units)
    if pp * chunks > U:
        return lambda tau: False
    forward = tables.unit_least_s
    A = np.concatenate([[0.0], np.cumsum(forward)])
    cut = np.concatenate([np.asarray(problem.cut_s, float), [0.0]])
    cut[0] = 0.0  # no transfer before the first unit or after the last
    idx = np.arange(U + 1)
    if terms is None:
        R = np.concatenate([[0.0], np.cumsum(_unit_work(tables, m))])
        terms = [(R, R, 0.0)] * pp
    # the forward of microbatch 0 up to a stage starting there
    lead = (A + cut) * problem.forward_share
    shape = _v_shaped if schedule in schedules.V_SHAPED else _looped
    return shape(pp, U, m * cut, idx, terms, lead)


def memory_terms(problem, pp: int, m: int, schedule: str, lam: float, budget_bytes: float,
                 flights) -> list:
    """Per rank, (prefix sums of its first and its second stage's units' prices, a
    constant) for _feasibility: its work's Lagrangian at multiplier `lam`, each unit
    priced c_λ(u, f) = Σ over u's layers of min over options (m·t + s + λ·(w + f·a)) + m
    times its least edges, f its stage's microbatches in flight (`flights`, per stage),
    less λ·budget (as memory_bound, per stage)."""
    tables = problem.tables
    t = m * tables.microbatch_s + tables.step_s
    edges = m * tables.edge_least_s
    w, a = tables.weight_bytes, tables.activation_bytes
    prefix = {f: np.concatenate([[0.0], np.cumsum(tables.least_by_unit(t + lam * (w + f * a))
                                                  + edges)])
              for f in set(flights)}
    ranks = schedules.placement(schedule, pp, 2)
    mine = [[k for k in range(2 * pp) if ranks[k] == r] for r in range(pp)]
    return [(prefix[flights[a]], prefix[flights[b]], -lam * budget_bytes) for a, b in mine]


def _v_shaped(pp, U, sends, idx, terms, lead):
    """Rank r holds stages r = [i, i') and 2pp-1-r = [j', j); the state after rank r is
    (i', j'), from (0, U); the last rank's two stages meet (i' == j': the turn of the V,
    no transfer). The rank's term splits into a part of the old state (i, j) and one of
    the new (i', j'): with R1, R2 the prefix sums its two stages' units are priced by and
    c its constant (terms[r]), R1[i'] - R1[i] + R2[j] - R2[j'] + c and the transfers."""
    gap = idx[None, :] - idx[:, None]
    valid = [gap >= 2 * (pp - 1 - r) if r < pp - 1 else gap == 0 for r in range(pp)]
    parts = [((lead - R1 + sends)[:, None] + (R2 + sends)[None, :],
              ((R1 + sends)[:, None] - (R2 - sends)[None, :] if r < pp - 1
               else R1[:, None] - R2[None, :]) + c)
             for r, (R1, R2, c) in enumerate(terms)]

    def fits(tau: float) -> bool:
        reach = np.zeros((U + 1, U + 1), bool)
        reach[0, U] = True
        for r, (old, new) in enumerate(parts):
            least = _before_after(np.where(reach, old, math.inf))
            reach = (least + new <= tau) & valid[r]
            if not reach.any():
                return False
        return True

    return fits


def _looped(pp, U, sends, idx, terms, lead):
    """Rank r holds stages r = [i, i') and pp + r = [k, k'); the state after rank r is
    (i', k') for each start g of the second lap (stage pp), from (0, g) to (g, U)."""
    laps = idx[pp:U - pp + 1]  # each lap holds at least pp units
    G = len(laps)
    if G == 0:
        return lambda tau: False
    # single precision (the running minima over the third axis are most of the time),
    # read with a margin above its rounding: the answer only errs towards fitting
    parts = [(((lead - R1 + sends)[:, None] + (sends - R2)[None, :])[None].astype(np.float32),
              ((R1 + sends)[:, None] + (R2 + sends)[None, :] + c)[None].astype(np.float32))
             for R1, R2, c in terms]
    g = laps[:, None, None]
    i2, k2 = idx[None, :, None], idx[None, None, :]
    valid = [(i2 <= g - (pp - 1 - r)) & (k2 <= U - (pp - 1 - r)) & (k2 > g)
             if r < pp - 1 else (i2 == g) & (k2 == U) for r in range(pp)]

    def fits(tau: float) -> bool:
        reach = np.zeros((G, U + 1, U + 1), bool)
        reach[np.arange(G), 0, laps] = True
        alive = np.arange(G)  # the second-lap starts some cut still reaches
        for r, (old, new) in enumerate(parts):
            least = _before_before(np.where(reach, old, np.float32(math.inf)))
            reach = (least + new <= tau * (1 + 1e-5)) & valid[r][alive]
            keep = reach.any(axis=(1, 2))
            if not keep.any():
                return False
            alive, reach = alive[keep], reach[keep]
        return True

    return fits


def _before_after(h: np.ndarray) -> np.ndarray:
    """out[i', j'] = min of h[i, j] over i < i' and j > j'."""
    down = np.minimum.accumulate(h, axis=-2)
    down = np.concatenate([np.full_like(down[..., :1, :], math.inf), down[..., :-1, :]], -2)
    up = np.minimum.accumulate(down[..., ::-1], axis=-1)[..., ::-1]
    return np.concatenate([up[..., 1:], np.full(up.shape[:-1] + (1,), math.inf)], -1)


def _before_before(h: np.ndarray) -> np.ndarray:
    """out[..., i', k'] = min of h[..., i, k] over i < i' and k < k'."""
    down = np.minimum.accumulate(h, axis=-2)
    down = np.concatenate([np.full_like(down[..., :1, :], math.inf), down[..., :-1, :]], -2)
    right = np.minimum.accumulate(down, axis=-1)
    return np.concatenate([np.full_like(right[..., :1], math.inf), right[..., :-1]], -1)
