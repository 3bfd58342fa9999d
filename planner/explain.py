"""The dry run: a Plan told in a summary, a table of layers and a reason for each choice."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from planner.plan import Plan


def _ms(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _gb(nbytes: float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def summary(plan: Plan) -> list[str]:
    p, c, s = plan.predicted, plan.cluster, plan.solver
    link = c.intra_node if c.nodes == 1 else c.inter_node
    lines = [
        f"hyplan plan: {plan.model}, global batch {plan.global_batch}, on {c.describe()} "
        f"({c.num_devices} devices, {link.name} {link.bandwidth_bytes_per_s / 1e9:g} GB/s), "
        f"optimizer {plan.optimizer}, {c.dtype}",
        f"Predicted step time: {_ms(p.step_time_s)} = compute {_ms(p.compute_s)} + "
        f"communication {_ms(p.communication_s)} + optimizer {_ms(p.other_s)}"
        + (f" + fixed per step {_ms(p.fixed_s)}" if p.fixed_s else ""),
    ]
    if p.data_parallel_step_time_s:
        lines.append(f"  pure data parallel on the same devices: {_ms(p.data_parallel_step_time_s)}"
                     f" -> this plan is {p.speedup_over_data_parallel:.2f}x faster")
    for kind, t in p.baseline_step_time_s.items():
        if kind == "ddp":
            continue  # the data-parallel line above
        from planner.baseline import LABELS

        lines.append(f"  {LABELS.get(kind, kind)} on the same devices: {_ms(t)} -> this plan "
                     f"is {t / p.step_time_s:.2f}x faster")
    if p.single_device_step_time_s:
        lines.append(f"  one {c.device.name} (same global batch): {_ms(p.single_device_step_time_s)}"
                     f" -> speedup {p.speedup_over_single_device:.2f}x on {c.num_devices} devices")
    same = len(set(p.memory_bytes)) == 1
    lines.append(f"Memory per device: {_gb(max(p.memory_bytes))} of {_gb(p.memory_limit_bytes)}"
                 + (f" (all {len(p.memory_bytes)} devices alike)" if same else ""))
    lines.append(f"Solver: {s.status} (objective {_ms(s.objective_s)}, bound {_ms(s.bound_s)}), "
                 f"{s.seconds:.2f} s with {s.backend}; planning took {s.planning_seconds:.1f} s")
    if plan.inputs:
        lines.append("Inputs: " + ", ".join(
            f"{i.name} ({'each rank passes its rows' if i.layout == 'batch' else 'every rank passes the whole batch'})"
            for i in plan.inputs))
    return lines


def table(plan: Plan) -> Table:
    t = Table(title="Layers (times per step, memory per device)", title_justify="left")
    for header, justify in [("layer", "left"), ("kind", "left"), ("strategy", "left"),
                            ("layout in -> out", "left"), ("compute", "right"),
                            ("comm", "right"), ("reshard", "right"), ("memory", "right")]:
        t.add_column(header, justify=justify, no_wrap=True)
    for layer in plan.layers:
        t.add_row(layer.name, layer.kind, layer.strategy,
                  f"{layer.input_layout} -> {layer.output_layout}", _ms(layer.compute_s),
                  _ms(layer.communication_s), _ms(layer.reshard_in_s), _gb(layer.memory_bytes))
    return t


def explain(plan: Plan, width: int = 130) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, record=True, color_system=None)
    for line in summary(plan):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(table(plan))
    console.print("Why:", highlight=False)
    for layer in plan.layers:
        if layer.param_bytes or layer.model_parallel:
            console.print(f"  {layer.name}: {layer.reason}", highlight=False, soft_wrap=True)
    return buffer.getvalue()
