"""Which tensors of an exported graph carry the batch in dim 0, and how: known from a
second torch.export with the batch dim dynamic, not guessed from sizes.

A graph exported with static shapes says only that a tensor's dim 0 is 4; whether that 4
is the batch, four heads or a 4x4 patch grid, it cannot say. Hyplan took a dim 0 equal to
the batch for rows, and refused or mis-split models where it was not: BLOOM's ALiBi slopes
and MPT's have one entry per head (4 heads: a batch of 4 took them for rows), BEiT's
relative positions a 4x4 grid, and models that fold the rows into the next dims (OPT's
`reshape(-1, hidden)` gives batch x tokens rows, BLOOM's and DeBERTa's attention batch x
heads, Swin's windows batch x windows) had rows hyplan could not see. Exported again with
`Dim.AUTO` on the batch dim of every input that has it, each tensor's dim 0 is a symbolic
expression: `s0` is the batch, `8*s0` the batch with 8 entries per row (in order: each
row's entries together, as a view of a row-split tensor hands them on), a plain int no
batch at all (`TensorMeta.row_factor`).

The second export runs on fake tensors like the first (a second or so for a small
model). Where it cannot be made (code that branches on the batch size specializes it,
a batch of 1 is specialized by torch.export itself), or a node has no counterpart, the
factor is left unknown and the dim-0 rule applies as before.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import replace

import torch
from torch.export import Dim

from profiler.graph import Layer


def row_factors(model: torch.nn.Module, args: tuple, kwargs: dict, batch: int,
                static: torch.export.ExportedProgram) -> dict[str, int]:
    """{node name of `static` (the static export of `model` on `args`, `kwargs`): its
    tensor's row factor}, for the nodes the dynamic export matches; {} where it fails."""
    try:
        dynamic = torch.export.export(model, tuple(args), kwargs=kwargs,
                                      dynamic_shapes=_batch_dims(model, args, kwargs, batch),
                                      strict=False)
    except Exception:  # noqa: BLE001 - any failure leaves the factors unknown
        return {}
    symbols = _batch_symbols(dynamic, batch)
    if not symbols:  # the batch was specialized: nothing is known
        return {}
    out: dict[str, int] = {}
    for node, twin in _matched(_tensor_nodes(static), _tensor_nodes(dynamic)):
        value = twin.meta["val"]
        factor = _factor(value.shape[0], symbols) if value.dim() else 0
        if factor is not None:
            out[node.name] = factor
    return out


def _tensor_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)]


def _matched(static: list, dynamic: list) -> list[tuple]:
    """Pairs (static node, dynamic node) of the same call: the two graphs' tensor-valued
    nodes aligned by (op, shape) (difflib's longest matching blocks). Names do not pair
    them: the dynamic graph's size arithmetic takes numbers from the same counters, and
    it keeps slices the static one dropped as whole (`x[:, :8]` of 8)."""
    def key(n, shape):
        return (n.target if n.op != "placeholder" else n.name, shape)
    a = [key(n, tuple(n.meta["val"].shape)) for n in static]
    b = [key(n, _hint(n.meta["val"].shape)) for n in dynamic]
    blocks = difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks()
    return [(static[i + k], dynamic[j + k]) for i, j, size in blocks for k in range(size)]


def _hint(shape) -> tuple:
    return tuple(int(d.node.hint) if isinstance(d, torch.SymInt) else d for d in shape)


def _batch_dims(model, args: tuple, kwargs: dict, batch: int):
    """torch.export's dynamic_shapes: Dim.AUTO on dim 0 of every input tensor of `batch`
    rows, by the forward's argument names (keyword inputs included)."""
    def spec(value):
        if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
            return {0: Dim.AUTO}
        if isinstance(value, dict):
            return {k: spec(v) for k, v in value.items()}
        if isinstance(value, (tuple, list)):
            return type(value)(spec(v) for v in value)
        return None

    bound = inspect.signature(model.forward).bind(*args, **kwargs)
    return {name: spec(value) for name, value in bound.arguments.items()}


def _batch_symbols(program: torch.export.ExportedProgram, batch: int) -> set:
    """The symbols of the user inputs' dim 0 (one per input: they stand for one batch)."""
    users = set(program.graph_signature.user_inputs)
    symbols = set()
    for node in program.graph_module.graph.nodes:
        value = node.meta.get("val")
        if (node.op == "placeholder" and node.name in users and isinstance(value, torch.Tensor)
                and value.dim() and isinstance(value.shape[0], torch.SymInt)
                and value.shape[0].node.hint == batch):
            symbols.add(value.shape[0].node.expr)
    return symbols


def _factor(size, symbols: set) -> int | None:
    """k where `size` is k times a batch symbol, 0 where it is a plain int, None otherwise
    (batch + 1, batch squared: not rows)."""
    if not isinstance(size, torch.SymInt):
        return 0
    expr = size.node.expr
    for symbol in symbols:
        ratio = expr / symbol
        if ratio.is_Integer and int(ratio) > 0:
            return int(ratio)
    return 0 if not expr.free_symbols & symbols else None


# ops that hand each row's entries on together from a tensor with rows in dim 0 (row-major
# views), and ops that tile a tensor without rows outermost by the batch's size
VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as",
                   "reshape_as"})
TILES = frozenset({"repeat", "tile"})


def in_order(layers: list[Layer], batch: int) -> list[Layer]:
    """`layers` with a merged row factor (k > 1) kept only where it holds each row's k
    entries together: a view of a tensor with rows, a tile of tensors without, or a layer
    reading a tensor with the same factor. The symbol alone does not say it: a (tokens,
    batch) tensor flattened is `tokens * batch` long, token by token (factor 0 here). An
    input whose factor is not known counts as the dim-0 rule says."""
    factor: dict[str, int] = {}
    out = []
    for layer in layers:
        k = layer.output.row_factor
        if k is not None and k > 1:
            ins = [factor.get(i, 0) for i in layer.inputs]
            if not (k in ins
                    or (layer.kind in VIEWS and ins and ins[0] > 0)
                    or (layer.kind in TILES and not any(ins))):
                layer = replace(layer, output=replace(layer.output, row_factor=0))
        factor[layer.node] = (layer.output.row_factor if layer.output.row_factor is not None
                              else int(layer.output.has_rows(batch)))
        out.append(layer)
    return out
