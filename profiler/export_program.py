"""torch.export as the profiler calls it: non-strict, and without a Python stack trace
recorded for every node.

torch.export extracts and symbolizes the caller's stack for each op it records
(`node.meta["stack_trace"]`, for torch's own error messages about a graph); hyplan reads
the ops, their shapes and `nn_module_stack`, never the stack. Left on, it was 16% of
exporting six of the zoo's Hugging Face models here (process time, 4 rounds after a warm-up:
16.5 s with, 13.8 s without), and the profiler exports each model twice (profiler.row_factors).
`torch.fx.config.do_not_emit_stack_traces` turns it off; it is set only for the call and
given back, so a user's own exports keep their traces.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.fx.config


@contextmanager
def _without_stack_traces():
    before = torch.fx.config.do_not_emit_stack_traces
    torch.fx.config.do_not_emit_stack_traces = True
    try:
        yield
    finally:
        torch.fx.config.do_not_emit_stack_traces = before


def export_program(model: torch.nn.Module, args: tuple,
                   kwargs: dict) -> torch.export.ExportedProgram:
    """`torch.export.export(model, args, kwargs, strict=False)`, its nodes without stacks."""
    with _without_stack_traces():
        return torch.export.export(model, tuple(args), kwargs=kwargs, strict=False)
