"""The "cp" baseline: the best context-parallel plan, cp x dp over the devices.

Every rank of a (dp, cp) mesh holds 1/cp of the sequences of its replica's rows (the
head-tail balanced chunks of executor.context_parallel), so each layer does 1/(cp·dp) of
the batch's per-token work: attention blocks under `ContextParallel(degree=cp)` (their K/V
all-gathered over the cp group, strategies.context), every other layer under `TokenShard`
(the model's own code on the rank's tokens); weights replicated with DDP over the whole
mesh, as `executor.context_parallel.apply` runs it, or FSDP2-sharded over it (the `+fsdp`
variants, as torchtitan runs long context); and, for a decoder traced by torch.export,
every transformer block under activation checkpointing or none (torchtitan's full AC,
planner.pipeline.block_recompute's variants).

Each (cp, weights, recompute) is the 1-D problem of planner.choices (one group of all N
devices, priced by planner.price) with one option per layer, so its step and memory are
the stage problem's `evaluate` and `peak_bytes` of that one assignment; the fastest that
fits wins (else the one needing least memory, reported as not fitting), which makes it
optimal for the cost model over the degrees. No layout changes between layers: each rank
runs the model's code on its tokens and the only collectives are attention's and the
weights' (in the options' prices), so the problem has no edges. The options are
planner.context_degrees.ContextGroup's, which the 3-D search's cp shapes offer too, where
the program picks weights and recomputation layer by layer; this kind holds each uniform
(the configurations torchtitan runs), and `or_context_parallel` is what a 1-D call falls
back to when its plan does not fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from planner.choices import Choices, layer_choices
from planner.context_degrees import (
    ContextGroup, all_sharded, degrees, mesh_plan, sequence_length, why_not_split,
)
from planner.pipeline import block_recompute
from planner.pipeline.stage_held import peak_bytes
from planner.pipeline.stages import StageSolution, evaluate
from planner.plan import ContextParallelPlan, Plan
from planner.plan3d import one_d_plan, stamped
from planner.price import step_overhead_s
from planner.problem import Solution
from planner.profiled import PlanDoesNotFit
from planner.search import CostCache
from profiler.graph import ModelGraph
from strategies.cluster import Cluster


def _choices(cache: CostCache, cp: int, sharded: bool, recompute: bool) -> Choices:
    """The 1-D problem of a cp plan, its edges dropped (module docstring); `recompute`:
    every transformer block under activation checkpointing (block_recompute's recomputed
    options in place of the plain ones: the block keeps its input, 1/N of it per rank, and
    runs its forward again in backward)."""
    graph = cache.graph
    choices = layer_choices(graph, cache.cluster, cache.optimizer, None, cache=cache,
                            group=ContextGroup(cp=cp, sharded=sharded))
    if not recompute:
        return choices
    return replace(choices, built=block_recompute.recompute_blocks(
        choices.built, graph, cache.cluster.num_devices, every=True))


@dataclass(frozen=True)
class Tried:
    """One (cp, sharded, recompute) candidate: its problem, the one assignment it has
    (each block's recomputed option where it recomputes), the step and its peak memory."""

    cp: int
    sharded: bool
    recompute: bool
    choices: Choices
    solution: Solution
    staged: StageSolution
    peak: list[float]
    step_s: float
    fits: bool

    def label(self) -> str:
        return (f"cp {self.cp}" + (" FSDP" if self.sharded else " DDP")
                + (" + full AC" if self.recompute else ""))


def priced(cache: CostCache, cp: int, sharded: bool, recompute: bool, budget: float
           ) -> Tried:
    """The cp plan at (cp, sharded, recompute): each layer has one option, so its step is
    the stage problem's evaluate of that assignment and its memory peak_bytes' (the rules
    every plan's figures read)."""
    choices = _choices(cache, cp, sharded, recompute)
    problem = choices.built.problem
    choice = (0,) * len(problem.layers)
    times = evaluate(problem, (0,), choice, 1, "1F1B")
    solution = Solution(choice, times.step_s, times.step_s, "optimal", 0.0,
                        "one option per layer")
    staged = choices.staged(solution)
    cluster = cache.cluster
    peak = peak_bytes(choices.built, staged, choices.shape, cluster, cache.optimizer,
                      set(cache.graph.outputs))
    return Tried(cp, sharded, recompute, choices, solution, staged, peak,
                 times.step_s + step_overhead_s(cluster), max(peak) <= budget)


def _why(best: Tried, tried: list[Tried]) -> str:
    """The degree chosen, the other fitting candidates' step times beside it, and what the
    others would need."""
    def ms(t: Tried) -> str:
        return f"{t.label()} {_step(t.step_s)}"

    head = (ms(best) + ", the fastest that fits" if best.fits else
            f"{best.label()}, the least memory ({max(best.peak) / 1e9:.3g} GB)")
    faster = [ms(t) for t in tried if t.fits and t is not best]
    over = [f"{t.label()} {max(t.peak) / 1e9:.3g} GB" for t in tried
            if not t.fits and t is not best]
    return (head + (f"; vs {'; '.join(faster)}" if faster else "")
            + (f"; not fitting: {', '.join(over)}" if over else ""))


def context_parallel(graph: ModelGraph, cluster: Cluster, optimizer: str, budget: float,
                     started: float, cp: int | None = None) -> Plan:
    """The best context-parallel plan of `graph` on `cluster` within `budget` bytes per
    device (module docstring); `cp`: that degree only."""
    n, batch = cluster.num_devices, graph.batch_size
    seq = sequence_length(graph)
    why = why_not_split(graph)
    if why:
        raise ValueError(f"baseline: 'cp' splits every sequence over ranks, which needs "
                         f"plainly causal attention and no padding mask, and {why}; use "
                         f"'fsdp' or mesh='3d'")
    cps = degrees(n, batch, seq)
    if cp is not None:
        if cp not in cps:
            raise ValueError(f"baseline: cp={cp} is not a degree of this job; it has "
                             f"{cps or 'none'} (cp divides the {n} devices and 2·cp the "
                             f"{seq}-token sequence, dp = devices / cp the batch of {batch})")
        cps = [cp]
    if not cps:
        raise ValueError(f"baseline: 'cp' needs a cp dividing the {n} devices with the "
                         f"{seq}-token sequence split into 2·cp equal chunks and the batch "
                         f"of {batch} split over dp = devices / cp; pad the sequence to an "
                         f"even length (2·cp: 4 for cp 2) or pass a batch dp divides")
    cache = CostCache(graph, cluster, optimizer)
    modes = (False, True) if block_recompute.offered(graph) else (False,)
    tried = [priced(cache, degree, sharded, recompute, budget)
             for degree in cps for sharded in (False, True) for recompute in modes]
    fitting = [t for t in tried if t.fits]
    best = (min(fitting, key=lambda t: t.step_s) if fitting
            else min(tried, key=lambda t: max(t.peak)))
    plan = one_d_plan(graph, cluster, optimizer, best.choices, best.solution, budget, None,
                      None, time.perf_counter() - started, staged=(best.staged, best.peak))
    record = ContextParallelPlan(degree=best.cp, sharded=all_sharded(plan.layers),
                                 why=_why(best, tried))
    return plan.model_copy(update={"mesh": mesh_plan(cluster, best.cp),
                                   "context_parallel": record,
                                   "layers": _reasons(plan.layers, best)})


def _reasons(layers, best: Tried) -> list:
    """Each layer's reason in a cp plan's terms (its one option: the plan-level why says
    why this degree): attention's K/V traffic, the weights' mode."""
    weights = "FSDP2-sharded over the mesh" if best.sharded else "replicated (DDP)"
    costs = {row.layer.name: row.costs[c] for row, c in
             zip(best.choices.layers, best.solution.choice)}
    out = []
    for layer in layers:
        notes = costs[layer.name].notes if layer.name in costs else {}
        if "kv_bytes" in notes:
            kv_s = (notes["kv_all_gather_s"] + notes["kv_reduce_scatter_s"]) * 1e3
            reason = (f"attention over cp {best.cp}: its queries' chunks against the "
                      f"sequence's K/V ({notes['kv_bytes'] / 1e6:.3g} MB all-gathered, their "
                      f"gradients reduce-scattered: {kv_s:.3g} ms per step); weights {weights}")
        else:
            reason = f"the model's own code on this rank's tokens; weights {weights}"
        out.append(layer.model_copy(update={"reason": reason}))
    return out


def contends(graph: ModelGraph, cluster: Cluster) -> bool:
    """Whether optimize weighs a context-parallel plan beside its own (`or_context_parallel`):
    where the batch has fewer sequences than there are devices (long context: one or
    two sequences of 128 K tokens on 8 GPUs), so that data parallelism alone cannot use
    them all, and the model has attention to split with a degree above 1."""
    n, batch = cluster.num_devices, graph.batch_size
    if n < 2 or batch >= n:
        return False
    try:
        seq = sequence_length(graph)
    except ValueError:
        return False
    return any(cp > 1 for cp in degrees(n, batch, seq))


def or_context_parallel(plan_of, graph: ModelGraph, cluster: Cluster, optimizer: str,
                        budget: float, started: float) -> Plan:
    """optimize's 1-D plan (`plan_of()`), or where it does not fit and a context-parallel
    plan `contends`, the best one (its default call, `hyplan plan --seq 131072`, would else
    end in "does not fit"), its mesh_choice saying so. Under mesh "3d" and "auto" the cp
    degrees are shapes of the 3-D search itself (planner.context_degrees)."""
    if not contends(graph, cluster):
        return plan_of()
    try:
        return plan_of()
    except PlanDoesNotFit as refused:
        try:
            cp = context_parallel(graph, cluster, optimizer, budget, started)
        except ValueError as error:  # a model the cp plan kind cannot take
            raise refused from error
        degree, t_cp = cp.context_parallel.degree, cp.predicted.step_time_s
        if degree == 1 or max(cp.predicted.memory_bytes) > budget:
            raise
        return stamped(cp, f"context parallel cp {degree} ({_step(t_cp)}): the 1-D plan "
                       f"does not fit", time.perf_counter() - started)


def _step(seconds: float) -> str:
    return f"{seconds:.3f} s" if seconds >= 1 else f"{seconds * 1e3:.4g} ms"
