"""The "cp" baseline: the best context-parallel plan, cp x dp over the devices.

Every rank of a (dp, cp) mesh holds 1/cp of the sequences of its replica's rows (the
head-tail balanced chunks of executor.context_parallel), so each layer does 1/(cp·dp) of
the batch's per-token work: attention blocks under `ContextParallel(degree=cp)` (their K/V
all-gathered over the cp group, strategies.context), every other layer under `TokenShard`
(the model's own code on the rank's tokens); weights replicated with DDP over the whole
mesh, as `executor.context_parallel.apply` runs it, or FSDP2-sharded over it (the `+fsdp`
variants, as torchtitan runs long context), each module optionally recomputed
(activation checkpointing) where memory binds.

It is the 1-D problem of planner.choices (one group of all N devices, priced by
planner.price, solved by planner.ilp within memory) with a rule that keeps those options,
once per (cp, sharded); the fastest that fits wins (else the one needing least memory,
reported as not fitting). No layout changes between layers: each rank runs the model's
code on its tokens and the only collectives are attention's and the weights' (in the
options' prices), so the problem has no edges. Enumerating the few degrees and solving
each exactly makes the winner optimal for the cost model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

from planner.choices import Choices, layer_choices
from planner.fit import solve_within_memory, staged_peak
from planner.ilp import solve
from planner.offers import OneGroup
from planner.plan import ContextParallelPlan, MeshPlan, Plan
from planner.plan3d import one_d_plan
from planner.price import group_link, step_overhead_s
from planner.profiled import PlanDoesNotFit
from planner.search import CostCache
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Strategy
from strategies.cluster import Cluster
from strategies.context import (
    ContextParallel,
    ShardedContextParallel,
    ShardedTokenShard,
    TokenShard,
)
from strategies.gpu_compute import attention_dims
from strategies.memory import Recompute


def is_attention(layer: Layer) -> bool:
    """An attention block the executor splits by sequence: a leaf with heads and weights,
    [batch, seq, hidden] out (strategies.gpu_compute.attention_dims)."""
    return not layer.is_input and attention_dims(layer) is not None


def sequence_length(graph: ModelGraph) -> int:
    """The tokens per sequence: the attention blocks' output dim 1. Raises for a model
    with no attention to split."""
    lengths = {layer.output.shape[1] for layer in graph.layers if is_attention(layer)}
    if not lengths:
        raise ValueError(f"baseline: 'cp' splits the sequence inside attention blocks, and "
                         f"{graph.model_name} has none (a leaf module with heads, "
                         f"[batch, seq, hidden] out; register your own with "
                         f"strategies.register_attention); use 'ddp' or 'fsdp'")
    if len(lengths) > 1:
        raise ValueError(f"baseline: 'cp' needs one sequence length, {graph.model_name}'s "
                         f"attention blocks see {sorted(lengths)}")
    return lengths.pop()


def degrees(devices: int, batch: int, seq: int) -> list[int]:
    """The cp degrees of N devices: cp >= 2 dividing N whose 2·cp chunks split the
    sequence, with the batch's rows split evenly over dp = N / cp."""
    return [cp for cp in range(2, devices + 1)
            if devices % cp == 0 and seq % (2 * cp) == 0 and batch % (devices // cp) == 0]


@dataclass(frozen=True)
class _ContextGroup(OneGroup):
    """The options a cp plan allows: its rule's, on every layer (a tied embedding and
    head too: under cp they run on the rank's tokens like any other layer)."""

    def allowed(self, layer: Layer, options: list[Strategy], tied: bool) -> list[Strategy]:
        return self.keep(layer, options)


def keep_rule(cp: int, sharded: bool):
    """The options of each layer at cp `cp`: attention under ContextParallel, the rest on
    its tokens, `sharded` (FSDP2 over the group) where a module has weights, each module
    also recomputed."""
    def keep(layer: Layer, options: list[Strategy]) -> list[Strategy]:
        if layer.is_input:
            return [TokenShard()]
        if is_attention(layer):
            base = (ShardedContextParallel if sharded else ContextParallel)(degree=cp)
        else:
            shard = sharded and layer.param_bytes > 0 and layer.op == "call_module"
            base = ShardedTokenShard() if shard else TokenShard()
        return [base, Recompute(inner=base)] if layer.op == "call_module" else [base]
    return keep


def _choices(cache: CostCache, cp: int, sharded: bool, budget: float | None) -> Choices:
    """The 1-D problem of a cp plan, its edges dropped (module docstring)."""
    graph = cache.graph
    choices = layer_choices(graph, cache.cluster, cache.optimizer, budget, cache=cache,
                            group=_ContextGroup(levers=False, keep=keep_rule(cp, sharded)))
    built = replace(choices.built, problem=replace(choices.built.problem, edges=()))
    return replace(choices, problem=replace(choices.problem, edges=()), built=built)


@dataclass(frozen=True)
class Tried:
    """One (cp, sharded) candidate: its problem, solution, staged form and peak memory."""

    cp: int
    sharded: bool
    choices: Choices
    solution: object
    staged: object
    peak: list[float]
    step_s: float
    fits: bool

    def label(self) -> str:
        return f"cp {self.cp}" + (" FSDP" if self.sharded else " DDP")


def _try(cache: CostCache, cp: int, sharded: bool, budget: float, time_limit_s: float
         ) -> Tried:
    """The best plan at (cp, sharded) within `budget`, or without a limit where none fits
    (then reported as not fitting)."""
    cluster, optimizer, outputs = cache.cluster, cache.optimizer, cache.graph.outputs
    try:
        choices = _choices(cache, cp, sharded, budget)
        solution, staged, peak = solve_within_memory(choices, budget, time_limit_s, optimizer,
                                                     cluster, outputs)
    except PlanDoesNotFit:
        choices = _choices(cache, cp, sharded, None)
        solution = solve(choices.problem, time_limit_s)
        staged, peak = staged_peak(choices, solution, cluster, optimizer, outputs)
    return Tried(cp, sharded, choices, solution, staged, peak,
                 solution.objective_s + step_overhead_s(cluster), max(peak) <= budget)


def _why(best: Tried, tried: list[Tried]) -> str:
    """The degree chosen and the others' step times or memory beside it."""
    def said(t: Tried) -> str:
        state = (f"{t.step_s * 1e3:.4g} ms" if t.fits
                 else f"does not fit ({max(t.peak) / 1e9:.3g} GB)")
        return f"{t.label()} {state}"
    others = "; ".join(said(t) for t in tried if t is not best)
    head = said(best) + (", the fastest that fits" if best.fits else ", the least memory")
    return head + (f"; vs {others}" if others else "")


def context_parallel(graph: ModelGraph, cluster: Cluster, optimizer: str, budget: float,
                     started: float, time_limit_s: float = 60.0) -> Plan:
    """The best context-parallel plan of `graph` on `cluster` within `budget` bytes per
    device (module docstring)."""
    n, batch = cluster.num_devices, graph.batch_size
    seq = sequence_length(graph)
    cps = degrees(n, batch, seq)
    if not cps:
        raise ValueError(f"baseline: 'cp' needs cp >= 2 dividing the {n} devices with the "
                         f"{seq}-token sequence split into 2·cp equal chunks and the batch "
                         f"of {batch} split over dp = devices / cp; pad the sequence to a "
                         f"multiple of 2·cp (4 for cp 2) or pass a batch dp divides")
    cache = CostCache(graph, cluster, optimizer)
    tried = [_try(cache, cp, sharded, budget, time_limit_s)
             for cp in cps for sharded in (False, True)]
    fitting = [t for t in tried if t.fits]
    best = (min(fitting, key=lambda t: t.step_s) if fitting
            else min(tried, key=lambda t: max(t.peak)))
    plan = one_d_plan(graph, cluster, optimizer, best.choices, best.solution, budget, None,
                      None, time.perf_counter() - started, staged=(best.staged, best.peak))
    record = ContextParallelPlan(degree=best.cp, sharded=best.sharded, why=_why(best, tried))
    return plan.model_copy(update={"mesh": mesh_plan(cluster, best.cp),
                                   "context_parallel": record})


def mesh_plan(cluster: Cluster, cp: int) -> MeshPlan:
    """The ("dp", "cp") mesh: cp groups of consecutive ranks (inside a node where cp fits
    one), dp groups across them; executor.context_parallel builds it with these names."""
    n = cluster.num_devices
    dp = n // cp
    groups = {"cp": [list(range(d * cp, (d + 1) * cp)) for d in range(dp)],
              "dp": [list(range(c, n, cp)) for c in range(cp)]}
    links = {"cp": group_link(cluster, cp).name}
    if dp > 1:
        links["dp"] = group_link(cluster, n).name
    return MeshPlan(shape=[dp, cp], dim_names=["dp", "cp"], device_type=cluster.device.kind,
                    nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
                    groups=groups, group_links=links)
