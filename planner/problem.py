"""The integer program's input and output as plain data, free of torch.

A `Problem` is a graph: each node (a layer) has options (strategies), each with a time and
a memory cost per device; each edge has a matrix of layout-change costs, one entry per pair
of producer and consumer options. The solver picks one option per node. Keeping this free
of torch lets the tests compare the solver with brute force on random instances.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field, replace

import numpy as np


@dataclass(frozen=True)
class Option:
    """One way to run a node: its strategy and what it costs on its own."""

    strategy: str
    time_s: float
    memory_bytes: float
    takes: str = ""  # the input layout it needs (informative for the solver)
    gives: str = ""  # the output layout it produces


@dataclass(frozen=True)
class Node:
    name: str
    options: tuple[Option, ...]


@dataclass(frozen=True)
class Edge:
    """Data flows from node `src` to node `dst`; `cost_s[i, j]` is the time to change
    layout when `src` runs option i and `dst` runs option j."""

    src: int
    dst: int
    cost_s: np.ndarray


@dataclass(frozen=True)
class Problem:
    """min Σ time(x) + Σ edge cost(x_src, x_dst)  s.t.  Σ memory(x) ≤ memory_budget_bytes."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()
    memory_budget_bytes: float | None = None
    # groups of nodes that must pick options of the same strategy name: layers sharing a
    # parameter (planner.ties)
    ties: tuple[tuple[int, ...], ...] = ()

    def cost_of(self, choice: tuple[int, ...] | list[int]) -> float:
        """The objective of a full assignment (used by explain() and brute force)."""
        total = sum(n.options[c].time_s for n, c in zip(self.nodes, choice))
        total += sum(float(e.cost_s[choice[e.src], choice[e.dst]]) for e in self.edges)
        return total

    def memory_of(self, choice: tuple[int, ...] | list[int]) -> float:
        return sum(n.options[c].memory_bytes for n, c in zip(self.nodes, choice))

    def times(self) -> Iterator[float]:
        """Every option's and edge's time: what planner.numerics.time_unit_s reads."""
        return itertools.chain((o.time_s for n in self.nodes for o in n.options),
                               (c for e in self.edges
                                for c in np.asarray(e.cost_s, float).ravel()))

    def in_units(self, unit_s: float) -> Problem:
        """The problem with every time in units of `unit_s` (the solver's units)."""
        if unit_s == 1.0:
            return self
        nodes = tuple(replace(n, options=tuple(replace(o, time_s=o.time_s / unit_s)
                                               for o in n.options)) for n in self.nodes)
        edges = tuple(replace(e, cost_s=np.asarray(e.cost_s, float) / unit_s)
                      for e in self.edges)
        return replace(self, nodes=nodes, edges=edges)


@dataclass(frozen=True)
class Solution:
    """The solver's answer with its certificate: status, objective and proven bound."""

    choice: tuple[int, ...]
    objective_s: float
    bound_s: float
    status: str  # "optimal" or "feasible" (time limit hit with an incumbent)
    seconds: float
    backend: str
    num_variables: int = 0
    num_constraints: int = 0
    stats: dict = field(default_factory=dict)


class Infeasible(ValueError):
    """No assignment satisfies the constraints; `family` names the constraint that fails."""

    def __init__(self, message: str, family: str):
        super().__init__(message)
        self.family = family
