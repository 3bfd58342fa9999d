"""The plans a practitioner would write by hand, costed by the same model as hyplan's own.

`baseline(model, devices, "ddp")` is pure data parallelism (every layer replicated, batch
split, gradients all-reduced); `"tensor"` is Megatron-style tensor parallelism (every layer
that has a model-parallel strategy uses one, the rest run on the whole batch on every
device); `"fsdp"` shards every layer's weights, gradients and optimizer state over the
devices (FSDP2) and, like DDP, runs every layer on its rank's rows. Each of these is one
entry of `BASELINES`: a rule that says which of a layer's candidate strategies the
baseline allows; the integer program then picks among those (e.g. column vs row split), so
each baseline is the best plan of its kind.
`summarize` is what a plan records of each: step time, communication (time and bytes sent
per device), memory per device and whether it fits; one that does not fit is reported by
what it needs, never as a speed to beat.
`"pipeline"` is the best pipeline without tensor parallelism (pp >= 2 stages, data-parallel
replicas of the pipeline on the rest of the devices), found by the 3-D search restricted to
those mesh shapes.
`"fsdp_tp"` is 2-D FSDP x TP as torchtitan runs Llama 3 70 B (FSDP 32 x TP 8 on 32 nodes of
8): one stage, tensor parallel over a tp group inside a node, and every layer that FSDP2
can shard (planner.dp_shard.offered) fully sharded over the dp group ("+fsdp"); the search
picks each layer's strategy over tp, the microbatches and whole-block recompute (torchtitan's
activation checkpointing), so it is the best plan of that kind.
`"ep"` is expert parallelism on a 1-D mesh (ep = dp, as torchtitan's default): every
mixture-of-experts experts module split by expert over the devices, tokens moved by
all-to-all (strategies.experts), every other layer as under DDP; refused for a model
with no experts module to split.
`"cp"` is context parallelism, cp x dp over the devices (planner.context_plan: every
sequence split over a cp group, attention's K/V gathered, each cp degree and weight mode
solved within memory, the fastest that fits); refused for a model with no attention.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from torch import nn

from planner import dp_shard
from planner.pipeline import block_recompute
from planner.block_cuts import why_no_blocks
from planner.choices import Choices, layer_choices
from planner.context_plan import context_parallel
from planner.ilp import solve
from planner.once import plan_once
from planner.plan import BaselinePredicted, Plan
from planner.plan3d import normalizes_over_batch, one_d_plan, plan_3d
from planner.price import step_overhead_s
from planner.problem import Solution
from planner.profiled import profiled_graph
from planner.search import CostCache, Shape, shapes
from planner.volume import communication_bytes
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Strategy
from strategies.experts import is_expert_parallel
from strategies.memory import split_name
from strategies.cluster import Cluster

Rule = Callable[[Layer, list[Strategy]], list[Strategy]]


def _ddp(layer: Layer, options: list[Strategy]) -> list[Strategy]:
    """DDP: each layer on its rank's rows where it applies, else whole on every rank (a
    layer of a shared parameter goes with its tie group: FIXED_TIES)."""
    dp = [s for s in options if s.name == "data_parallel"]
    return dp or [s for s in options if s.name == "replicate"]


def _tensor(layer: Layer, options: list[Strategy]) -> list[Strategy]:
    # Megatron's tensor parallelism splits weights along their features; an experts
    # module's split by expert is the "ep" kind's
    options = [s for s in options if not is_expert_parallel(split_name(s.name)[0])] or options
    split = [s for s in options if s.model_parallel]
    if split:
        return split
    # no weights to split: follow a feature split, or run whole; never split the batch
    # (FSDP runs each rank on its rows too)
    return [s for s in options
            if split_name(s.name)[0] not in ("data_parallel", "fsdp")] or options


def _fsdp(layer: Layer, options: list[Strategy]) -> list[Strategy]:
    """FSDP2 as torchtitan applies it: `fully_shard` on every module with weights, and the
    whole model on each rank's rows. FSDP shards weights, not work: a layer without
    weights runs on its rank's rows as under DDP (replicating it would run the whole batch
    on every rank and all-gather its activations)."""
    return [s for s in options if s.name == "fsdp"] or _ddp(layer, options)


def _ep(layer: Layer, options: list[Strategy]) -> list[Strategy]:
    """Expert parallelism as torchtitan runs it on a 1-D mesh: every experts module split
    over the data-parallel ranks (ep = dp), everything else as under DDP."""
    return [s for s in options if s.name == "expert_parallel"] or _ddp(layer, options)


# kind -> the rule that keeps a layer's strategies of that kind
BASELINES: dict[str, Rule | None] = {
    "ddp": _ddp,
    "tensor": _tensor,
    "fsdp": _fsdp,
    "pipeline": None,  # not a per-layer rule: mesh shapes of the 3-D search
    "fsdp_tp": None,  # likewise, with every shardable layer pinned to +fsdp
    "ep": _ep,
    "cp": None,  # its own mesh (dp, cp): planner.context_plan
}
# the kinds whose rules hold a shared parameter as DDP does (the rest of their layers fall
# back to _ddp): each tie group runs planner.ties.tied_strategy's one strategy
FIXED_TIES = ("ddp", "fsdp", "ep")
# the kinds that are one integer program over a 1-D mesh: cheap enough that optimize()
# prices each of them beside every plan it makes
ONE_D_KINDS = ("ddp", "tensor", "fsdp")
LABELS = {"ddp": "DDP (pure data parallel)", "tensor": "tensor parallel (Megatron-style)",
          "fsdp": "FSDP (sharded data parallel)", "pipeline": "pipeline",
          "fsdp_tp": "FSDP x TP (2-D, torchtitan's)", "ep": "expert parallel (ep = dp)",
          "cp": "context parallel"}


def available(kinds: Sequence[str] | None = None) -> list[str]:
    """The baseline kinds of `kinds` (default every kind): every kind is costed."""
    return list(kinds or BASELINES)


def _check(kind: str) -> Rule | None:
    """The rule of a known `kind` (None for the kinds the 3-D search makes)."""
    if kind not in BASELINES:
        raise ValueError(f"baseline: unknown kind {kind!r}; known: {', '.join(BASELINES)}")
    return BASELINES[kind]


def solve_baseline(graph: ModelGraph, cluster: Cluster, optimizer: str, kind: str,
                   time_limit_s: float = 60.0, cache: CostCache | None = None
                   ) -> tuple[Choices, Solution]:
    """The best plan of `kind` for a profiled graph (no memory limit: a baseline that does
    not fit says so in its predicted memory); `cache`: the planner.search.CostCache of
    these graph, cluster and optimizer, where the caller shares one."""
    rule = _check(kind)
    if rule is None:
        raise ValueError(f"baseline: {kind!r} is not a 1-D plan; use planner.baseline()")
    choices = layer_choices(graph, cluster, optimizer, None, keep=rule, cache=cache,
                            fixed_ties=kind in FIXED_TIES)
    return choices, solve(choices.problem, time_limit_s)


def summarize(choices: Choices, solution: Solution, cluster: Cluster,
              budget_bytes: float) -> BaselinePredicted:
    """A solved 1-D baseline as the plan beside it reports it: step time, communication
    (time and bytes sent per device) and memory per device, and whether that fits
    `budget_bytes`."""
    choice = solution.choice
    busy = sum(row.costs[c].compute_s + row.costs[c].update_s
               for row, c in zip(choices.layers, choice))
    memory = choices.problem.memory_of(choice)
    fixed = step_overhead_s(cluster)
    return BaselinePredicted(step_time_s=solution.objective_s + fixed,
                             communication_s=solution.objective_s - busy,
                             communication_bytes=communication_bytes(choices, choice),
                             memory_bytes=memory, fits=memory <= budget_bytes)


@plan_once
def baseline(model: nn.Module, devices, kind: str, example_inputs: Sequence | None = None,
             example_kwargs: dict | None = None, *, optimizer: str = "adam",
             leaf_modules=(), measure: bool | None = None, time_limit_s: float = 60.0,
             tracer: str = "auto", cp: int | None = None) -> Plan:
    """The `kind` baseline ("ddp", "tensor", "fsdp", "pipeline", "fsdp_tp", "ep" or "cp")
    for `model` on `devices`, as a Plan the executor runs like any other; `tracer` as
    optimize's; `cp`: the "cp" kind at that degree only (default: the best degree)."""
    started = time.perf_counter()
    _check(kind)  # an unknown kind stops here, before the model is traced
    if cp is not None and kind != "cp":
        raise ValueError(f"baseline: cp={cp} is a degree of the 'cp' kind, not of {kind!r}; "
                         f"pass kind='cp' or drop cp")
    if kind == "pipeline":
        return _pipeline(model, devices, example_inputs, example_kwargs, optimizer,
                         leaf_modules, measure, time_limit_s, started)
    graph, cluster = profiled_graph(model, devices, example_inputs, example_kwargs,
                                    leaf_modules, measure, tracer)
    if kind == "cp":
        return context_parallel(graph, cluster, optimizer, cluster.device.memory_bytes,
                                started, cp)
    if kind == "fsdp_tp":
        return fsdp_tp(graph, cluster, optimizer, cluster.device.memory_bytes, started,
                       time_limit_s=time_limit_s)
    choices, solution = solve_baseline(graph, cluster, optimizer, kind, time_limit_s)
    if kind == "ep" and not any(row.strategies[c].name == "expert_parallel"
                                for row, c in zip(choices.layers, solution.choice)):
        raise ValueError(
            f"baseline: 'ep' splits experts modules, and {type(model).__name__} on "
            f"{cluster.num_devices} devices has none that split (a mixture-of-experts "
            f"block whose experts count divides by the devices); use 'ddp'")
    budget = cluster.device.memory_bytes
    return one_d_plan(graph, cluster, optimizer, choices, solution, budget, None, None,
                      time.perf_counter() - started)


def _pipeline(model, devices, example_inputs, example_kwargs, optimizer, leaf_modules, measure,
              time_limit_s, started) -> Plan:
    """The best plan with pipeline stages and no tensor parallelism, within device memory
    (fitting a model is what pipelines are for)."""
    graph, cluster = profiled_graph(model, devices, example_inputs, example_kwargs,
                                    leaf_modules, measure)
    why = why_no_blocks(graph) if graph.tracer == "export" else ""
    if why:
        raise ValueError(f"baseline: 'pipeline' cuts a model torch.export traced only between "
                         f"its transformer blocks, and {why}")
    if graph.tied_groups() and graph.tracer != "export":  # export: why_no_blocks judges ties
        raise ValueError(f"baseline: 'pipeline' cannot cut {graph.model_name}: layers share "
                         f"a parameter (tied weights), which must stay in one stage")
    # a BatchNorm model gets one microbatch (planner.plan3d.plan_3d)
    most = 1 if any(normalizes_over_batch(layer) for layer in graph.layers) else None
    only = [s for s in shapes(cluster.num_devices, graph.batch_size, most)
            if s.pp > 1 and s.tp == 1]
    if not only:
        raise ValueError(f"baseline: 'pipeline' needs at least 2 devices, "
                         f"{cluster.describe()} has {cluster.num_devices}")
    return plan_3d(graph, cluster, optimizer, cluster.device.memory_bytes, started,
                   time_limit_s=time_limit_s, only=only)


def fsdp_tp_shapes(cluster: Cluster, batch: int, tp: int | None = None) -> list[Shape]:
    """The one-stage shapes of the "fsdp_tp" baseline: tp `tp` (default: every tp of two or
    more that divides a node) with a dp group of two or more on the rest of the devices."""
    per_node = cluster.devices_per_node
    tps = [tp] if tp is not None else [t for t in range(2, per_node + 1) if per_node % t == 0]
    return [s for s in shapes(cluster.num_devices, batch)
            if s.pp == 1 and s.tp in tps and s.dp >= 2]


def fsdp_tp(graph: ModelGraph, cluster: Cluster, optimizer: str, budget: float,
            started: float, *, tp: int | None = None, time_limit_s: float = 60.0) -> Plan:
    """The best FSDP x TP plan (module docstring) within `budget` bytes per device; `tp`
    fixes the tensor-parallel degree (torchtitan's: 8, one node). Raises PlanDoesNotFit
    with what the smallest shape needs when none fits."""
    only = fsdp_tp_shapes(cluster, graph.batch_size, tp)
    if not only:
        raise ValueError(f"baseline: 'fsdp_tp' needs a tp group of two or more inside a node "
                         f"and a dp group of two or more that splits the batch of "
                         f"{graph.batch_size}; {cluster.describe()} has none"
                         + (f" with tp {tp}" if tp else ""))
    if block_recompute.offered(graph):  # torchtitan checkpoints whole blocks
        only += [replace(s, recompute=True) for s in only]
    pin = {layer.name: dp_shard.SUFFIX for layer in graph.layers}
    return plan_3d(graph, cluster, optimizer, budget, started, time_limit_s=time_limit_s,
                   only=only, pin=pin)
