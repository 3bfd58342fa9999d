"""Where a pipeline may cut a torch.export graph: between transformer blocks, as torchtitan
cuts Llama.

The executor of such a plan (executor.hf_stages) builds each stage from the model's own
modules: the first stage runs the embeddings and its blocks, a middle one its blocks, the
last its blocks, the final norm and the head; only the hidden state travels between
stages, and each stage recomputes what depends on the sequence alone (positions, the
causal mask, rotary tables). So the planner's units are whole blocks, plus one unit for
everything before the first block and one for everything after the last, and a cut sends
only values that carry weights' work (the hidden state), never the recomputed ones.

A weight shared by the token embedding and the head (GPT-2 as shipped, Qwen2's small
configs: `tie_word_embeddings`) lies on the first and the last stage at once. As
Megatron-LM does, each of the two stages holds a copy and, after backward, the copies'
gradients are summed by one all-reduce between the two (its "embedding group"), so both
stay equal (executor.hf_stages); the planner prices that all-reduce and both copies'
memory (`tied_heads`). A weight shared any other way (a block's) keeps the model uncut.
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
    inputs = [l.name for l in graph.layers if l.is_input]
    if len(inputs) > 1:
        # executor.hf_stages: a stage is handed the token ids or the hidden states alone
        return (f"{graph.model_name}'s pipeline stages take the token ids alone, and it is "
                f"given {len(inputs)} inputs ({', '.join(inputs)}): a later stage would get "
                f"no {inputs[1]}; pass the ids alone to pipeline it")
    seen = [block_of(graph.scopes.get(l.node, ""), graph.blocks) for l in graph.layers]
    order = [b for b in seen if b is not None]
    if sorted(set(order)) != list(range(len(graph.blocks))) or order != sorted(order):
        return f"{graph.model_name}'s blocks do not each run once, in order"
    first = seen.index(0)
    last = len(seen) - 1 - seen[::-1].index(len(graph.blocks) - 1)
    if any(b is None for b in seen[first:last + 1]):
        return f"{graph.model_name} runs code between its blocks"
    return _stream_resumable(graph, first) or _why_ties_stop_cuts(graph)


def _why_ties_stop_cuts(graph: ModelGraph) -> str:
    """'' when every weight layers share is read only before and after the blocks (a tied
    embedding and head: one copy on the first stage, one on the last), and its first
    reader reads nothing else (the copy the last stage prices is that layer's weights)."""
    unit = dict(zip((l.node for l in graph.layers), _units(graph)))
    for group in graph.tied_groups():
        inside = [n for n in group if unit[n] not in (BEFORE, AFTER)]
        if inside:
            return (f"{graph.model_name}'s layers {', '.join(group)} share a parameter "
                    f"inside its blocks, which must stay in one stage")
    owners = {l.node: l for l in graph.layers}
    for node, owner in _tied_owners(graph):
        if set(owners[owner].params) - set(owners[node].params):
            return (f"{graph.model_name}'s {owners[owner].name} holds weights besides the one "
                    f"it shares with {owners[node].name}, which must stay in one stage")
    return ""


def _tied_owners(graph: ModelGraph) -> set[tuple[str, str]]:
    """(node after the blocks, node before them that owns a weight it reads) pairs."""
    unit = dict(zip((l.node for l in graph.layers), _units(graph)))
    owner_of: dict[str, str] = {}
    for layer in graph.layers:
        for name in layer.params:
            owner_of.setdefault(name, layer.node)
    return {(l.node, owner_of[name]) for l in graph.layers if unit[l.node] == AFTER
            for name in l.params if unit[owner_of[name]] == BEFORE}


def tied_heads(graph: ModelGraph) -> dict[str, int]:
    """{node of a layer after the blocks (the head): bytes of the weight it shares with a
    layer before them (the token embedding)}: with more than one stage, the last stage
    holds a copy of that weight and all-reduces its gradient with the first stage's once
    per step. Empty when nothing is shared so, or the graph is not cut at blocks."""
    if graph.tracer != "export" or not graph.tied_groups() or block_units(graph) is None:
        return {}
    layers = {l.node: l for l in graph.layers}
    out: dict[str, int] = {}
    for node, owner in _tied_owners(graph):
        out[node] = out.get(node, 0) + layers[owner].param_bytes
    return out


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


def carries_weights(graph: ModelGraph) -> frozenset[str]:
    """Layer nodes whose value depends on a parameter (the hidden state and what leads to
    it): what a cut must send. The rest depend on the inputs' shapes or positions alone
    and each stage recomputes them. Made once per graph and kept on it (as
    ModelGraph.readers keeps its counts): the 3-D search asks for it on every shape's
    problem, 23 ms a time on DeepSeek-V3's 7,342 layers."""
    kept = graph.__dict__.get("_carries_weights")
    if kept is not None:
        return kept
    out: set[str] = set()
    for layer in graph.layers:
        if layer.params or any(src in out for src in layer.inputs):
            out.add(layer.node)
    out = frozenset(out)
    object.__setattr__(graph, "_carries_weights", out)
    return out
