"""Pipeline schedules as data: each rank's action list, taken from torch's own schedule
classes, and a simulation of it that gives the step's makespan, each rank's bubble and
the activations it keeps in flight.

A schedule runs `pp` ranks, `v` chunks (virtual stages) per rank and `m` microbatches over
S = pp·v global stages. Global stage s sits on rank `placement(...)[s]`: `r, r + pp, ...`
for the looped (interleaved) schedules, `r, 2·pp - 1 - r` for the V-shaped ones (ZBV,
DualPipeV), so that the turn of the V (stages pp - 1 and pp) stays on the last rank with
no transfer. Each rank's list holds F (forward), B (full backward), and for zero-bubble
schedules I (backward for the input: what the previous stage waits for) and W (backward
for the weights: free to fill a bubble). The lists come from torch.distributed.pipelining
(the multi-stage schedules' `_calculate_single_rank_operations`, run on a bare instance:
their construction reads nothing but pp, v and m, and needs no process group, so the planner prices exactly the
order the executor will run. GPipe and 1F1B, whose runtime loops are written out in
their `_step_microbatches`, take the same order from the published construction.

The simulation: each rank runs its list in order; an action starts when its rank is free
and its input is there:

    F(s, i)   after F(s-1, i) (+ one hop if s-1 lives on another rank)
    B/I(s, i) after B/I(s+1, i) (+ one hop), and after F(s, i)
    W(s, i)   after I(s, i)

and lasts forward_s[s], input_s[s] + weight_s[s] (B), input_s[s] (I) or weight_s[s] (W).
A rank's bubble is the makespan less its busy time. Activations of (s, i) are held from
F(s, i) until its backward is complete (B, or W where the backward is split: the weight
gradient still reads the layer inputs); since a rank runs its list in order, the count in
flight depends on the order only, not on the times.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble",
             "DualPipeV")
SINGLE = ("GPipe", "1F1B")  # one stage per rank
V_SHAPED = ("ZBVZeroBubble", "DualPipeV")  # exactly two chunks per rank, V placement
SPLIT_BACKWARD = ("InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")
LABELS = {"GPipe": "GPipe", "1F1B": "1F1B", "Interleaved1F1B": "interleaved 1F1B",
          "InterleavedZeroBubble": "interleaved zero-bubble",
          "ZBVZeroBubble": "ZBV zero-bubble", "DualPipeV": "DualPipeV"}


class Act(NamedTuple):
    """One compute action: global stage, kind (F, B, I or W) and microbatch."""

    stage: int
    kind: str
    microbatch: int


def chunks_allowed(schedule: str, pp: int) -> tuple[int, ...]:
    """The chunks per rank (v) the planner offers a schedule: one for GPipe and 1F1B, two
    for the V-shaped ones (torch requires it), two or four for the interleaved ones."""
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule: {schedule!r} is not one of {SCHEDULES}")
    if schedule in SINGLE or pp == 1:
        return (1,) if schedule in SINGLE else ()
    if schedule in V_SHAPED:
        return (2,)
    return (2, 4)


def refusal(schedule: str, pp: int, v: int, m: int) -> str | None:
    """Why torch 2.13 refuses (or the executor does not run) this schedule at pp ranks, v
    chunks and m microbatches; None when it runs."""
    if schedule not in SCHEDULES:
        return f"schedule: {schedule!r} is not one of {SCHEDULES}"
    if schedule in SINGLE:
        if v != 1:
            return f"{schedule} runs one stage per rank, not {v}"
        if schedule == "1F1B" and m < pp:
            return f"1F1B needs at least as many microbatches as stages ({m} < {pp})"
        return None
    if pp < 2:
        return f"{schedule} needs at least 2 pipeline ranks"
    if schedule in V_SHAPED and v != 2:
        return f"{schedule} needs exactly 2 chunks per rank, not {v}"
    if v < 2:
        return f"{schedule} needs at least 2 chunks per rank"
    if m < pp:
        return (f"{schedule} with fewer microbatches than ranks ({m} < {pp}) leaves ranks "
                f"idle a whole round (torch runs it; the planner does not offer it)")
    if schedule == "DualPipeV" and m < pp * v:
        return f"DualPipeV needs at least as many microbatches as stages ({m} < {pp * v})"
    if schedule in ("Interleaved1F1B", "InterleavedZeroBubble"):
        rounds = max(1, m // pp)
        if m % rounds:
            return (f"{schedule} needs the microbatches ({m}) to be a multiple of the rounds "
                    f"max(1, m // pp) = {rounds}")
    return None


@lru_cache(maxsize=512)
def placement(schedule: str, pp: int, v: int) -> tuple[int, ...]:
    """The rank of each global stage (torch's generate_stage_to_rank_mapping)."""
    from torch.distributed.pipelining._utils import generate_stage_to_rank_mapping

    style = "v" if schedule in V_SHAPED else "loop"
    mapping = generate_stage_to_rank_mapping(pp, pp * v, style=style)
    return tuple(mapping[s] for s in range(pp * v))


@lru_cache(maxsize=512)
def actions(schedule: str, pp: int, v: int, m: int) -> tuple[tuple[Act, ...], ...]:
    """Each rank's compute actions in the order torch runs them. Prices what torch would
    refuse at this m too (1F1B with m < pp); the search offers only what runs (refusal)."""
    why = refusal(schedule, pp, v, max(m, pp * v))
    if why:
        raise ValueError(f"schedule: {why}")
    if pp == 1:  # no pipeline: each microbatch forward then backward
        return (tuple(a for i in range(m) for a in (Act(0, "F", i), Act(0, "B", i))),)
    from torch.distributed.pipelining import schedules as ts

    if schedule in SINGLE:
        return tuple(_single_stage_order(schedule, pp, m, r) for r in range(pp))
    cls = ts.get_schedule_class(schedule)
    bare = object.__new__(cls)  # the order needs pp, v and m only: no stages, no group
    bare._n_microbatches = m
    bare._num_stages = bare.num_stages = pp * v
    bare.pp_group_size, bare.n_local_stages = pp, v
    bare.number_of_rounds = max(1, m // pp)
    bare.microbatches_per_round = m // bare.number_of_rounds
    order = {r: bare._calculate_single_rank_operations(r) for r in range(pp)}
    if schedule == "InterleavedZeroBubble":
        bare.pipeline_order = order
        order = bare._add_bubbles_to_actions(pp * v)
    # torch's computation types by member (reading an enum's .value per action was a
    # third of the time); the compute kinds only
    kinds = {t: t.value for t in ts._ComputationType if t.value in ("F", "B", "I", "W")}
    out = []
    for r in range(pp):
        mine = []
        for a in order[r]:
            if a is None:
                continue
            for leaf in (a.sub_actions or (a,)):  # an overlapped F+B runs both
                kind = kinds.get(leaf.computation_type)
                if kind is not None:
                    mine.append(Act(leaf.stage_index, kind, leaf.microbatch_index))
        out.append(tuple(mine))
    return tuple(out)


def _single_stage_order(schedule: str, pp: int, m: int, rank: int) -> tuple[Act, ...]:
    """GPipe: every forward, then every backward. 1F1B: pp - rank - 1 forwards, then one
    forward and one backward in turn, then the remaining backwards: the order
    Schedule1F1B._step_microbatches runs (its `_get_pipeline_order`, a picture helper,
    skips microbatch 0's forward on the last rank, so it is not used here)."""
    if schedule == "GPipe":
        return (tuple(Act(rank, "F", i) for i in range(m))
                + tuple(Act(rank, "B", i) for i in range(m)))
    warmup = min(pp - rank - 1, m)
    order = [Act(rank, "F", i) for i in range(warmup)]
    for i in range(m - warmup):
        order += [Act(rank, "F", warmup + i), Act(rank, "B", i)]
    order += [Act(rank, "B", i) for i in range(m - warmup, m)]
    return tuple(order)


@dataclass(frozen=True)
class Timed:
    rank: int
    stage: int
    kind: str  # F, B, I or W
    microbatch: int
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Simulation:
    """A schedule run with given times: every action's start and end, and per rank its
    busy time, its bubble (makespan - busy) and its peak activations in flight."""

    schedule: str
    pp: int
    chunks: int
    microbatches: int
    actions: tuple[Timed, ...]
    makespan_s: float
    busy_s: tuple[float, ...]
    in_flight: tuple[int, ...]  # per global stage: its microbatches held at once, at most
    peak_activation_bytes: tuple[float, ...]  # per rank, from the order itself

    @property
    def bubble_s(self) -> tuple[float, ...]:
        return tuple(self.makespan_s - b for b in self.busy_s)

    @property
    def busiest_rank(self) -> int:
        return max(range(self.pp), key=lambda r: self.busy_s[r])

    @property
    def busiest_bubble_s(self) -> float:
        """The bubble of the busiest rank: what the schedule adds to its work."""
        return self.bubble_s[self.busiest_rank]


@lru_cache(maxsize=512)
def in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[int, ...]:
    """Per global stage, the most microbatches whose activations it holds at once."""
    return _memory(schedule, pp, v, m, None)[0]


def _memory(schedule, pp, v, m, activation_bytes):
    ranks = placement(schedule, pp, v) if pp > 1 else (0,) * v
    peak = [0] * (pp * v)
    peak_bytes = [0.0] * pp
    for r, order in enumerate(actions(schedule, pp, v, m)):
        live = {s: 0 for s in range(pp * v) if ranks[s] == r}
        held = 0.0
        # a B frees its activations unless a W of the same microbatch follows (DualPipeV
        # mixes full and split backwards on one stage)
        split = {(a.stage, a.microbatch) for a in order if a.kind == "W"}
        for a in order:
            if a.kind == "F":
                live[a.stage] += 1
                held += activation_bytes[a.stage] if activation_bytes else 0.0
                peak[a.stage] = max(peak[a.stage], live[a.stage])
                peak_bytes[r] = max(peak_bytes[r], held)
            elif a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
                live[a.stage] -= 1
                held -= activation_bytes[a.stage] if activation_bytes else 0.0
    return tuple(peak), tuple(peak_bytes)


def simulate(schedule: str, pp: int, v: int, m: int, forward_s, input_s, weight_s,
             hop_s: float = 0.0, activation_bytes=None, record: bool = True) -> Simulation:
    """Run the schedule's action lists with per-global-stage times (a full backward takes
    input_s + weight_s) and `hop_s` per transfer between ranks; `record` False leaves the
    timed actions out (what only the makespan and bubbles need).

    Each rank takes its next action while what it waits for is done: a forward, the
    forward of the stage before (plus a hop if that stage is on another rank); a weight
    gradient, its input gradient; a backward or input gradient, its own forward and the
    next stage's input gradient (plus a hop). The search prices every stage cut it weighs
    this way, so the loop is written out over lists (a method call per action was half
    of it)."""
    S = pp * v
    for name, xs in (("forward_s", forward_s), ("input_s", input_s), ("weight_s", weight_s)):
        if len(xs) != S:
            raise ValueError(f"{name}: {len(xs)} values for {S} stages (pp {pp} x v {v})")
    ranks = placement(schedule, pp, v) if pp > 1 else (0,) * v
    orders = actions(schedule, pp, v, m)
    # per kind, per stage: how long an action takes (a full backward: both gradients)
    duration = {"F": [float(x) for x in forward_s], "I": [float(x) for x in input_s],
                "W": [float(x) for x in weight_s]}
    duration["B"] = [i + w for i, w in zip(duration["I"], duration["W"])]
    # the hop between stage s and s + 1: none where both are on one rank (a V's turn)
    hop = [hop_s if ranks[s] != ranks[s + 1] else 0.0 for s in range(S - 1)]
    last = S - 1
    # end times per (stage, microbatch): forward, input gradient (what the stage before
    # waits for), weight gradient; None until done
    f = [[None] * m for _ in range(S)]
    g = [[None] * m for _ in range(S)]
    w = [[None] * m for _ in range(S)]
    free = [0.0] * pp
    busy = [0.0] * pp
    nxt = [0] * pp
    timed: list[Timed] = []
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for r in range(pp):
            order = orders[r]
            n, count = nxt[r], len(order)
            while n < count:
                s, kind, i = order[n]
                if kind == "F":
                    if s == 0:
                        ready = 0.0
                    else:
                        ready = f[s - 1][i]
                        if ready is None:
                            break
                        ready = ready + hop[s - 1]
                elif kind == "W":
                    ready = g[s][i]
                    if ready is None:
                        break
                else:
                    ready = f[s][i]
                    if ready is None:
                        break
                    if s != last:
                        after = g[s + 1][i]
                        if after is None:
                            break
                        ready = max(ready, after + hop[s])
                start = free[r] if free[r] > ready else ready
                end = start + duration[kind][s]
                if record:
                    timed.append(Timed(r, s, kind, i, start, end))
                if kind == "F":
                    f[s][i] = end
                elif kind == "B":
                    g[s][i] = w[s][i] = end
                elif kind == "I":
                    g[s][i] = end
                else:
                    w[s][i] = end
                free[r] = end
                busy[r] += end - start
                n += 1
                remaining -= 1
                progressed = True
            nxt[r] = n
        if not progressed:
            stuck = {r: orders[r][nxt[r]] for r in range(pp) if nxt[r] < len(orders[r])}
            raise AssertionError(f"{schedule} (pp {pp}, v {v}, m {m}) deadlocked at {stuck}")
    if activation_bytes is None:  # the counts depend on the order alone
        flight, peak_bytes = in_flight(schedule, pp, v, m), (0.0,) * pp
    else:
        flight, peak_bytes = _memory(schedule, pp, v, m, activation_bytes)
    return Simulation(schedule, pp, v, m, tuple(timed), max(free), tuple(busy), flight,
                      peak_bytes)


def parts(forward: float = 1 / 3) -> dict[str, float]:
    """The share of a stage's per-microbatch time each action takes, `forward` the
    forward's (profiler.whole_step.forward_share; a third by FLOPs: a matmul's backward is
    two products of its forward's size): the backward's rest in two halves, input and
    weight gradient, or whole where a schedule does not split it."""
    back = 1.0 - forward
    return {"F": forward, "I": back / 2, "W": back / 2, "B": back}


@lru_cache(maxsize=4096)
def uniform_bubble(schedule: str, pp: int, v: int, m: int, forward: float = 1 / 3) -> float:
    """The busiest rank's bubble, in chunk times, when every chunk takes 1 (`parts` of it
    forward, input gradient and weight gradient) and hops are free: the schedule's own
    bubble, what the stage cut's integer program charges it (planner.pipeline.stages)."""
    S = pp * v
    share = parts(forward)
    return simulate(schedule, pp, v, m, [share["F"]] * S, [share["I"]] * S, [share["W"]] * S,
                    record=False).busiest_bubble_s


def price(schedule: str, pp: int, v: int, m: int, microbatch_s, hop_s: float = 0.0,
          activation_bytes=None, forward: float = 1 / 3, record: bool = True) -> Simulation:
    """The simulation the planner prices a stage cut with and the timeline picture draws:
    each global stage's per-microbatch time (compute, its collectives and its blocking
    transfers) split into forward, input gradient and weight gradient by `parts`."""
    share = parts(forward)
    times = [float(t) for t in microbatch_s]
    return simulate(schedule, pp, v, m, [t * share["F"] for t in times],
                    [t * share["I"] for t in times], [t * share["W"] for t in times], hop_s,
                    activation_bytes, record)
