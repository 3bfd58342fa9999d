"""Turn a profiled graph and a cluster into the integer program's Problem.

Each layer becomes a node whose options are its candidate strategies with their costs; each
data edge becomes an edge whose matrix prices the layout change between the producer's and
the consumer's options; a sink node takes the model's outputs as the user gets them back:
split by rows (each rank the rows it passed), or whole where the rows do not split evenly
over the devices (planner.handback).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.handback import output_layout
from planner.price import (
    Price, edge_cost, edge_kind, in_rhythm, output_kind, price, tp_context,
)
from planner.problem import Edge, Node, Option, Problem
from planner.ties import TIED_STRATEGIES, tied_allowed
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Cost, CostContext, Strategy, candidates
from strategies.cluster import Cluster
from strategies.layouts import Layout
from strategies.memory import pinned_recompute, split_name, with_memory_levers

OUTPUT = "(output)"


@dataclass(frozen=True)
class LayerChoices:
    """A layer with its candidate strategies and their costs, index-aligned."""

    layer: Layer
    strategies: tuple[Strategy, ...]
    costs: tuple[Cost, ...]
    prices: tuple[Price, ...]  # planner.price: what the solver reads
    carries_gradient: bool = True  # ModelGraph.carries_gradient: its edges have a backward


@dataclass(frozen=True)
class Choices:
    """Everything the solver and explain() need: the problem and what its indices mean."""

    problem: Problem
    layers: tuple[LayerChoices, ...]  # node i of the problem is layers[i]; the sink is last
    context: CostContext


def module_executor_options(layer: Layer, options: list[Strategy]) -> list[Strategy]:
    """For a graph from torch.export the executor runs the module's own forward, so the ops
    outside unit modules run on whatever each rank holds: the inputs come split by rows,
    and such an op is row-split wherever it can be; whole only when it does not see the
    batch at all (a constant such as a position table)."""
    # the model's own code holds module outputs split by rows: no token split survives it
    options = [s for s in options if Layout.SEQUENCE not in (s.takes, s.gives)]
    if layer.is_input:
        return [s for s in options if s.name == "data_parallel"] or options
    if layer.op == "call_module":
        return options
    # feature-split only element-wise ops between modules (Llama's act(gate) * up, on the
    # local shards of its colwise Linears as torchtitan runs it): the model's own code may
    # view or permute any other tensor by its global sizes (a head count, a channels-last
    # permute), which a split breaks silently
    options = [s for s in options if s.name != "feature_parallel" or (
        layer.attrs.get("between_modules") and layer.kind != "flatten")] or options
    if not any(s.name == "data_parallel" for s in options):
        return options  # it does not see the batch: whole it is
    # rows split: a feature split would show the model's code whole rows
    return [s for s in options if s.name not in ("replicate", "feature_parallel")]


def layer_choices(graph: ModelGraph, cluster: Cluster, optimizer: str,
                  memory_budget_bytes: float | None, only: set[str] | None = None,
                  pin: dict[str, str] | None = None, levers: bool = True,
                  keep=None) -> Choices:
    """Build the Problem. `only` keeps just the strategies named in it (and `replicate`
    where none of them applies): how baselines such as pure data parallelism are costed.
    `pin` maps layer names to the strategy they must use. `levers`: offer the memory
    levers of strategies.memory (fsdp, and "+recompute" variants) as well. `keep(layer,
    options)` returns the options a baseline allows for a layer (see planner.baseline)."""
    pin = dict(pin or {})
    # one group of all devices: the 3-D shape pp = 1, dp = 1, tp = N (planner.price)
    devices = cluster.num_devices
    ctx = tp_context(in_rhythm(cluster, graph, devices, graph.batch_size, optimizer), devices,
                     graph.batch_size, optimizer)
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    sharing = {node for group in graph.tied_groups() for node in group}
    rows: list[LayerChoices] = []
    for layer in graph.layers:
        options = candidates(layer, ctx)
        if levers:
            options = with_memory_levers(layer, options, ctx)
        if graph.tracer == "export":  # first: no baseline's rule may undo what it keeps
            options = module_executor_options(layer, options)
        if layer.node in sharing:
            # a shared parameter is held whole in every plan kind: a baseline's rule (all
            # split, all sharded) does not apply to the layers that read it
            options = tied_allowed(options)
        elif only is not None:
            kept = [s for s in options if s.name in only]
            options = kept or [s for s in options if s.name == "replicate"]
        if keep is not None and layer.node not in sharing:
            options = keep(layer, options)
        if layer.name in pin:
            wanted = pin.pop(layer.name)
            kept = [s for s in options if s.name == wanted] or pinned_recompute(
                layer, options, wanted, ctx)
            if not kept:
                raise ValueError(f"pin: layer {layer.name!r} cannot use {wanted!r} on "
                                 f"{ctx.ranks} devices; it can use "
                                 f"{sorted({s.name for s in options})}")
            options = kept
        prices = [price(layer, s, ctx) for s in options]
        rows.append(LayerChoices(layer, tuple(options), tuple(p.cost for p in prices),
                                 tuple(prices), graph.carries_gradient(layer.node)))

    if pin:
        raise ValueError(f"pin: no layer named {sorted(pin)}; layers: "
                         f"{[r.layer.name for r in rows if not r.layer.is_input]}")
    ties = tied(graph, rows, index)
    nodes = [Node(r.layer.name, tuple(
        Option(s.name, p.time_s, p.memory_bytes, s.takes.value, s.gives.value)
        for s, p in zip(r.strategies, r.prices))) for r in rows]
    handed = output_layout(graph.batch_size, ctx.ranks)  # rows, or whole where they do not split
    nodes.append(Node(OUTPUT, (Option("output", 0.0, 0.0, handed.value, ""),)))

    edges = []
    for dst, row in enumerate(rows):
        for name in row.layer.inputs:
            src = index[name]
            kind = edge_kind(rows[src].layer, [s.gives for s in rows[src].strategies],
                             row.layer, row.strategies, graph.batch_size, ctx.ranks,
                             graph.tracer, rows[src].carries_gradient, graph.readers(name))
            edges.append(Edge(src, dst, edge_cost(kind, ctx.cluster)))
    sink = len(rows)
    for name in graph.outputs:
        src = index[name]
        kind = output_kind(rows[src].layer, [s.gives for s in rows[src].strategies],
                           graph.batch_size, ctx.ranks, rows[src].carries_gradient)
        edges.append(Edge(src, sink, edge_cost(kind, ctx.cluster)))
    problem = Problem(tuple(nodes), tuple(edges), memory_budget_bytes, ties)
    return Choices(problem, tuple(rows), ctx)


def tied(graph: ModelGraph, rows: list[LayerChoices], index: dict[str, int]):
    """The problem's tie groups (planner.ties), restricting each group's layers in `rows`
    to the strategies of TIED_STRATEGIES that all of them offer."""
    ties = []
    for group in graph.tied_groups():
        members = [index[node] for node in group]
        names = [{s.name for s in rows[i].strategies} for i in members]
        common = set.intersection(*names)
        allowed = {n for n in common if split_name(n)[0] in TIED_STRATEGIES}
        if not allowed:
            layers = ", ".join(rows[i].layer.name for i in members)
            raise ValueError(
                f"layers {layers} share a parameter and have no strategy in common among "
                f"{TIED_STRATEGIES} (pinned differently?); pin them alike or not at all")
        for i in members:
            row = rows[i]
            keep = [k for k, s in enumerate(row.strategies) if s.name in allowed]
            rows[i] = LayerChoices(row.layer, tuple(row.strategies[k] for k in keep),
                                   tuple(row.costs[k] for k in keep),
                                   tuple(row.prices[k] for k in keep), row.carries_gradient)
        ties.append(tuple(members))
    return tuple(ties)
