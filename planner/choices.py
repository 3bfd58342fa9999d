"""Turn a profiled graph and a cluster into the integer program's Problem.

Each layer becomes a node whose options are its candidate strategies with their costs; each
data edge becomes an edge whose matrix prices the layout change between the producer's and
the consumer's options; a sink node takes the model's outputs as the user gets them back:
split by rows (each rank the rows it passed), or whole where the rows do not split evenly
over the devices (planner.handback).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from planner.handback import output_layout
from planner.problem import Edge, Node, Option, Problem
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Cost, CostContext, Strategy, candidates
from strategies.cluster import Cluster
from strategies.edges import edge_matrix
from strategies.layouts import Layout
from strategies.memory import pinned_recompute, split_name, with_memory_levers

OUTPUT = "(output)"


@dataclass(frozen=True)
class LayerChoices:
    """A layer with its candidate strategies and their costs, index-aligned."""

    layer: Layer
    strategies: tuple[Strategy, ...]
    costs: tuple[Cost, ...]
    carries_gradient: bool = True  # ModelGraph.carries_gradient: its edges have a backward


@dataclass(frozen=True)
class Choices:
    """Everything the solver and explain() need: the problem and what its indices mean."""

    problem: Problem
    layers: tuple[LayerChoices, ...]  # node i of the problem is layers[i]; the sink is last
    context: CostContext


# a layout change the module executor cannot make: an infinite cost, which the solver
# turns into a bound on its edge variable (planner.ilp: a finite penalty would set the
# solver's time unit and drown microsecond costs in its tolerances)
UNREALIZABLE_S = float("inf")


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
    # never feature-split: the model's own code may view or permute a tensor by its
    # global sizes (a head count, a channels-last permute), which a split breaks silently
    options = [s for s in options if s.name != "feature_parallel"] or options
    if not any(s.name == "data_parallel" for s in options):
        return options  # it does not see the batch: whole it is
    return [s for s in options if s.name != "replicate"]


def unrealizable(producer: LayerChoices, consumer: LayerChoices, takes: list[Layout]):
    """Penalty matrix: a layout change into an op outside a module cannot be made by the
    module executor (modules change layouts in their hooks), unless it comes from a module."""
    out = np.zeros((len(producer.strategies), len(takes)))
    if consumer.layer.op == "call_module" or producer.layer.op == "call_module":
        return out
    for i, s in enumerate(producer.strategies):
        for j, t in enumerate(takes):
            ok = s.gives == t or (t == Layout.REPLICATE_PARTIAL_GRAD and s.gives == Layout.REPLICATE)
            out[i, j] = 0.0 if ok else UNREALIZABLE_S
    return out


def batch_free_takes(producer: Layer, takes: Layout, batch: int) -> Layout:
    """A tensor without the batch in dim 0 (a positional embedding, a mask) that meets a
    layer split by rows is broadcast to every rank's rows, not split: it stays whole, and
    its gradient, summed over each rank's rows, is all-reduced (as REPLICATE_PARTIAL_GRAD)."""
    shape = producer.output.shape
    if takes == Layout.BATCH and (not shape or shape[0] != batch):
        return Layout.REPLICATE_PARTIAL_GRAD
    return takes


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
    ctx = CostContext(cluster=cluster, ranks=cluster.num_devices, batch=graph.batch_size,
                      optimizer=optimizer)
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
            options = [s for s in options if split_name(s.name)[0] in TIED_STRATEGIES]
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
        rows.append(LayerChoices(layer, tuple(options), tuple(s.cost(layer, ctx) for s in options),
                                 graph.carries_gradient(layer.node)))

    if pin:
        raise ValueError(f"pin: no layer named {sorted(pin)}; layers: "
                         f"{[r.layer.name for r in rows if not r.layer.is_input]}")
    ties = tied(graph, rows, index)
    nodes = [Node(r.layer.name, tuple(
        Option(s.name, c.time_s, c.memory_bytes, s.takes.value, s.gives.value)
        for s, c in zip(r.strategies, r.costs))) for r in rows]
    handed = output_layout(graph.batch_size, ctx.ranks)  # rows, or whole where they do not split
    nodes.append(Node(OUTPUT, (Option("output", 0.0, 0.0, handed.value, ""),)))

    link = cluster.link(ctx.ranks)
    overhead = cluster.dtensor_reshard_overhead_s if ctx.ranks > 1 else 0.0
    edges = []
    for dst, row in enumerate(rows):
        own_style = [s.model_parallel for s in row.strategies]
        for name in row.layer.inputs:
            src = index[name]
            producer = rows[src]
            if graph.tracer == "export":
                edges.append(Edge(src, dst, module_edge(producer, row, ctx, link, overhead)))
                continue
            takes = [batch_free_takes(producer.layer, s.takes, graph.batch_size)
                     for s in row.strategies]
            matrix = edge_matrix([s.gives for s in producer.strategies], takes,
                                 producer.layer.output.nbytes, ctx.ranks, link,
                                 backward=producer.carries_gradient,
                                 reshard_overhead_s=overhead, own_style=own_style)
            edges.append(Edge(src, dst, matrix))
    sink = len(rows)
    for name in graph.outputs:
        src = index[name]
        producer = rows[src]
        matrix = edge_matrix([s.gives for s in producer.strategies], [handed],
                             producer.layer.output.nbytes, ctx.ranks, link,
                             backward=producer.carries_gradient, reshard_overhead_s=overhead)
        edges.append(Edge(src, sink, matrix))
    problem = Problem(tuple(nodes), tuple(edges), memory_budget_bytes, ties)
    return Choices(problem, tuple(rows), ctx)


def module_edge(producer: LayerChoices, consumer: LayerChoices, ctx: CostContext, link,
                overhead_s: float) -> np.ndarray:
    """The edge matrix between two layers of a torch.export graph whose `ctx.batch` rows
    are held by `ctx.ranks` ranks (all devices in a 1-D plan, a tp group in a 3-D one):
    the module executor changes layouts only at modules (executor.modules), so a module's
    output goes through the rows the model's code holds, and a layout change into an op
    outside modules is unrealizable."""
    takes = [batch_free_takes(producer.layer, s.takes, ctx.batch) for s in consumer.strategies]
    own_style = [s.model_parallel for s in consumer.strategies]
    if producer.layer.op == "call_module" and rows_visible(producer.layer.output.shape, ctx.batch):
        return _through_rows(producer, consumer, takes, ctx, link, overhead_s, own_style)
    matrix = edge_matrix([s.gives for s in producer.strategies], takes,
                         producer.layer.output.nbytes, ctx.ranks, link,
                         backward=producer.carries_gradient, reshard_overhead_s=overhead_s,
                         own_style=own_style)
    if ctx.ranks > 1:  # one device: one layout
        matrix = matrix + unrealizable(producer, consumer, takes)
    return matrix


def rows_visible(shape, batch: int) -> bool:
    """A module's output the model's own code sees split by rows (torch.export graphs,
    executor.modules): it has the batch in dim 0."""
    return bool(shape) and shape[0] == batch


def _through_rows(producer: LayerChoices, consumer: LayerChoices, takes: list[Layout],
                  ctx: CostContext, link, overhead: float, own_style: list[bool]):
    """The edge out of a module of a torch.export graph: its output is handed on split by
    rows (rows_visible) and each reader changes it to what it takes from there; an op
    outside modules cannot change it, so it takes the rows or nothing."""
    nbytes = producer.layer.output.nbytes
    held = output_layout(ctx.batch, ctx.ranks)  # rows, or whole where they do not split
    backward = producer.carries_gradient
    out = edge_matrix([s.gives for s in producer.strategies], [held], nbytes,
                      ctx.ranks, link, backward=backward, reshard_overhead_s=overhead)
    into = edge_matrix([held], takes, nbytes, ctx.ranks, link, backward=backward,
                       reshard_overhead_s=overhead, own_style=own_style)
    if consumer.layer.op != "call_module" and ctx.ranks > 1:
        into = np.where(np.array([[t == held for t in takes]]), into, UNREALIZABLE_S)
    return out + into


# What layers sharing a parameter may run: every reader holds it whole, and its gradient
# is a per-rank partial that one all-reduce sums (data parallel) or complete everywhere
# (replicate). A split or sharded placement would need every reader split alike.
TIED_STRATEGIES = ("data_parallel", "replicate")


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
                                   tuple(row.costs[k] for k in keep), row.carries_gradient)
        ties.append(tuple(members))
    return tuple(ties)
