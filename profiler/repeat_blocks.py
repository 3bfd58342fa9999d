"""Trace a model of many alike blocks by tracing three of them and repeating the third.

torch.export of Llama 3 70 B takes ~20 s on this machine and of 405 B over a minute, almost
all of it spent tracing 80 or 126 copies of one block through the same ops. The blocks of a
transformers causal LM (`model.layers`, `transformer.h`) are alike: same classes, same
parameter shapes, same ops in the same order. So `trace_repeated` exports the model with
its block list cut to three (block 0, a block after a block, the last block before the
head), then writes the full graph by repeating the third block under the names the full
trace would give it:

- module paths and parameter names: `model.layers.2.mlp` -> `model.layers.k.mlp`;
- fx node names (a layer's `node`, its `inputs`, an op layer's name): torch.fx numbers each
  op name on its own counter (`add`, `add_1`, ...), so one block advances the counter of
  `add` by the number of `add` nodes in one block (its stride, counted between the first
  nodes of blocks 1 and 2 of the exported program); block k's `add_j` is block 2's
  `add_{j + (k-2) * stride}`, the head's names move by (blocks - 3) strides, and a name
  before block 1 (the embedding, the rotary tables, the mask, block 0) keeps its own;
- edges: a block reads the block before it (and whatever before block 1 every block
  reads), so renaming the inputs of block 2 by the same rule chains block k to block k-1.

FLOPs, shapes and strategies' facts are the traced block's. The result equals the graph
torch.export gives of the whole model (tests/test_repeat_blocks.py checks it, layer by
layer, against direct traces); where the blocks are not alike (per-layer config lists such
as sliding/full attention, blocks of different structure) or the cut model's blocks do not
repeat node for node, the whole model is traced as it is.
"""

from __future__ import annotations

import re
import warnings
from collections import Counter
from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn

from profiler.export_trace import export, export_trace, fingerprint_modules, graph_of_program
from profiler.blocks import decoder_blocks
from profiler.graph import Layer, ModelGraph, count_once

TRACED_BLOCKS = 3  # block 0, a middle block, the last one
_NUMBERED = re.compile(r"(.*)_(\d+)$")  # torch.fx's own split of a name and its counter


def trace_repeated(model: nn.Module, example_inputs: Sequence, example_kwargs: dict | None = None,
                   unit_types: tuple[type, ...] = ()) -> ModelGraph:
    """`profiler.export_trace.export_trace(model, ...)`, in the time of a three-block model
    when `model.config.num_hidden_layers` alike blocks sit in one ModuleList (see the module
    docstring); any other model is traced whole."""
    args, kwargs = tuple(example_inputs), dict(example_kwargs or {})
    found = block_list(model)
    if found is None or len(found[1]) <= TRACED_BLOCKS:
        return export_trace(model, args, kwargs, unit_types)
    path, blocks = found
    try:
        program, small = _trace_cut(model, path, args, kwargs, unit_types)
    except Exception as error:  # the cut model would not run: trace the model as it is
        return _whole(model, args, kwargs, unit_types, f"the 3-block model fails: {error}")
    names = _block_names(program.graph, path)
    if isinstance(names, str):
        return _whole(model, args, kwargs, unit_types, names)
    segment, stride = names
    graph = expand(small, segment, stride, path, len(blocks))
    layers = count_once(list(graph.layers), model)  # parameter sizes: the model's own
    cut_at, why = decoder_blocks(model)  # the whole model's blocks, not the 3 traced
    return replace(graph, layers=tuple(layers), fingerprint=fingerprint_modules(model),
                   blocks=cut_at, no_blocks_why=why)


def block_list(model: nn.Module) -> tuple[str, nn.ModuleList] | None:
    """(path, list) of the model's `config.num_hidden_layers` blocks where they are alike:
    one ModuleList of that length, every block of the same module classes and parameter
    shapes, and no per-layer list in the config that tells blocks apart."""
    config = getattr(model, "config", None)
    count = getattr(config, "num_hidden_layers", None)
    if not isinstance(count, int) or count <= 1:
        return None
    lists = [(p, m) for p, m in model.named_modules()
             if isinstance(m, nn.ModuleList) and len(m) == count]
    if len(lists) != 1:
        return None
    path, blocks = lists[0]
    first = _structure(blocks[0])
    if any(_structure(b) != first for b in blocks) or not _uniform(config, count):
        return None
    return path, blocks


def _structure(block: nn.Module) -> list:
    modules = [(n, type(m)) for n, m in block.named_modules()]
    tensors = [(n, tuple(t.shape), t.dtype, t.requires_grad)
               for n, t in [*block.named_parameters(), *block.named_buffers()]]
    return modules + tensors


def _uniform(config, count: int) -> bool:
    """No config entry is a per-layer list with differing values (Mistral's or Gemma's
    `layer_types`, a MoE's dense first layers given as a list)."""
    for value in vars(config).values():
        if isinstance(value, (list, tuple)) and len(value) == count and len(set(map(repr, value))) > 1:
            return False
    return True


def _trace_cut(model: nn.Module, path: str, args: tuple, kwargs: dict, unit_types):
    """(exported program, ModelGraph) of `model` with its block list cut to the first
    TRACED_BLOCKS blocks (and its config saying so), put back afterwards whatever happens."""
    parent_path, _, attr = path.rpartition(".")
    parent = model.get_submodule(parent_path)
    blocks, config = getattr(parent, attr), model.config
    count = config.num_hidden_layers
    setattr(parent, attr, nn.ModuleList(list(blocks)[:TRACED_BLOCKS]))
    config.num_hidden_layers = TRACED_BLOCKS
    try:
        program = export(model, args, kwargs)
        return program, graph_of_program(model, program, args, kwargs, unit_types)
    finally:
        setattr(parent, attr, blocks)
        config.num_hidden_layers = count


def _block_of(node: fx.Node, path: str) -> int | None:
    for module_path, _ in (node.meta.get("nn_module_stack") or {}).values():
        if module_path.startswith(path + "."):
            index = module_path[len(path) + 1:].split(".")[0]
            if index.isdigit():
                return int(index)
    return None


def _split(name: str) -> tuple[str, int]:
    match = _NUMBERED.match(name)
    return (match[1], int(match[2])) if match else (name, 0)


def shifted(name: str, times: int, stride: dict[str, int]) -> str:
    """`name` moved `times` blocks on: its counter advanced by its base's stride each."""
    base, number = _split(name)
    step = stride.get(base, 0) * times
    return f"{base}_{number + step}" if step else name


def _block_names(graph: fx.Graph, path: str) -> tuple[dict[str, int], dict[str, int]] | str:
    """({node name: segment}, {name base: nodes of that base per block}) of a 3-block
    program; segment 0: before block 1 (embedding, tables, block 0), 1: block 1, 2: block
    2, 3: the head. Or why the blocks do not repeat node for node."""
    nodes = list(graph.nodes)
    first = {}
    for position, node in enumerate(nodes):
        block = _block_of(node, path)
        if block is not None:
            first.setdefault(block, position)
    if sorted(first) != list(range(TRACED_BLOCKS)):
        return f"blocks met out of order {sorted(first)}"
    period = first[2] - first[1]
    one, two = nodes[first[1]:first[2]], nodes[first[2]:first[2] + period]
    stride = Counter(_split(n.name)[0] for n in one)
    if len(two) != period:
        return "the last block is shorter than the middle one"
    for a, b in zip(one, two):
        if (b.op, b.name) != (a.op, shifted(a.name, 1, stride)) or (
                a.op == "call_function" and a.target != b.target) or _block_of(a, path) == 2 \
                or _block_of(b, path) == 1:
            return f"block 2's node {b.name} does not repeat block 1's {a.name}"
    if any(_block_of(n, path) is not None for n in nodes[first[2] + period:]):
        return "the head calls into a block"
    segment = {}
    for position, node in enumerate(nodes):
        segment[node.name] = (0 if position < first[1] else 1 if position < first[2]
                              else 2 if position < first[2] + period else 3)
    return segment, dict(stride)


def expand(small: ModelGraph, segment: dict[str, int], stride: dict[str, int], path: str,
           blocks: int) -> ModelGraph:
    """The graph of the model with `blocks` blocks, from its 3-block graph `small`: layers
    up to block 1 as they are, block 2 repeated as blocks 2 .. blocks-1, the head moved by
    blocks - 3 (module docstring)."""
    def rename(name: str, times: int) -> str:
        return shifted(name, times, stride) if segment.get(name, 0) > 0 else name

    def moved(layer: Layer, times: int, index: int | None) -> Layer:
        node = rename(layer.node, times)
        if layer.name == layer.node:
            name = node
        else:
            name = _reindexed(layer.name, path, index)
        return replace(layer, name=name, node=node,
                       inputs=tuple(rename(n, times) for n in layer.inputs),
                       params=tuple(_reindexed(p, path, index) for p in layer.params))

    by_segment: dict[int, list[Layer]] = {0: [], 1: [], 2: [], 3: []}
    for layer in small.layers:
        by_segment[segment[layer.node]].append(layer)
    layers = by_segment[0] + by_segment[1]
    for k in range(2, blocks):
        layers += [moved(layer, k - 2, k) for layer in by_segment[2]]
    layers += [moved(layer, blocks - TRACED_BLOCKS, None) for layer in by_segment[3]]
    outputs = tuple(rename(n, blocks - TRACED_BLOCKS) for n in small.outputs)
    # each layer's innermost module (profiler.blocks: where a pipeline may cut), moved alike
    scopes = {}
    for layer in by_segment[0] + by_segment[1]:
        if layer.node in small.scopes:
            scopes[layer.node] = small.scopes[layer.node]
    for k in range(2, blocks):
        for layer in by_segment[2]:
            if layer.node in small.scopes:
                scopes[rename(layer.node, k - 2)] = _reindexed(small.scopes[layer.node], path, k)
    for layer in by_segment[3]:
        if layer.node in small.scopes:
            scopes[rename(layer.node, blocks - TRACED_BLOCKS)] = small.scopes[layer.node]
    return replace(small, layers=tuple(layers), outputs=outputs, scopes=scopes)


def _reindexed(name: str, path: str, index: int | None) -> str:
    """A module path or parameter name of block 2 as block `index`'s (others unchanged)."""
    prefix = f"{path}.{TRACED_BLOCKS - 1}"
    if index is None or not (name == prefix or name.startswith(prefix + ".")):
        return name
    return f"{path}.{index}{name[len(prefix):]}"


def _whole(model, args, kwargs, unit_types, why: str) -> ModelGraph:
    warnings.warn(f"hyplan: tracing all blocks of {type(model).__name__} ({why})", stacklevel=3)
    return export_trace(model, args, kwargs, unit_types)
