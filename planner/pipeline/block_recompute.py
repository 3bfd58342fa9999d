"""Whole-block activation checkpointing of a decoder's pipeline stages (torchtitan's
`activation_checkpoint.mode = "full"`): every transformer block runs under
torch.utils.checkpoint, keeping only the hidden state that enters it and running its
forward again in backward.

The 3-D search offers it as a shape attribute (planner.search.Shape.recompute) for a
torch.export graph cut at its blocks (planner.block_cuts), where executor.hf_stages wraps
each block the plan lists (Plan.recompute_blocks). `recompute_blocks` offers it per block
on the shape's stage problem: each layer of a block gets a recomputed variant of each of
its options (after the plain ones, named "<option>+recompute"; layout changes on edges as the
plain option's), and the stage solve
(planner.pipeline.stages, StageProblem.linked_units) picks per block whether its layers all run
their recomputed variants or none does. A recomputed variant costs:

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
from operator import attrgetter

import numpy as np

from planner.block_cuts import carries_weights, why_no_blocks
from planner.per_object import once_per_object
from planner.pipeline.stages import ARRAY_FIELDS, LayerOptions
from profiler.graph import ModelGraph
from strategies.layouts import Layout
from strategies.memory import recompute_s


def offered(graph: ModelGraph) -> bool:
    """Whether the executor can checkpoint `graph`'s blocks: a torch.export graph of a
    decoder cut at its blocks (executor.hf_stages builds its stages)."""
    return graph.tracer == "export" and bool(graph.blocks) and not why_no_blocks(graph)


SUFFIX = "+recompute"


def recompute_blocks(built, graph: ModelGraph, tp: int = 1, every: bool = False):
    """`built` (a planner.search.Built on `graph`) with a recomputed variant of every
    option of every layer inside a block (the module docstring), and its transient_bytes
    set to the largest block's activations for one microbatch. `tp`: the ranks a block's
    input is split over where its first layer takes it by tokens (a sequence-parallel
    norm, as torchtitan checkpoints a Shard(1) hidden state: Levers.sequence_parallel).
    `every`: the recomputed variants replace the plain options, so every block is
    recomputed whatever the solve picks (a job's "full" activation checkpointing, which
    recomputes blocks memory does not need it for)."""
    problem = built.problem
    blocks = set(graph.blocks)
    carried = carries_weights(graph)
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    layers = list(problem.layers)
    strategies, costs = list(built.strategies), list(built.costs)
    local, sharded = list(built.local_param_bytes), list(built.sharded)
    temps = list(built.temp_bytes)
    syncs, serials = list(built.sync_s), list(built.sync_serial_s)
    transient = 0.0
    members_of = problem.unit_layers()  # once: per unit, a scan of every layer took minutes
    # identical layers (a transformer's blocks) share their arrays (planner.search.build):
    # each distinct one is doubled once, not once per layer (a 405 B Llama: 1,260 layers),
    # and each distinct block (its layers' arrays and what it keeps) once, not once per
    # block: a layer of a block seen before only gets its own LayerOptions (its name and
    # unit), from DeepSeek-V3's 61 blocks of 120 layers on each of hundreds of shapes
    twice = once_per_object(_twice)
    variants = once_per_object(lambda costs, kept, *arrays, options, layer:
                               _recomputed_arrays(options, costs, kept, layer=layer))
    halves = once_per_object(_recomputed_half)  # shared like the arrays they halve
    block_of: dict[tuple, tuple] = {}
    layer_keys = _layer_keys(built)
    for u, name in enumerate(problem.units):
        if name not in blocks:
            continue
        members = [i for i in members_of[u] if i < len(graph.layers)]  # not the sink
        kept_bytes = _input_bytes(members, graph, built, carried, index)
        key = (kept_bytes, *(layer_keys[i] for i in members))
        made = block_of.get(key)
        if made is None:
            made = block_of[key] = _block(built, members, kept_bytes, tp, every, twice,
                                          variants, halves)
        largest, per_layer = made
        transient = max(transient, largest)
        for i, (fields, doubled) in zip(members, per_layer):
            options = problem.layers[i]
            layers[i] = LayerOptions(options.name, options.unit, *fields)
            if doubled is None:  # every: the recomputed variants alone
                continue
            strategies[i], costs[i], local[i], sharded_i, per_option = doubled
            if sharded:
                sharded[i] = sharded_i
            for figures, twofold in zip((temps, syncs, serials), per_option):
                if figures:
                    figures[i] = twofold
    doubled = ({i for i, l in enumerate(layers) if l.recomputed is not None} if not every
               else set())
    edges = _tiled_edges(problem.edges, doubled)
    return replace(built, problem=replace(problem, layers=tuple(layers), edges=edges),
                   strategies=tuple(strategies), costs=tuple(costs),
                   local_param_bytes=tuple(local), sharded=tuple(sharded),
                   temp_bytes=tuple(temps), sync_s=tuple(syncs),
                   sync_serial_s=tuple(serials), transient_bytes=transient)


_OPTION_FIELDS = attrgetter("strategies", *ARRAY_FIELDS)


def _layer_keys(built) -> list[tuple]:
    """Per layer (not the sink), what its recomputed options are made from, by identity
    (build shares each distinct layer's arrays and prices): two layers of one key get the
    same figures."""
    n = len(built.layers)
    none = (None,) * n
    return [(*map(id, _OPTION_FIELDS(o)), *map(id, rest)) for o, *rest in zip(
        built.problem.layers, built.strategies, built.costs, built.local_param_bytes,
        built.layers, built.sharded or none, built.temp_bytes or none, built.sync_s or none,
        built.sync_serial_s or none)]


def _block(built, members: list[int], kept_bytes: float, tp: int, every: bool, twice,
           variants, halves) -> tuple[float, list[tuple]]:
    """One block's recomputed figures (recompute_blocks): (its transient, the largest
    activations its layers keep for one microbatch; per member, the fields of its
    LayerOptions after its name and unit, and where its plain options stay (not `every`)
    its strategies, costs, local parameter bytes and sharding doubled, and its
    temporaries, syncs and serial syncs doubled). `twice`, `variants`, `halves`:
    recompute_blocks' memos, which keep alike layers of distinct blocks on one array."""
    problem = built.problem
    largest = sum(float(problem.layers[i].activation_bytes.max()) for i in members)
    out = []
    for j, i in enumerate(members):
        kept = (tuple(kept_per_option(built.strategies[i], kept_bytes, tp)) if j == 0
                else 0.0)
        options = problem.layers[i]
        # identical layers share their prices and their arrays (planner.search.build)
        arrays = variants(built.costs[i], kept, id(options.microbatch_s),
                          id(options.weight_bytes), options=options, layer=built.layers[i])
        if every:
            arrays = halves(arrays, len(options.strategies))
            out.append(((tuple(s + SUFFIX for s in options.strategies), *_fields(arrays)),
                        None))
            continue
        fields = (options.strategies + tuple(s + SUFFIX for s in options.strategies),
                  *_fields(arrays))
        doubled = (built.strategies[i] * 2, built.costs[i] * 2,
                   twice(built.local_param_bytes[i]),
                   built.sharded[i] * 2 if built.sharded else None,
                   tuple(twice(f[i]) if f else None
                         for f in (built.temp_bytes, built.sync_s, built.sync_serial_s)))
        out.append((fields, doubled))
    return largest, out


def _fields(arrays: dict) -> tuple:
    """`arrays` (_recomputed_arrays') in LayerOptions' order after its strategies."""
    return tuple(arrays[k] for k in ARRAY_FIELDS)


def _input_bytes(members: list[int], graph: ModelGraph, built, carried, index) -> float:
    """Bytes of what enters a block from outside it and carries weights' work (the hidden
    state): what a checkpointed block keeps. Which values those are is the graph's, made
    once per block and kept on the graph (the search asks on every shape)."""
    found = graph.__dict__.get("_block_inputs")
    if found is None:
        found = {}
        object.__setattr__(graph, "_block_inputs", found)
    key = tuple(members)
    entering = found.get(key)
    if entering is None:
        inside = {graph.layers[i].node for i in members}
        entering = found[key] = sorted({index[src] for i in members
                                        for src in graph.layers[i].inputs
                                        if src not in inside and src in carried})
    return float(sum(built.layers[j].output.nbytes for j in entering))


def _tiled_edges(edges, doubled: set[int]) -> tuple:
    """`edges` with each cost matrix tiled along the sides whose layer has its options
    doubled (the same layout change for a recomputed option as for its plain one); alike
    matrices tiled once."""
    tiled = once_per_object(lambda cost, a, b: np.tile(np.asarray(cost), (1 + a, 1 + b)))
    out = []
    for e in edges:
        a, b = e.src in doubled, e.dst in doubled
        out.append(type(e)(e.src, e.dst, tiled(e.cost_s, a, b)) if a or b else e)
    return tuple(out)


def kept_per_option(strategies, kept_bytes: float, tp: int) -> list[float]:
    """What a checkpointed block keeps of its input under each option of its first layer:
    1/tp where the option takes it by tokens (torchtitan's sequence-parallel norm, whose
    checkpoint holds a Shard(1) tensor), else whole."""
    return [kept_bytes / tp if getattr(s, "takes", None) == Layout.SEQUENCE else kept_bytes
            for s in strategies]


def _with_recomputed(options: LayerOptions, built, i: int, kept_bytes) -> LayerOptions:
    """Layer i's options, then each again recomputed: its forward once more per
    microbatch, and of its activations only `kept_bytes` (the block's input, charged to
    its first layer; one figure, or one per option)."""
    return _doubled(options, _recomputed_arrays(options, built.costs[i], kept_bytes,
                                                layer=built.layers[i]))


def _doubled(options: LayerOptions, arrays: dict) -> LayerOptions:
    """`options` with each strategy again, recomputed, and `arrays` for them all."""
    return replace(options, strategies=options.strategies + tuple(
        s + SUFFIX for s in options.strategies), **arrays)


def _recomputed_half(arrays: dict, n: int) -> dict:
    """Of `_doubled`'s arrays (n plain options, then n recomputed), the recomputed half."""
    return {k: None if v is None else v[n:] for k, v in arrays.items()}


def _recomputed_arrays(options: LayerOptions, costs, kept_bytes, *, layer) -> dict:
    """The arrays of _with_recomputed's options (`costs`: the layer's priced options)."""
    n = len(options.strategies)
    extra_s = np.array([recompute_s(layer, c.compute_s) for c in costs])
    return {
        "microbatch_s": np.concatenate([options.microbatch_s, options.microbatch_s + extra_s]),
        "step_s": _twice(options.step_s), "weight_bytes": _twice(options.weight_bytes),
        "activation_bytes": np.concatenate([options.activation_bytes, np.broadcast_to(
            np.asarray(kept_bytes, float), n)]),
        "recomputed": np.repeat([False, True], n), "temp_bytes": _twice(options.temp_bytes),
        "gathered_bytes": _twice(options.gathered_bytes)}


def _twice(per_option: np.ndarray | None) -> np.ndarray | None:
    """A per-option array for the options and their recomputed copies."""
    return None if per_option is None else np.concatenate([per_option, per_option])
