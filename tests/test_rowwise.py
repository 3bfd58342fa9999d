"""Which parameter-free ops keep the batch rows apart (strategies.rowwise), read off real
traces: a data-parallel op must give each rank exactly its rows of the output."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from planner.profiled import trace_model
from strategies.rowwise import keeps_rows

BATCH = 4


class PaddedNormed(nn.Module):
    """MobileNetV2's and Swin's pads of height and width, ConvNeXt-V2's GRN norm over
    height and width, and a pad and a norm that reach the rows."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)

    def forward(self, x):
        h = self.conv(F.pad(x, (0, 1, 0, 1)))
        grn = h / torch.linalg.vector_norm(h, ord=2, dim=(2, 3), keepdim=True)
        zero_rows = F.pad(grn, (1, 1, 0, 0, 0, 0, 0, 0))  # every pair given, dim 0's zero
        across = torch.linalg.vector_norm(zero_rows, dim=(0, 1), keepdim=True)
        more_rows = F.pad(zero_rows + across.expand_as(zero_rows), (0, 0, 0, 0, 0, 0, 1, 1))
        return more_rows[1:-1]


def test_pads_of_height_and_width_and_norms_over_them_keep_the_rows():
    graph = trace_model(PaddedNormed(), (torch.randn(BATCH, 3, 8, 8),), tracer="fx")
    ops = [l for l in graph.layers if l.op == "call_function"]
    pads = [l for l in ops if l.kind == "pad"]
    norms = [l for l in ops if l.kind == "linalg_vector_norm"]
    assert len(pads) == 3 and len(norms) == 2
    assert [keeps_rows(l, BATCH) for l in pads] == [True, True, False]
    assert [keeps_rows(l, BATCH) for l in norms] == [True, False]
