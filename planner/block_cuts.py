"""Where a pipeline may cut a torch.export graph: between transformer blocks, as torchtitan
cuts Llama.

The executor of such a plan (executor.hf_stages) builds each stage from the model's own
modules: the first stage runs the embeddings and its blocks, a middle one its blocks, the
last its blocks, the final norm and the head; only the hidden state travels between
stages, and each stage recomputes what depends on the sequence alone (positions, the
causal mask, rotary tables). So the planner's units are whole blocks, plus one unit for
everything before the first block and one for everything after the last, and a cut sends
only values that carry weights' work (the hidden state), never the recomputed ones.
"""

from __future__ import annotations

from profiler.blocks import block_of
from profiler.graph import ModelGraph

BEFORE, AFTER = "<before the blocks>", "<after the blocks>"


def block_units(graph: ModelGraph) -> list[str] | None:
    """Per layer, the unit a cut may not split: its block's path inside a block, BEFORE
    for every layer ahead of the first block (embeddings, positions, mask), AFTER for every
    layer behind the last (final norm, head). None when the graph has no block list or
    its blocks do not run one after another, each whole, in order (`why_no_blocks` says
    which)."""
    return None if why_no_blocks(graph) else _units(graph)


def why_no_blocks(graph: ModelGraph) -> str:
    """'' when a pipeline may cut `graph` at its blocks, else why not, in a few words."""
    if not graph.blocks:
        return graph.no_blocks_why or f"{graph.model_name} has no transformer blocks recorded"
    seen = [block_of(graph.scopes.get(l.node, ""), graph.blocks) for l in graph.layers]
    order = [b for b in seen if b is not None]
    if sorted(set(order)) != list(range(len(graph.blocks))) or order != sorted(order):
        return f"{graph.model_name}'s blocks do not each run once, in order"
    first = seen.index(0)
    last = len(seen) - 1 - seen[::-1].index(len(graph.blocks) - 1)
    if any(b is None for b in seen[first:last + 1]):
        return f"{graph.model_name} runs code between its blocks"
    return _stream_resumable(graph, first)


# What may touch the hidden state before the first block, so that a later stage resumes it
# from `inputs_embeds` (executor.hf_stages): the token embedding (the first layer with
# weights), added position tables, dropout, and these ops
RESUMABLE_OPS = ("add", "to", "_to_copy", "alias", "clone", "view", "dropout")


def _stream_resumable(graph: ModelGraph, first_block_layer: int) -> str:
    carried = carries_weights(graph)
    stream = [l for l in graph.layers[:first_block_layer] if l.node in carried]
    for i, layer in enumerate(stream):
        if layer.op == "call_module":
            if i == 0 or layer.kind in ("Embedding", "Dropout"):
                continue
        elif layer.kind in RESUMABLE_OPS:
            continue
        return (f"{graph.model_name} runs {layer.kind} ({layer.name}) on the hidden state "
                f"before its first block, which a later stage cannot resume")
    return ""


def _units(graph: ModelGraph) -> list[str]:
    out, started = [], False
    for layer in graph.layers:
        b = block_of(graph.scopes.get(layer.node, ""), graph.blocks)
        if b is not None:
            started = True
            out.append(graph.blocks[b])
        else:
            out.append(AFTER if started else BEFORE)
    return out


def recorded_module(graph: ModelGraph, node: str) -> str | None:
    """The module path a plan's stage lists for a layer: its block, or the module that ran
    it outside the blocks (the embedding, the final norm, the head); None for code of the
    modules that hold the blocks (the model's own forward)."""
    scope = graph.scopes.get(node, "")
    b = block_of(scope, graph.blocks)
    if b is not None:
        return graph.blocks[b]
    holder = graph.blocks[0].rsplit(".", 1)[0] if graph.blocks else ""
    if scope == "" or holder == scope or holder.startswith(scope + "."):
        return None
    return scope


def carries_weights(graph: ModelGraph) -> set[str]:
    """Layer nodes whose value depends on a parameter (the hidden state and what leads to
    it): what a cut must send. The rest depend on the inputs' shapes or positions alone
    and each stage recomputes them."""
    out: set[str] = set()
    for layer in graph.layers:
        if layer.params or any(src in out for src in layer.inputs):
            out.add(layer.node)
    return out
