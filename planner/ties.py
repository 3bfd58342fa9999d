"""Tied nodes: layers that share a parameter choose one strategy together.

A tied embedding (GPT-2's `wte` and `lm_head`), or one layer's weights reused by every
block (ALBERT), is one parameter: it has one placement and its gradient is reduced once,
so every layer that reads it must run the same strategy. `Problem.ties` lists such groups
of nodes; they must pick options of the same strategy name.

Rather than add equality rows to the integer program (and teach each of its reductions
about them), a group is merged into one node before solving: an option per strategy name
every member offers, costing the members' times and memory summed; edges into and out of
the group are re-indexed onto it, and an edge inside the group folds into the merged
option's time. The merged problem is an ordinary Problem, so the solver, its reductions
and brute force apply unchanged, and `expand` maps its answer back to every member.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.problem import Edge, Node, Option, Problem
from strategies.memory import split_name

# What layers sharing a parameter may run: every reader holds it whole, and its gradient
# is a per-rank partial that one all-reduce sums (data parallel) or complete everywhere
# (replicate). A split or sharded placement would need every reader split alike.
# token_shard: a context-parallel plan's (strategies.context), each reader on its tokens,
# the shared weight replicated and its gradient summed over every rank (DDP)
TIED_STRATEGIES = ("data_parallel", "replicate", "token_shard")


def tied_allowed(options: list) -> list:
    """The options a reader of a shared parameter may take; which one the whole group runs
    is the 1-D program's choice (tie_groups) or fixed (tied_strategy)."""
    return [s for s in options if split_name(s.name)[0] in TIED_STRATEGIES]


def _no_common(layer_names) -> ValueError:
    """The error where readers of one parameter offer no strategy of TIED_STRATEGIES alike."""
    return ValueError(
        f"layers {', '.join(layer_names)} share a parameter and have no strategy in common "
        f"among {TIED_STRATEGIES} (pinned differently?); pin them alike or not at all")


def tied_strategy(offers, layer_names, ranks: int) -> str | None:
    """The one strategy every reader of a shared parameter runs where no program chooses it
    for the group (the 3-D search's stage problems, the DDP baseline): data parallel where
    every reader offers it, else replicated for all, so that a reader which never sees the
    batch (a weight read again transposed) keeps the whole group's gradient complete rather
    than half partial. `offers`: each reader's option names. None on one rank where they
    share neither: there the two are one placement (the whole weight, every row, nothing
    to sync) and each reader keeps its only option. ValueError elsewhere."""
    for name in TIED_STRATEGIES:
        if all(name in names for names in offers):
            return name
    if ranks == 1:
        return None
    raise _no_common(layer_names)


def tie_groups(groups, names: list[list[str]], layer_names: list[str], ranks: int
               ) -> tuple[tuple[int, ...], list[set[str]]]:
    """The tie groups `groups` (layer indices) as the integer program's ties, and for each
    the strategies of TIED_STRATEGIES all its layers offer (`names`: each layer's option
    names), where a 1-D plan's program picks one for the group; ValueError where there is
    none (pinned differently), save on one rank, where the group needs no tie
    (tied_strategy)."""
    ties, allowed = [], []
    for members in groups:
        common = set.intersection(*(set(names[i]) for i in members))
        kept = {n for n in common if split_name(n)[0] in TIED_STRATEGIES}
        if not kept and ranks == 1:
            continue
        if not kept:
            raise _no_common([layer_names[i] for i in members])
        ties.append(tuple(members))
        allowed.append(kept)
    return tuple(ties), allowed


def shared_names(nodes: list[Node]) -> list[str]:
    """The strategy names every node of a group offers, in the first node's order."""
    common = set.intersection(*({o.strategy for o in n.options} for n in nodes))
    return [o.strategy for o in nodes[0].options if o.strategy in common]


def _index(node: Node, strategy: str) -> int:
    found = [i for i, o in enumerate(node.options) if o.strategy == strategy]
    if len(found) != 1:
        raise ValueError(f"tied node {node.name!r} has {len(found)} options named "
                         f"{strategy!r}; a tied node needs each strategy name once")
    return found[0]


def merge_ties(problem: Problem) -> tuple[Problem, list]:
    """The problem with each tie group merged into one node, and `picks`: for merged node
    `new` and its option `k`, picks[new][k] lists the (original node, original option)
    pairs that option stands for."""
    group_of: dict[int, int] = {}
    for g, members in enumerate(problem.ties):
        for n in members:
            if n in group_of:
                raise ValueError(f"node {n} is in two tie groups; join them into one")
            group_of[n] = g
    new_index: dict[int, int] = {}
    picks: list[list[list[tuple[int, int]]]] = []  # new node -> option -> [(node, option)]
    nodes: list[Node] = []
    for n, node in enumerate(problem.nodes):
        g = group_of.get(n)
        if g is None:
            new_index[n] = len(nodes)
            nodes.append(node)
            picks.append([[(n, i)] for i in range(len(node.options))])
            continue
        members = problem.ties[g]
        if n != members[0]:
            new_index[n] = new_index[members[0]]
            continue
        group = [problem.nodes[m] for m in members]
        names = shared_names(group)
        if not names:
            raise ValueError(f"tied nodes {[x.name for x in group]} share no strategy")
        rows = [[(m, _index(problem.nodes[m], s)) for m in members] for s in names]
        options = tuple(Option(s, sum(problem.nodes[m].options[i].time_s for m, i in row),
                               sum(problem.nodes[m].options[i].memory_bytes for m, i in row),
                               group[0].options[row[0][1]].takes,
                               group[0].options[row[0][1]].gives)
                        for s, row in zip(names, rows))
        new_index[n] = len(nodes)
        nodes.append(Node(" + ".join(x.name for x in group), options))
        picks.append(rows)

    def local(new: int, original: int) -> list[int]:
        """For each option of new node `new`: the option index of original node `original`."""
        return [dict(row)[original] for row in picks[new]]

    edges: list[Edge] = []
    extra = [np.zeros(len(n.options)) for n in nodes]
    for e in problem.edges:
        a, b = new_index[e.src], new_index[e.dst]
        rows, cols = local(a, e.src), local(b, e.dst)
        cost = np.asarray(e.cost_s, float)[np.ix_(rows, cols)]
        if a == b:  # inside one tie group: both ends pick the same name
            extra[a] += np.diag(cost)
        else:
            edges.append(Edge(a, b, cost))
    nodes = [replace(node, options=tuple(replace(o, time_s=o.time_s + float(x))
                                         for o, x in zip(node.options, add)))
             if add.any() else node for node, add in zip(nodes, extra)]
    merged = Problem(tuple(nodes), tuple(edges), problem.memory_budget_bytes)
    return merged, picks


def expand(choice: tuple[int, ...], picks, num_nodes: int) -> tuple[int, ...]:
    """The merged problem's choice as one option index per original node."""
    out = [0] * num_nodes
    for new, k in enumerate(choice):
        for node, option in picks[new][k]:
            out[node] = option
    return tuple(out)


def respects_ties(problem: Problem, choice) -> bool:
    """Every tie group picked one strategy name (what brute force must check)."""
    return all(len({problem.nodes[n].options[choice[n]].strategy for n in group}) == 1
               for group in problem.ties)
