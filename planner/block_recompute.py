"""Whole-block activation checkpointing of a decoder's pipeline stages (torchtitan's
`activation_checkpoint.mode = "full"`): every transformer block runs under
torch.utils.checkpoint, keeping only the hidden state that enters it and running its
forward again in backward.

The 3-D search offers it as a shape attribute (planner.search.Shape.recompute) for a
torch.export graph cut at its blocks (planner.block_cuts), where executor.hf_stages wraps
each block it keeps. `recompute_blocks` prices it on the shape's stage problem:

- activations: each layer inside a block keeps nothing, except that the block keeps its
  input (the hidden state entering it, made outside the block and carrying weights'
  work), once per microbatch in flight; the units around the blocks (embeddings, head)
  keep theirs as before;
- time: each layer inside a block runs its forward once more per microbatch
  (strategies.memory.recompute_s, the rule the 1-D recompute lever uses);
- the transient: while one block runs backward its activations for one microbatch live
  again; `transient_bytes`, the largest block's, is held once on a rank, on top of what
  the stage problem counts (the search takes it off the budget of every rank, the plan adds
  it to the memory of the ranks that hold a block).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from planner.block_cuts import carries_weights, why_no_blocks
from profiler.graph import ModelGraph
from strategies.memory import recompute_s


def offered(graph: ModelGraph) -> bool:
    """Whether the executor can checkpoint `graph`'s blocks: a torch.export graph of a
    decoder cut at its blocks (executor.hf_stages builds its stages)."""
    return graph.tracer == "export" and bool(graph.blocks) and not why_no_blocks(graph)


def recompute_blocks(built, graph: ModelGraph):
    """`built` (a planner.search.Built on `graph`) with every block checkpointed, and its
    transient_bytes set to the largest block's activations for one microbatch."""
    problem = built.problem
    blocks = set(graph.blocks)
    carried = carries_weights(graph)
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    layers = list(problem.layers)
    transient = 0.0
    members_of = problem.unit_layers()  # once: per unit, a scan of every layer took minutes
    for u, name in enumerate(problem.units):
        if name not in blocks:
            continue
        members = [i for i in members_of[u] if i < len(graph.layers)]  # not the sink
        inside = {graph.layers[i].node for i in members}
        entering = {src for i in members for src in graph.layers[i].inputs
                    if src not in inside and src in carried}
        kept_bytes = float(sum(built.layers[index[src]].output.nbytes for src in entering))
        transient = max(transient, sum(float(problem.layers[i].activation_bytes.max())
                                       for i in members))
        for j, i in enumerate(members):
            options = problem.layers[i]
            extra_s = np.array([recompute_s(built.layers[i], c.compute_s)
                                for c in built.costs[i]])
            # the block's input is kept once: charged to its first layer
            kept = np.full(len(options.strategies), kept_bytes if j == 0 else 0.0)
            layers[i] = replace(options, microbatch_s=options.microbatch_s + extra_s,
                                activation_bytes=kept)
    return replace(built, problem=replace(problem, layers=tuple(layers)),
                   transient_bytes=transient)
