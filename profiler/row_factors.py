"""Which tensors of an exported graph carry the batch in dim 0, and how: known from a
second torch.export at another batch size, not guessed from sizes.

A graph exported with static shapes says only that a tensor's dim 0 is 4; whether that 4
is the batch, four heads or a 4x4 patch grid, it cannot say. Hyplan took a dim 0 equal to
the batch for rows, and refused or mis-split models where it was not: BLOOM's ALiBi slopes
and MPT's have one entry per head (4 heads: a batch of 4 took them for rows), BEiT's
relative positions a 4x4 grid, and models that fold the rows into the next dims (OPT's
`reshape(-1, hidden)` gives batch x tokens rows, BLOOM's and DeBERTa's attention batch x
heads, Swin's windows batch x windows) had rows hyplan could not see. Exported again with
one row more (each batch input's rows repeated in turn: token ids and masks stay valid),
each tensor's dim 0 tells: the same size in both, no batch at all (factor 0); k times the
batch in both, the batch with k entries per row (in order: each row's entries together, as
a view of a row-split tensor hands them on: `TensorMeta.row_factor`); anything else (batch
+ 1, batch squared), not rows.

The second export is static like the first (a second or so for a small model on fake
tensors). A dynamic one (`Dim.AUTO` on the batch, sizes as symbols) says the same and took
2-4x as long (2.7 s against 1.0 s for a small Hugging Face decoder here: the symbolic shape
reasoning), on every model the planner traces; on the conformance zoos it gave the same
factors, less the `alias` nodes a static export keeps and a dynamic one does not. Where the
second export cannot be made (code that needs the batch it was given), or a node has no
counterpart, the factor is left unknown and the dim-0 rule applies as before.
"""

from __future__ import annotations

import difflib
from dataclasses import replace

import torch

from profiler.export_program import export_program
from profiler.graph import Layer


def row_factors(model: torch.nn.Module, args: tuple, kwargs: dict, batch: int,
                static: torch.export.ExportedProgram) -> dict[str, int]:
    """{node name of `static` (the static export of `model` on `args`, `kwargs`): its
    tensor's row factor}, for the nodes the export at batch + 1 matches; {} where it fails."""
    grown = batch + 1
    try:
        other = export_program(model, _grown(tuple(args), batch, grown),
                               _grown(kwargs, batch, grown))
    except Exception:  # noqa: BLE001 - any failure leaves the factors unknown
        return {}
    out: dict[str, int] = {}
    for node, twin in _matched(_tensor_nodes(static), _tensor_nodes(other)):
        factor = _factor(node.meta["val"], twin.meta["val"], batch, grown)
        if factor is not None:
            out[node.name] = factor
    return out


def _grown(value, batch: int, grown: int):
    """`value` (inputs, nested) with every tensor of `batch` rows given `grown` rows, its
    own rows in turn (the dims torch.export's `Dim.AUTO` would have made dynamic)."""
    if isinstance(value, torch.Tensor) and value.dim() and value.shape[0] == batch:
        return value[torch.arange(grown, device=value.device) % batch]
    if isinstance(value, dict):
        return {k: _grown(v, batch, grown) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return type(value)(_grown(v, batch, grown) for v in value)
    return value


def _tensor_nodes(program: torch.export.ExportedProgram) -> list[torch.fx.Node]:
    return [n for n in program.graph_module.graph.nodes
            if isinstance(n.meta.get("val"), torch.Tensor)]


def _matched(static: list, other: list) -> list[tuple]:
    """Pairs (node, its twin) of the same call: the two graphs' tensor-valued nodes
    aligned by op (difflib's longest matching blocks; inputs by name). Names do not pair
    them: size arithmetic takes numbers from the same counters."""
    def key(n):
        return n.target if n.op != "placeholder" else n.name
    blocks = difflib.SequenceMatcher(None, [key(n) for n in static], [key(n) for n in other],
                                     autojunk=False).get_matching_blocks()
    return [(static[i + k], other[j + k]) for i, j, size in blocks for k in range(size)]


def _factor(value: torch.Tensor, twin: torch.Tensor, batch: int, grown: int) -> int | None:
    """k where dim 0 is k rows of `batch` in `value` and of `grown` in `twin`, 0 where it
    is the same size in both (a 0-d tensor too), None otherwise (batch + 1, batch squared,
    a size the data sets: not rows)."""
    if value.dim() != twin.dim():
        return None
    if not value.dim():
        return 0
    size, grown_size = value.shape[0], twin.shape[0]
    if not (isinstance(size, int) and isinstance(grown_size, int)):
        return None  # data-dependent (unbacked) sizes: nothing is known
    if size == grown_size:
        return 0
    k, rest = divmod(size, batch)
    return k if rest == 0 and k > 0 and grown_size == k * grown else None


# ops that hand each row's entries on together from a tensor with rows in dim 0 (row-major
# views), and ops that tile a tensor without rows outermost by the batch's size
VIEWS = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as",
                   "reshape_as"})
TILES = frozenset({"repeat", "tile"})


def in_order(layers: list[Layer], batch: int) -> list[Layer]:
    """`layers` with a merged row factor (k > 1) kept only where it holds each row's k
    entries together: a view of a tensor with rows, a tile of tensors without, or a layer
    reading a tensor with the same factor. The sizes alone do not say it: a (tokens,
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
