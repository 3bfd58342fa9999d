"""A 1-D plan's problem: one group of all devices, the 3-D shape pp = 1, dp = 1, tp = N.

Its layers' options, prices and edges are the 3-D search's (planner.search.build with the
group's offers, planner.offers.OneGroup), its one stage is planner.ilp's problem
(planner.pipeline.stages.ilp_problem, one microbatch in flight) and a sink node takes the
model's outputs as the user gets them back: split by rows (each rank the rows it passed),
or whole where the rows do not split evenly over the devices (planner.handback).
`Choices` keeps what the problem's indices mean for the Plan, its reasons and baselines.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from planner.handback import output_layout
from planner.offers import OUTPUT, OneGroup
from planner.pipeline.stages import StageSolution, evaluate, ilp_problem
from planner.price import Price, tp_context
from planner.problem import Problem, Solution
from planner.search import Built, CostCache, Shape, build
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Cost, CostContext, Strategy
from strategies.cluster import Cluster

__all__ = ["OUTPUT", "Choices", "LayerChoices", "layer_choices"]


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
    built: Built  # the one-stage problem `problem` is read from (planner.reasons reads it)

    @property
    def shape(self) -> Shape:
        """The 3-D shape this problem is: one stage of one replica, tp over every device."""
        return Shape(1, 1, self.context.ranks, 1, "1F1B")

    def staged(self, solution: Solution) -> StageSolution:
        """`solution` as the one stage of `built` (what planner.plan3d.plan_of and
        planner.pipeline.stage_held.peak_bytes read), priced by the stage problem's own
        evaluate."""
        choice = tuple(solution.choice)
        return StageSolution((0,), choice, evaluate(self.built.problem, (0,), choice, 1, "1F1B"),
                             solution.status, solution.bound_s, solution.seconds,
                             solution.num_variables, solution.num_constraints,
                             settles=solution.status == "optimal")


def layer_choices(graph: ModelGraph, cluster: Cluster, optimizer: str,
                  memory_budget_bytes: float | None, only: set[str] | None = None,
                  pin: dict[str, str] | None = None, levers: bool = True,
                  keep=None, cache: CostCache | None = None, fixed_ties: bool = False,
                  group: OneGroup | None = None) -> Choices:
    """The 1-D problem within `memory_budget_bytes` per device. `only` keeps just the
    strategies named in it (and `replicate` where none of them applies): how baselines
    such as pure data parallelism are costed. `pin` maps layer names to the strategy they
    must use. `levers`: offer the memory levers of strategies.memory (fsdp, and
    "+recompute" variants) as well. `keep(layer, options)` returns the options a baseline
    allows for a layer (see planner.baseline); `fixed_ties`: each tie group runs the one
    strategy planner.ties.tied_strategy fixes, not the program's pick. `cache`: a
    planner.search.CostCache of these graph, cluster and optimizer, where the caller
    shares one. `group`: what the group offers, in place of the OneGroup these make (a
    context-parallel plan's, planner.context_plan)."""
    cache = cache or CostCache(graph, cluster, optimizer)
    devices, batch = cluster.num_devices, graph.batch_size
    group = group or OneGroup(levers, None if only is None else frozenset(only), keep,
                              fixed_ties)
    built = build(cache, 1, 1, devices, batch, pin=pin, group=group)
    nodes = len(built.problem.layers)
    problem = ilp_problem(built.problem, range(nodes), [1] * nodes, 1, memory_budget_bytes,
                          built.ties)
    handed = output_layout(batch, devices)  # rows, or whole where they do not split
    layouts = [[(s.takes.value, s.gives.value) for s in row] for row in built.strategies]
    layouts.append([(handed.value, "")])
    problem = replace(problem, nodes=tuple(
        replace(node, options=tuple(replace(o, takes=t, gives=g)
                                    for o, (t, g) in zip(node.options, pairs)))
        for node, pairs in zip(problem.nodes, layouts)))
    rows = tuple(LayerChoices(layer, strategies, costs, prices,
                              graph.carries_gradient(layer.node))
                 for layer, strategies, costs, prices in zip(
                     built.layers, built.strategies, built.costs, built.prices))
    ctx = tp_context(cache.rhythm(devices, batch), devices, batch, optimizer)
    return Choices(problem, rows, ctx, built)
