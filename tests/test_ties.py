"""Layers that share a parameter pick one strategy together (planner.ties): the solver
against a hand-solved instance and brute force over tie-respecting assignments, and one
strategy per tie group in every plan kind (the 1-D program, the 3-D search, DDP)."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

import planner
from models import TiedTransposed
from planner.ilp import solve
from planner.problem import Edge, Node, Option, Problem
from planner.profiled import profiled_graph
from planner.search import CostCache, build
from planner.ties import respects_ties, tied_strategy
from zoo import ZOO

GB = 1e9


def brute_force_tied(problem: Problem) -> float:
    best = math.inf
    for choice in itertools.product(*(range(len(n.options)) for n in problem.nodes)):
        if not respects_ties(problem, choice):
            continue
        if (problem.memory_budget_bytes is not None
                and problem.memory_of(choice) > problem.memory_budget_bytes):
            continue
        best = min(best, problem.cost_of(choice))
    return best


def test_tied_embedding_and_head_pick_one_strategy():
    # embedding -> block -> head, embedding and head tied. Alone, the embedding prefers
    # "dp" (1 vs 3) and the head "rep" (1 vs 3): the untied optimum mixes them (2 + 1 = 3).
    # Tied, both "dp" costs 1 + 3 and both "rep" 3 + 1: 4 + the block's 1 either way;
    # the switches on the edges break the tie: the block is "dp", so "dp" saves 2 x 0.5.
    opts = lambda dp, rep: (Option("dp", dp, 1 * GB), Option("rep", rep, 1 * GB))
    nodes = (Node("embed", opts(1.0, 3.0)), Node("block", (Option("dp", 1.0, GB),)),
             Node("head", opts(3.0, 1.0)))
    switch_in = np.array([[0.0], [0.5]])  # embed -> block
    switch_out = np.array([[0.0, 0.5]])  # block -> head
    untied = Problem(nodes, (Edge(0, 1, switch_in), Edge(1, 2, switch_out)))
    assert solve(untied).choice == (0, 0, 1)
    tied = Problem(nodes, untied.edges, None, ((0, 2),))
    solution = solve(tied)
    assert solution.choice == (0, 0, 0)
    assert solution.objective_s == pytest.approx(5.0)
    assert solution.status == "optimal"


def _random_tied(rng: np.random.Generator) -> Problem:
    n = int(rng.integers(3, 7))
    names = ["dp", "rep", "col", "row"]
    nodes = []
    for i in range(n):
        k = int(rng.integers(1, 5))
        picked = sorted(rng.choice(len(names), size=k, replace=False))
        nodes.append(Node(f"n{i}", tuple(
            Option(names[j], float(10 ** rng.uniform(-6, 0)), float(rng.uniform(1, 10) * GB))
            for j in picked)))
    # a tie group of nodes that share at least one name (and so can agree)
    group = [0, n - 1] + ([n // 2] if n > 4 else [])
    common = set.intersection(*({o.strategy for o in nodes[g].options} for g in group))
    if not common:
        for g in group:
            nodes[g] = Node(nodes[g].name, nodes[g].options + (Option("dp", 1.0, GB),)) \
                if "dp" not in {o.strategy for o in nodes[g].options} else nodes[g]
    pairs = [(i, i + 1) for i in range(n - 1)] + [(0, n - 1)]
    edges = []
    for u, v in pairs:
        cost = 10 ** rng.uniform(-6, 0, size=(len(nodes[u].options), len(nodes[v].options)))
        cost[rng.random(cost.shape) < 0.3] = 0.0
        edges.append(Edge(u, v, cost))
    largest = sum(max(o.memory_bytes for o in x.options) for x in nodes)
    smallest = sum(min(o.memory_bytes for o in x.options) for x in nodes)
    budget = None if rng.random() < 0.5 else float(rng.uniform(smallest, largest) + GB)
    return Problem(tuple(nodes), tuple(edges), budget, (tuple(sorted(set(group))),))


@pytest.mark.parametrize("seed", range(25))
def test_tied_solver_equals_brute_force(seed):
    problem = _random_tied(np.random.default_rng(seed))
    expected = brute_force_tied(problem)
    if math.isinf(expected):
        return  # nothing tie-respecting fits: the solver's memory error is tested elsewhere
    solution = solve(problem)
    assert respects_ties(problem, solution.choice)
    assert solution.objective_s == pytest.approx(expected, rel=1e-6, abs=1e-9)
    assert solution.status == "optimal"


def test_a_fixed_tie_group_is_data_parallel_where_all_offer_it_else_replicated():
    both, whole = ("data_parallel", "replicate"), ("replicate",)
    assert tied_strategy([both, both], ["embed", "head"], 2) == "data_parallel"
    assert tied_strategy([both, whole], ["embed", "t"], 2) == "replicate"
    # one rank: data parallel and replicated are one placement, each keeps its own
    assert tied_strategy([("data_parallel",), whole], ["embed", "t"], 1) is None
    with pytest.raises(ValueError, match="embed, t share a parameter"):
        tied_strategy([("data_parallel",), ("column_parallel",)], ["embed", "t"], 2)


def _tied_transposed():
    torch.manual_seed(0)
    return TiedTransposed, (torch.randint(0, 16, (4, 3)),), None


def _gpt2():
    inputs, kwargs = ZOO["gpt2"].example()
    return ZOO["gpt2"].make, inputs, kwargs


def _tie_strategies(plan, graph) -> list[set[str]]:
    """Per tie group of `graph`, the strategies `plan` gives its members."""
    by_node = {layer.node: layer.strategy for layer in plan.layers}
    return [{by_node[node] for node in group} for group in graph.tied_groups()]


# TiedTransposed's second reader never sees the batch: the group is replicated whole;
# GPT-2's embedding and head both see it: data parallel, where rows split over the group
@pytest.mark.parametrize("model,tracer_3d", [(_tied_transposed, "fx"), (_gpt2, "export")])
def test_each_tie_group_runs_one_strategy_in_1d_3d_and_ddp(model, tracer_3d):
    make, inputs, kwargs = model()
    made = make()  # one instance: each tracer's trace made once (planner.profiled)
    graphs = {tracer: profiled_graph(made, "2xcpu", inputs, kwargs, (), False, tracer)[0]
              for tracer in {"export", tracer_3d}}
    assert all(graph.tied_groups() for graph in graphs.values())
    args = {"example_inputs": inputs, "example_kwargs": kwargs, "measure": False}
    plans = {"1d": planner.optimize(made, "2xcpu", tracer="export", mesh="1d", **args),
             "ddp": planner.baseline(made, "2xcpu", "ddp", tracer="export", **args),
             # torch.export's 3-D search cuts between repeated blocks, which TiedTransposed
             # has none of: fx traces it to the same layers
             "3d": planner.optimize(made, "2xcpu", tracer=tracer_3d, mesh="3d", **args)}
    ties = {kind: _tie_strategies(plan, graphs[tracer_3d if kind == "3d" else "export"])
            for kind, plan in plans.items()}
    assert all(len(names) == 1 for groups in ties.values() for names in groups), ties
    expected = "replicate" if make is TiedTransposed else "data_parallel"
    assert ties["ddp"] == [{expected}]


@pytest.mark.parametrize("model", [_tied_transposed, _gpt2])
def test_every_3d_shape_offers_a_tie_group_one_strategy(model):
    """The 3-D search's stage problems have no tie rows: each shape offers a tie group's
    members the one strategy planner.ties.tied_strategy fixes for the group (on one rank,
    each member its only option)."""
    make, inputs, kwargs = model()
    graph, cluster = profiled_graph(make(), "2xcpu", inputs, kwargs, (), False, "export")
    cache = CostCache(graph, cluster, "adam")
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    for dp, tp, rows in [(2, 1, 2), (1, 2, 4), (1, 2, 2), (1, 2, 1)]:
        offered = build(cache, 1, dp, tp, rows).problem.layers
        for group in graph.tied_groups():
            names = [offered[index[node]].strategies for node in group]
            assert all(len(n) == 1 for n in names), (dp, tp, rows, names)
            assert tp == 1 or len(set(names)) == 1, (dp, tp, rows, names)
