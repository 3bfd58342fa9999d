"""How dim 0 holds the batch (profiler.row_factors), read off a second torch.export at
another batch size rather than guessed from sizes, and what strategies.rowwise makes of it: rows
folded into the next dims are rows, a size equal to the batch by chance is not."""

from __future__ import annotations

import torch
from torch import nn

from planner.profiled import trace_model
from strategies.rowwise import keeps_rows

BATCH, TOKENS, WIDTH, HEADS = 4, 3, 8, 4  # as many heads as rows: the coincidence


class Folded(nn.Module):
    """OPT's `reshape(-1, hidden)` around a Linear, BLOOM's per-head slopes tiled by the
    batch, and two folds that do not keep a row's entries together."""

    def __init__(self, odd_folds: bool = True):
        super().__init__()
        self.odd_folds = odd_folds
        self.proj = nn.Linear(WIDTH, WIDTH)
        self.register_buffer("slopes", torch.arange(1.0, HEADS + 1))

    def forward(self, x):
        b, t, h = x.shape
        rows = self.proj(x.reshape(-1, h)).view(b, t, h)  # rows x tokens, and back
        per_head = self.slopes[:, None] * torch.arange(t)  # (heads, tokens): not rows
        tiled = per_head.repeat(b, 1)  # (batch x heads, tokens): each row's copy together
        if not self.odd_folds:  # each row's: its heads' slopes unfolded, summed
            return rows + tiled.view(b, HEADS, t).sum(1)[:, :, None]
        interleaved = per_head.repeat_interleave(b, dim=0)  # head by head: not rows
        token_major = rows.transpose(0, 1).reshape(-1, h)  # (tokens x batch): not rows
        return rows.mean() + tiled.mean() + interleaved.mean() + token_major.mean()


def _layers():
    graph = trace_model(Folded(), (torch.randn(BATCH, TOKENS, WIDTH),), tracer="export")
    by_kind: dict[str, list] = {}
    for layer in graph.layers:
        by_kind.setdefault(layer.name if layer.op == "call_module" else layer.kind, []).append(layer)
    return by_kind


def test_rows_folded_into_the_next_dims_are_rows_and_a_size_like_the_batch_is_not():
    layers = _layers()
    (folded, token_major), [unfolded] = layers["reshape"], layers["view"]
    [per_head], [tiled], [interleaved] = layers["mul"], layers["repeat"], layers["repeat_interleave"]
    assert per_head.output.shape == (HEADS, TOKENS) and token_major.output.shape == folded.output.shape
    assert (folded.output.row_factor, layers["proj"][0].output.row_factor,
            unfolded.output.row_factor) == (TOKENS, TOKENS, 1)
    assert per_head.output.row_factor == 0  # four heads, four rows: not the batch
    assert tiled.output.row_factor == HEADS
    # the same symbolic size, batch x 4 or tokens x batch, but not a row's entries together
    assert interleaved.output.row_factor == 0 and token_major.output.row_factor == 0
    assert [keeps_rows(l, BATCH) for l in (folded, unfolded, tiled)] == [True, True, True]
    assert [keeps_rows(l, BATCH) for l in (per_head, interleaved, token_major)] == [False] * 3


def test_the_linear_on_folded_rows_runs_data_parallel():
    import planner

    plan = planner.baseline(Folded(odd_folds=False), "2xcpu", "ddp", measure=False, tracer="export",
                            example_inputs=(torch.randn(BATCH, TOKENS, WIDTH),))
    proj = next(l for l in plan.layers if l.name == "proj")
    assert proj.strategy == "data_parallel" and proj.row_factor == TOKENS


def test_a_batch_of_one_row_has_its_folded_rows_known_too():
    # a dynamic export could not say it (torch.export specializes sizes 0 and 1: no symbol
    # stood for the batch, and the dim-0 rule took the 3 tokens of 1 row for no rows); an
    # export at 2 rows does
    graph = trace_model(Folded(odd_folds=False), (torch.randn(1, TOKENS, WIDTH),), tracer="export")
    folds = [l for l in graph.layers if l.kind in ("reshape", "view")][:2]
    assert [l.output.shape for l in folds] == [(TOKENS, WIDTH), (1, TOKENS, WIDTH)]
    assert [l.output.row_factor for l in folds] == [TOKENS, 1]
    assert [keeps_rows(l, 1) for l in folds] == [True, True]
