"""The chosen plan beside the hand-written baselines, in one table (`hyplan compare`,
planner.cli.compare, prints it).

Every row is costed by the same model on the same profiled graph (layer timings are cached
by shape, so the baselines cost no extra measuring). A baseline with no plan on these
devices (`fsdp_tp` on two) gets a row that says why.

    hyplan compare examples/mlp.py --devices 2xcpu --batch 64
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table
from torch import nn

from planner.baseline import BASELINES, LABELS, baseline
from planner.optimize import optimize
from planner.plan import Plan
from planner.report.explain import _gb, _ms, does_not_fit
from strategies.context import FSDP_SUFFIX, TOKEN_SPLIT


@dataclass(frozen=True)
class Row:
    kind: str  # "hyplan" or a baseline kind
    label: str
    plan: Plan | None  # None: no plan of that kind on these devices (the note says why)
    note: str = ""


def compare(model: nn.Module, devices, example_inputs: Sequence, *, optimizer: str = "adam",
            memory_limit_bytes: float | None = None, leaf_modules=(),
            kinds: Sequence[str] | None = None) -> list[Row]:
    """hyplan's plan and each baseline (default: every kind) for `model` on `devices`."""
    chosen = optimize(model, devices, example_inputs=example_inputs, optimizer=optimizer,
                      memory_limit_bytes=memory_limit_bytes, leaf_modules=leaf_modules)
    rows = [Row("hyplan", "hyplan (chosen per layer)", chosen)]
    for kind in kinds or BASELINES:
        try:
            plan = baseline(model, chosen.cluster, kind, example_inputs, optimizer=optimizer,
                            leaf_modules=leaf_modules)
        except ValueError as error:  # no plan of that kind on these devices (fsdp_tp on 2)
            rows.append(Row(kind, LABELS[kind], None, str(error)))
            continue
        rows.append(Row(kind, LABELS[kind], plan))
    return rows


def _kind(layer) -> str:
    """DP, FSDP, MP, CP (a context-parallel plan's, +FSDP where sharded) or whole."""
    if layer.model_parallel:
        return "MP"
    base = layer.strategy.removesuffix(FSDP_SUFFIX)
    if base in TOKEN_SPLIT:
        return "CP+FSDP" if base != layer.strategy else "CP"
    return {"data_parallel": "DP", "fsdp": "FSDP"}.get(layer.strategy, "whole")


def _split(plan: Plan) -> str:
    """How the layers with weights run: data parallel, sharded (FSDP), model parallel,
    context parallel or whole, and the pipeline stages if any."""
    kinds = [_kind(l) for l in plan.layers if l.param_bytes]
    shown = ("CP", "CP+FSDP", "whole") if plan.context_parallel else (
        "DP", "FSDP", "MP", "whole")
    text = ", ".join(f"{kinds.count(k)} {k}" for k in shown
                     if kinds.count(k) or k in ("DP", "MP"))
    if plan.context_parallel:
        text += f"; cp {plan.context_parallel.degree} x dp {plan.mesh.size('dp')}"
    if plan.pipeline is not None:
        text += f"; {len(plan.pipeline.stages)} stages"
    return text


def table(rows: list[Row]) -> Table:
    chosen = rows[0].plan
    limit = chosen.predicted.memory_limit_bytes
    t = Table(title=f"{chosen.model}, global batch {chosen.global_batch}, on "
              f"{chosen.cluster.describe()}: predicted per step", title_justify="left")
    for header, justify in [("plan", "left"), ("weighted layers", "left"), ("step", "right"),
                            ("compute", "right"), ("comm", "right"), ("sent/device", "right"),
                            ("update", "right"), ("memory/device", "right"),
                            ("ratio", "right")]:
        # the two text columns wrap, so the figures are never cut short
        t.add_column(header, justify=justify, no_wrap=justify == "right")
    for row in rows:
        if row.plan is None:
            t.add_row(row.label, "none here (below)", *["-"] * 7)
            continue
        p = row.plan.predicted
        memory = max(p.memory_bytes)
        sent = "-" if p.communication_bytes is None else _gb(p.communication_bytes)
        # a plan that cannot run is no rival in speed (what it needs: below the table)
        ratio = (f"{p.step_time_s / chosen.predicted.step_time_s:.2f}x" if memory <= limit
                 else "does not fit")
        t.add_row(row.label, _split(row.plan), _ms(p.step_time_s), _ms(p.compute_s),
                  _ms(p.communication_s), sent, _ms(p.other_s), _gb(memory), ratio)
    return t


def _fits(row: Row, limit_bytes: float) -> bool:
    return row.plan is not None and max(row.plan.predicted.memory_bytes) <= limit_bytes


def render(rows: list[Row], width: int = 130) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, color_system=None)
    console.print(table(rows))
    limit = rows[0].plan.predicted.memory_limit_bytes
    for row in rows:
        if row.plan is None:
            console.print(f"{row.label}: {row.note}", highlight=False, soft_wrap=True)
        elif not _fits(row, limit):
            console.print(f"{row.label}: "
                          f"{does_not_fit(max(row.plan.predicted.memory_bytes), limit)}",
                          highlight=False, soft_wrap=True)
    ok = [r for r in rows[1:] if _fits(r, limit)]
    if not ok and any(r.plan is not None for r in rows[1:]):
        console.print(f"No baseline fits {_gb(limit)} per device; hyplan's plan needs "
                      f"{_gb(max(rows[0].plan.predicted.memory_bytes))}.", highlight=False)
    if ok:
        best = min(ok, key=lambda r: r.plan.predicted.step_time_s)
        ratio = best.plan.predicted.step_time_s / rows[0].plan.predicted.step_time_s
        verdict = (f"predicted {ratio:.2f}x faster" if ratio >= 1.005 else
                   "the same plan or as fast (the baseline is already optimal here)")
        if ratio < 0.995:  # a kind hyplan's own search does not offer (context parallel)
            verdict = (f"predicted {1 / ratio:.2f}x slower: its search does not offer this "
                       f"kind; plan it with `hyplan plan ... --kind {best.kind}`")
        console.print(f"The fastest baseline that fits is {best.label}: hyplan's plan is "
                      f"{verdict}. ratio = step time / hyplan's; sent/device = bytes each "
                      f"device sends per step.", highlight=False)
    return buffer.getvalue()
