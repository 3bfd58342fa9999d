"""Layers that share a parameter pick one strategy together (planner.ties): the solver
against a hand-solved instance and brute force over tie-respecting assignments."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from planner.ilp import solve
from planner.problem import Edge, Node, Option, Problem
from planner.ties import respects_ties

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
