"""The dry run: a Plan told in a summary, a table of layers and a reason for each choice."""

from __future__ import annotations

import io

from rich.console import Console
from rich.table import Table

from planner.baseline import LABELS
from planner.handback import output_whole, sharing_group
from planner.plan import EVERY_BLOCK, Plan, set_explainer
from planner.report.levers import lever_lines
from planner.report.sequence import sequence_lines


def _sharding(layer) -> str:
    """" +fsdp" or " +hsdp" after the strategy of a layer sharded over its dp group."""
    return (" +hsdp" if layer.hsdp else " +fsdp") if layer.dp_shard else ""


def _ms(seconds: float) -> str:
    if seconds >= 1.0:
        return f"{seconds:.2f} s"
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _gb(nbytes: float) -> str:
    if nbytes and nbytes < 1e5:
        return f"{nbytes / 1e3:.1f} KB"
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"


def does_not_fit(needs_bytes: float, limit_bytes: float) -> str:
    """How a plan that cannot run is reported: what it needs, never how fast it would be."""
    return f"does not fit (needs {_gb(needs_bytes)} of {_gb(limit_bytes)} per device)"


def _sends(nbytes: float | None) -> str:
    return "" if nbytes is None else f", sends {_gb(nbytes)} per device"


def baseline_lines(p) -> list[str]:
    """Pure data parallelism and each hand-written baseline beside the plan: its step time
    and communication volume and how much faster the plan is, or, where it does not fit the
    memory limit, what it would need."""
    lines = []
    ddp = p.baselines.get("ddp")
    if p.data_parallel_step_time_s:
        head = "  pure data parallel on the same devices: "
        if p.data_parallel_fits is False:
            lines.append(head + does_not_fit(p.data_parallel_memory_bytes, p.memory_limit_bytes))
        else:
            lines.append(head + f"{_ms(p.data_parallel_step_time_s)}"
                         f"{_sends(ddp.communication_bytes if ddp else None)} -> this plan is "
                         f"{p.speedup_over_data_parallel:.2f}x faster")
    for kind, b in p.baselines.items():
        if kind == "ddp":
            continue  # the data-parallel line above
        head = f"  {LABELS.get(kind, kind)} on the same devices: "
        if b.fits is False:
            lines.append(head + does_not_fit(b.memory_bytes, p.memory_limit_bytes))
        else:
            lines.append(head + f"{_ms(b.step_time_s)}{_sends(b.communication_bytes)} -> this "
                         f"plan is {b.step_time_s / p.step_time_s:.2f}x faster")
    return lines


def kernel_lever_lines(levers) -> list[str]:
    """Which kernel levers (strategies.kernel_levers) the step was priced with, and that
    hyplan's executor runs none of them: they price a configuration torchtitan runs."""
    if not levers.any:
        return []
    return [f"Kernel levers priced: {levers.describe()} (torch.compile: fused element-wise "
            f"traffic, strategies.fusion; float8: strategies.float8; async TP: "
            f"strategies.async_tp); priced only: hyplan's executor runs the step eagerly in "
            f"bf16, so a plan it runs is priced with the levers off"]


def summary(plan: Plan) -> list[str]:
    p, c, s = plan.predicted, plan.cluster, plan.solver
    link = c.intra_node if c.nodes == 1 else c.inter_node
    lines = [
        f"hyplan plan: {plan.model}, global batch {plan.global_batch}, on {c.describe()} "
        f"({c.num_devices} devices, {link.name} {link.bandwidth_bytes_per_s / 1e9:g} GB/s), "
        f"optimizer {plan.optimizer}",
        f"Precision: {plan.training_precision.describe()}"
        + (f" (FLOP rate read at {c.dtype})" if c.dtype else ""),
        f"Priced with: {c.source or 'the catalog figures of ' + c.device.name}",
        f"Predicted step time: {_ms(p.step_time_s)} = compute {_ms(p.compute_s)} + "
        f"communication {_ms(p.communication_s)}"
        + (f" ({_gb(p.communication_bytes)} sent per device)" if p.communication_bytes else "")
        + f" + optimizer {_ms(p.other_s)}"
        + (f" + pipeline bubble {_ms(p.bubble_s)}" if p.bubble_s else "")
        + (f" + fixed per step {_ms(p.fixed_s)}" if p.fixed_s else ""),
    ]
    lines += baseline_lines(p) + kernel_lever_lines(c.levers)
    if p.single_device_step_time_s:
        lines.append(f"  one {c.device.name} (same global batch): {_ms(p.single_device_step_time_s)}"
                     f" -> speedup {p.speedup_over_single_device:.2f}x on {c.num_devices} devices")
    same = len(set(p.memory_bytes)) == 1
    lines.append(f"Memory per device: {_gb(max(p.memory_bytes))} of {_gb(p.memory_limit_bytes)}"
                 + (f" (all {len(p.memory_bytes)} devices alike)" if same else ""))
    gap = f", gap {s.gap:.1%}" if s.status != "optimal" else ""
    lines.append(f"Solver: {s.status} (objective {_ms(s.objective_s)}, bound {_ms(s.bound_s)}"
                 f"{gap}), {s.seconds:.2f} s with {s.backend}; planning took "
                 f"{s.planning_seconds:.1f} s" + (f"; {s.note}" if s.note else ""))
    if plan.context_parallel is not None:
        return lines + context_lines(plan)
    if plan.inputs:
        lines.append("Inputs: " + ", ".join(
            f"{i.name} ({'each rank passes its rows' if i.layout == 'batch' else 'every rank passes the whole batch'})"
            for i in plan.inputs))
    if plan.inputs and output_whole(plan):
        rows, ranks = sharing_group(plan)
        why = (f"a microbatch of {rows} per replica does not split evenly over tp {ranks}"
               if plan.is_mesh_3d else f"a batch of {rows} does not split evenly over "
               f"{ranks} devices")
        lines.append(f"Output: handed back whole to every rank, the targets passed whole "
                     f"({why}; the plan prices the gather)")
    return lines


def context_lines(plan: Plan) -> list[str]:
    """A context-parallel plan's mesh, how it splits each sequence and holds the weights,
    why this degree, and what each rank is fed."""
    cp, m = plan.context_parallel, plan.mesh
    n, chunks = plan.num_devices, 2 * cp.degree
    held = [l for l in plan.layers if l.param_bytes > 0]
    sharded = sum(l.shards_weights for l in held)
    weights = (f"FSDP2-sharded over all {n} ranks" if cp.sharded else
               f"replicated, gradients all-reduced over all {n} ranks (DDP)" if not sharded
               else f"FSDP2-sharded over all {n} ranks in {sharded} of the {len(held)} layers "
                    f"holding them, replicated (DDP) in the rest")
    mesh = (f"Context parallel: cp {cp.degree} x dp {m.size('dp')} (mesh dims dp, cp); each "
            f"sequence cut into {chunks} chunks, rank r of a cp group keeping chunks r and "
            f"{chunks - 1}-r (equal work under the causal mask); attention all-gathers K/V "
            f"over its cp group ({m.group_links.get('cp', '?')}); weights {weights}")
    inputs = ("Inputs: each rank passes its replica's rows, its chunks of every sequence "
              "(executor.shard_batch); labels shifted before the split; the loss is "
              "executor.context_parallel.token_loss over the rank's tokens")
    checkpointed = (f"Activation checkpointing: {len(plan.recompute_blocks)} transformer "
                    f"blocks (keep their input, run their forward again in backward)"
                    if plan.recompute_blocks else "Activation checkpointing: none")
    if cp.degree == 1:
        mesh = (f"Context parallel: cp 1 x dp {m.size('dp')}: no sequence split pays here "
                f"(every sequence whole on one device); weights {weights}")
    return [mesh, f"  why cp {cp.degree}: {cp.why}", checkpointed, inputs]


def table(plan: Plan) -> Table:
    t = Table(title="Layers (times per step, memory per device)", title_justify="left")
    staged = plan.pipeline is not None
    if staged:
        t.add_column("stage", justify="right")
    for header, justify in [("layer", "left"), ("kind", "left"), ("strategy", "left"),
                            ("layout in -> out", "left"), ("compute", "right"),
                            ("comm", "right"), ("reshard", "right"), ("memory", "right")]:
        t.add_column(header, justify=justify, no_wrap=True)
    for layer in plan.layers:
        t.add_row(*([str(layer.stage)] if staged else []), layer.name, layer.kind,
                  layer.strategy + _sharding(layer)
                  + (" +recompute" if layer.recompute else ""),
                  f"{layer.input_layout} -> {layer.output_layout}", _ms(layer.compute_s),
                  _ms(layer.communication_s), _ms(layer.reshard_in_s), _gb(layer.memory_bytes))
    return t


def mesh_lines(plan: Plan) -> list[str]:
    """The 3-D mesh: its dims, which devices form each group and over which link."""
    m = plan.mesh
    pp, dp, tp = (m.size(d) for d in ("pp", "dp", "tp"))
    per_node = m.devices_per_node
    lines = [f"Mesh: pipeline {pp} x data {dp} x tensor {tp} (rank = (stage*{dp} + replica)"
             f"*{tp} + tp index; {m.nodes} node(s) of {per_node})"]
    for dim, label in (("tp", "tensor-parallel"), ("dp", "data-parallel"), ("pp", "pipeline")):
        groups = m.groups.get(dim, [])
        if not groups or len(groups[0]) == 1:
            continue
        nodes = {r // per_node for r in groups[0]}
        where = "inside one node" if len(nodes) == 1 else f"across {len(nodes)} nodes"
        lines.append(f"  {label} groups of {len(groups[0])} ({len(groups)} groups, e.g. ranks "
                     f"{_ranks(groups[0])}): {where}, {m.group_links.get(dim, '?')}")
    return lines


def _ranks(ranks: list[int]) -> str:
    if len(ranks) > 2 and all(b - a == ranks[1] - ranks[0] for a, b in zip(ranks, ranks[1:])):
        step = ranks[1] - ranks[0]
        return f"{ranks[0]}..{ranks[-1]}" + (f" step {step}" if step != 1 else "")
    return ", ".join(map(str, ranks))


def memory_line(b) -> str:
    return (f"{_gb(b.total_bytes)} = parameters {_gb(b.parameters_bytes)} + gradients "
            f"{_gb(b.gradients_bytes)} + optimizer state {_gb(b.optimizer_state_bytes)} + "
            f"activations {_gb(b.activations_bytes)} ({b.microbatches_in_flight} microbatch"
            f"{'es' if b.microbatches_in_flight != 1 else ''} in flight)")


def pipeline_lines(plan: Plan) -> list[str]:
    """Stages with their modules, devices, times and memory; or why there is no pipeline."""
    lines = []
    if plan.recompute_blocks:
        which = ("every transformer block" if EVERY_BLOCK in plan.recompute_blocks else
                 f"{len(plan.recompute_blocks)} transformer block"
                 f"{'s' if len(plan.recompute_blocks) != 1 else ''}"
                 + (f" ({', '.join(plan.recompute_blocks)})"
                    if len(plan.recompute_blocks) <= 6 else ""))
        lines.append(f"Activation checkpointing: {which} (keeps the hidden "
                     "state entering it, runs its forward again in backward; activations "
                     "below include one block's, live during its backward)")
    q = plan.pipeline
    if q is None:
        b = plan.predicted.memory_breakdown
        lines.append("Pipeline: none (one stage)")
        if b:
            held = max(plan.predicted.memory_bytes) - b[0].total_bytes
            lines.append(f"  memory per device: {memory_line(b[0])}"
                         + (f" + what the step holds beside the layers {_gb(held)} (loss, "
                            f"buffers, optimizer temporaries: strategies.step_memory)"
                            if held > 0 else ""))
        return lines
    chunks = (f" ({len(q.stages) // q.chunks} ranks x {q.chunks} chunks)"
              if q.chunks > 1 else "")
    lines.append(f"Pipeline: {len(q.stages)} stages{chunks}, schedule {q.schedule}, "
                 f"{q.microbatches} microbatches of {q.microbatch_rows} rows per replica, "
                 f"bubble {q.bubble_fraction:.1%} of the step")
    if q.why:
        lines.append(f"  schedule: {q.why}")
    for st in q.stages:
        mods = st.modules if len(st.modules) <= 4 else [st.modules[0], "...", st.modules[-1]]
        where = (f" on pipeline rank {st.pipeline_rank}"
                 if q.chunks > 1 and st.pipeline_rank is not None else "")
        lines.append(f"  stage {st.index}{where}: {len(st.modules)} modules ({', '.join(mods)}), "
                     f"{len(st.layers)} layers on ranks {_ranks(st.ranks)}; "
                     f"{_ms(st.microbatch_s)} per microbatch (transfers {_ms(st.send_s)}), "
                     f"{_ms(st.step_s)} per step (gradient sync + optimizer)")
        lines.append(f"    memory per device: {memory_line(st.memory)}")
    return lines


def search_lines(plan: Plan, top: int = 8) -> list[str]:
    r = plan.search
    if r is None:
        return []
    lines = [f"Search: {r.candidates} candidates (mesh shape x microbatches x schedule), "
             f"{r.solved} solved, {r.pruned} pruned, in {r.seconds:.1f} s. Best per mesh shape:"]
    for c in r.best_per_shape[:top]:
        value = (f"{_ms(c.step_time_s)}" if c.step_time_s is not None
                 else f">= {_ms(c.bound_s)}" if c.bound_s is not None else "-")
        chunks = f" v={c.chunks}" if c.chunks > 1 else ""
        cp = f" x cp {c.cp:>2}" if c.cp > 1 else ""
        lines.append(f"  pp {c.pp:>2} x dp {c.dp:>2} x tp {c.tp:>2}{cp}, m {c.microbatches:>3} "
                     f"{c.schedule}{chunks}: {value} ({c.outcome.replace('_', ' ')}"
                     f"{'; ' + c.note if c.note else ''})")
    if len(r.best_per_shape) > top:
        lines.append(f"  ... {len(r.best_per_shape) - top} more shapes")
    return lines


def explain(plan: Plan, width: int = 130) -> str:
    buffer = io.StringIO()
    console = Console(file=buffer, width=width, record=True, color_system=None)
    extra = []
    if plan.is_mesh_3d:
        extra = mesh_lines(plan) + pipeline_lines(plan) + search_lines(plan)
    elif plan.search is not None:  # mesh="auto" kept the 1-D plan: what the search saw
        extra = search_lines(plan)
    if plan.mesh_choice:
        extra = [f"Mesh choice: {plan.mesh_choice}"] + extra
    if plan.standard_choice:
        extra = [f"Standard plan: {plan.standard_choice}"] + extra
    if plan.context_parallel is None:  # a cp plan's weights and checkpointing: its own lines
        extra += lever_lines(plan) + sequence_lines(plan)
    for line in summary(plan) + extra:
        console.print(line, highlight=False, soft_wrap=True)
    console.print(table(plan))
    console.print("Why:", highlight=False)
    for layer in plan.layers:
        if layer.param_bytes or layer.model_parallel:
            console.print(f"  {layer.name}: {layer.reason}", highlight=False, soft_wrap=True)
    return buffer.getvalue()


set_explainer(explain)  # Plan.explain() renders with this (see planner.plan.set_explainer)
