"""torch.compile priced: which element-wise and normalization work fuses, and what it moves.

Eager PyTorch runs every element-wise op as its own kernel: each reads its inputs from
memory and writes its output back, and its backward does the same again. On an H100
that is about half of a bf16 training step (benchmarks/results/gpu-h100.txt). Inductor
(torch.compile's code generator) fuses the ops between two matmuls into one kernel that
reads what enters the group once and writes what leaves it once; a normalization (a
reduction followed by point-wise math) fuses with its neighbours as a persistent
reduction; GEMMs and attention stay library kernels (cuBLAS, FlashAttention) that do
not fuse. Its backward is compiled the same way, recomputing cheap point-wise values
from the group's saved inputs instead of reading saved intermediates (the min-cut
partitioner of AOTAutograd, Ansel et al., "PyTorch 2", ASPLOS 2024, section 4).

`fused(graph)` is that rule over a profiled graph's layers:

- a *group* is a set of element-wise layers joined by edges that cross no GEMM or
  attention: a layer's level is the number of matmul / attention layers on the longest
  path to it, and an element-wise layer joins the element-wise layer it reads when both
  sit at the same level (so a residual add that waits for the MLP's down projection does
  not fuse with the add before the MLP, which the projection waits for);
- a group moves, forward, the tensors that enter it (read once) and the ones that leave
  it (written once) plus its weights; backward (where the eager backward moved anything)
  the gradients of what left, the saved inputs, and the gradients of its floating inputs
  that carry one; one kernel each way, and where the group has a weight (a norm's scale)
  a second backward kernel, a reduction over the rows, reading the leaving gradients and
  the saved inputs again (Inductor does not fuse reductions along different axes);
- an attention block's own glue (rotary embedding, the key/value repeat for grouped
  heads, transposes) becomes one kernel reading q, k, v and writing q and the repeated
  k, v, the same backward, where `fuse_attention_glue` asks; not by default, since
  torchtitan's Llama applies rotary embedding in complex arithmetic (`view_as_complex`,
  `freqs_cis`), for which Inductor generates no code and falls back to eager kernels
  ("Torchinductor does not support code generation for complex operators");
- nothing is priced above its eager figure: each count is the lesser of the two.

The fused traffic replaces each member's `traffic` attr, spread over the members by
their eager bytes (kernels too, so the launch floor stays the group's), which is all the
per-layer price (strategies.gpu_compute) reads.
"""

from __future__ import annotations

import math
from dataclasses import replace

from profiler.graph import Layer, ModelGraph
from strategies.gpu_compute import SDPA_KINDS, attention_dims, element_bytes, linear_dims

EAGER = "eager_traffic"  # the attr that keeps each layer's eager traffic beside the fused


def is_barrier(layer: Layer) -> bool:
    """A layer compile does not fuse: a GEMM, attention, an embedding gather, an input,
    or one no trace counted (its kernels unknown)."""
    return (layer.is_input or linear_dims(layer) is not None or layer.kind in SDPA_KINDS
            or layer.kind == "Embedding" or attention_dims(layer) is not None
            or "traffic" not in layer.attrs)


def groups(graph: ModelGraph) -> list[list[Layer]]:
    """The fusion groups of the graph's element-wise layers, in execution order."""
    level: dict[str, int] = {}
    parent: dict[str, str] = {}

    def root(node: str) -> str:
        while parent[node] != node:
            parent[node] = parent[parent[node]]
            node = parent[node]
        return node

    for layer in graph.layers:  # execution order: a layer's inputs come first
        level[layer.node] = max((level[i] + is_barrier(graph.layer(i)) for i in layer.inputs
                                 if i in level), default=0)
        if is_barrier(layer):
            continue
        parent[layer.node] = layer.node
        for i in layer.inputs:
            if i in parent and level[i] == level[layer.node]:
                parent[root(i)] = root(layer.node)
    found: dict[str, list[Layer]] = {}
    for layer in graph.layers:
        if layer.node in parent:
            found.setdefault(root(layer.node), []).append(layer)
    return list(found.values())


def _floating(layer: Layer) -> bool:
    return layer.output.dtype.startswith(("float", "bfloat"))


def _nbytes(layer: Layer, dtype: str) -> float:
    """A tensor's bytes under `dtype`: a floating activation at its element size."""
    if not _floating(layer):
        return float(layer.output.nbytes)
    return float(math.prod(layer.output.shape)) * element_bytes(dtype)


def group_traffic(graph: ModelGraph, members: list[Layer], dtype: str) -> tuple:
    """The traffic attr (profiler.traffic.Traffic.as_attr) of one fused group under
    `dtype`: what enters read once, what leaves written once, forward and backward."""
    inside = {m.node for m in members}
    entering = {i for m in members for i in m.inputs if i not in inside}
    leaving = [m for m in members
               if graph.readers(m.node) == 0 or m.node in graph.outputs
               or any(m.node in l.inputs for l in graph.layers if l.node not in inside)]
    batch = graph.batch_size
    ins = [graph.layer(n) for n in sorted(entering)]
    fr = sum(_nbytes(t, dtype) for t in ins + leaving if t.output.has_rows(batch))
    weights = sum(m.param_count for m in members) * element_bytes(dtype)
    ff = sum(_nbytes(t, dtype) for t in ins + leaving if not t.output.has_rows(batch)) + weights
    eager = [m.attrs["traffic"][dtype] for m in members]
    if not sum(e[5] for e in eager):  # nothing flowed back through them eagerly
        return (fr, ff, 0.0, 0.0, 1, 0)
    br = bf = 0.0
    for t in ins + leaving:
        if not _floating(t) or not graph.carries_gradient(t.node):
            continue
        # a leaving tensor's gradient is read; an entering one is read (saved) and its
        # gradient written; where the group has a weight (a norm's scale), its gradient is
        # a reduction over the rows, another kernel that reads both again
        moved = _nbytes(t, dtype) * ((1 if t in leaving else 2) + (1 if weights else 0))
        if t.output.has_rows(batch):
            br += moved
        else:
            bf += moved
    return (fr, ff, br, bf + weights, 1, 2 if weights else 1)


def attention_glue(layer: Layer, dtype: str, eager: tuple) -> tuple:
    """An attention block's glue compiled: one kernel reads q, k, v and writes q and the
    repeated k, v (rotary and the grouped-head repeat fused), the same backward."""
    q_heads, kv_heads, head_dim = attention_dims(layer)
    rows = math.prod(layer.output.shape[:-1])
    moved = rows * head_dim * (q_heads + 2 * kv_heads + 3 * q_heads) * element_bytes(dtype)
    return (moved, eager[1], moved if eager[2] else 0.0, eager[3], 1, 1 if eager[5] else 0)


def _least(fused: tuple, eager: tuple) -> tuple:
    return tuple(min(f, e) for f, e in zip(fused, eager))


def _spread(total: tuple, members: list[Layer], dtype: str) -> dict[str, tuple]:
    """The group's traffic shared over its members by their eager bytes."""
    weight = [sum(m.attrs["traffic"][dtype][:4]) for m in members]
    whole = sum(weight)
    shares = [w / whole for w in weight] if whole else [1.0] + [0.0] * (len(members) - 1)
    return {m.node: tuple(x * s for x in total) for m, s in zip(members, shares)}


def fused(graph: ModelGraph, fuse_attention_glue: bool = False) -> ModelGraph:
    """The graph as torch.compile runs it: each element-wise layer's `traffic` attr
    replaced by its share of its fusion group's (each attention block's glue too where
    `fuse_attention_glue`); the eager traffic kept under `eager_traffic`. GEMMs, FLOPs
    and memory are unchanged."""
    dtypes = next((tuple(l.attrs["traffic"]) for l in graph.layers
                   if "traffic" in l.attrs), ())
    new: dict[str, dict[str, tuple]] = {}
    for members in groups(graph):
        for dtype in dtypes:
            eager = tuple(map(sum, zip(*(m.attrs["traffic"][dtype] for m in members))))
            total = _least(group_traffic(graph, members, dtype), eager)
            for node, moved in _spread(total, members, dtype).items():
                new.setdefault(node, {})[dtype] = moved
    for layer in graph.layers:
        if fuse_attention_glue and "traffic" in layer.attrs and attention_dims(layer) is not None:
            new[layer.node] = {d: _least(attention_glue(layer, d, t), t)
                               for d, t in layer.attrs["traffic"].items()}
    layers = tuple(layer if layer.node not in new else replace(
        layer, attrs={**layer.attrs, "traffic": new[layer.node],
                      EAGER: layer.attrs["traffic"]}) for layer in graph.layers)
    return replace(graph, layers=layers)
