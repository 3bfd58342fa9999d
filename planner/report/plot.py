"""Pictures of a plan (matplotlib, Agg): the strategy map, memory per device by kind, and
the pipeline schedule as a timeline per device.

Each picture is drawn from a small typed description (`LayerBar`, `DeviceMemory`,
`PipelineTimeline`), and each description is read from a Plan by one adapter function
(`layer_bars`, `memory_by_device`, `timeline_from_plan`). 3-D plans with pipeline stages
(Plan.pipeline) and a memory breakdown (Predicted.memory_breakdown) give one timeline row
per stage and memory by kind as the planner counted it; 1-D plans give one row.

    hyplan plan examples/alexnet.py --devices 8xK20 --batch 1024 --plot plots/
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from planner.plan import Plan

STRATEGY_COLORS = {  # one hue per idea: data parallel blue, model-parallel splits warm
    "data_parallel": "#4C72B0", "replicate": "#8C8C8C", "column_parallel": "#DD8452",
    "row_parallel": "#C44E52", "channel_parallel": "#DA8BC3", "vocab_parallel": "#937860",
    "feature_parallel": "#8172B3", "sequence_parallel": "#64B5CD",
}
KIND_COLORS = {"compute": None, "communication": "#2F2F2F", "reshard": "#A0A0A0",
               "update": "#55A868"}
MEMORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
                 "activations": "#C44E52", "other": "#BBBBBB"}
MEMORY_LABELS = {"optimizer": "optimizer state", "other": "inputs and other"}
ACTION_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "communication": "#2F2F2F",
                 "update": "#55A868"}
ACTION_LABELS = {"communication": "communication (collectives, sends, gradient sync)",
                 "update": "optimizer update"}


def _pyplot():
    from planner.extras import require

    matplotlib = require("matplotlib", "drawing a plan (planner.report.plot)")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def _ms(seconds: float) -> float:
    return seconds * 1e3


# --- the strategy map ---------------------------------------------------------------------

@dataclass(frozen=True)
class LayerBar:
    label: str
    strategy: str
    compute_s: float
    communication_s: float
    reshard_s: float
    update_s: float


def layer_bars(plan: Plan) -> list[LayerBar]:
    return [LayerBar(f"{l.name}  ({l.kind})", l.strategy, l.compute_s, l.communication_s,
                     l.reshard_in_s, l.update_s) for l in plan.layers]


def strategy_map(plan: Plan):
    """One row per layer, in execution order: its strategy (colour) and its predicted time
    per step split into compute, its own collectives, layout changes and the update."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    bars = layer_bars(plan)
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.32 * len(bars)))
    y = list(range(len(bars)))
    left = [0.0] * len(bars)
    for kind in ("compute", "communication", "reshard", "update"):
        widths = [_ms(getattr(b, f"{kind}_s")) for b in bars]
        colors = ([STRATEGY_COLORS.get(b.strategy, "#CCCCCC") for b in bars]
                  if kind == "compute" else KIND_COLORS[kind])
        ax.barh(y, widths, left=left, color=colors, height=0.7,
                hatch=None if kind == "compute" else ("///" if kind == "reshard" else None),
                edgecolor="white", linewidth=0.5)
        left = [l + w for l, w in zip(left, widths)]
    for row, (b, end) in enumerate(zip(bars, left)):
        ax.text(end, row, f"  {b.strategy.replace('_', ' ')}", va="center", fontsize=8)
    ax.set_yticks(y, [b.label for b in bars], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, max(left or [1]) * 1.3)
    ax.set_xlabel("predicted time per step (ms)")
    p = plan.predicted
    ax.set_title(f"{plan.model} on {plan.cluster.describe()}, batch {plan.global_batch}: "
                 f"strategy per layer (predicted step {_ms(p.step_time_s):.1f} ms)", fontsize=10)
    used = sorted({b.strategy for b in bars})
    handles = [Patch(color=STRATEGY_COLORS.get(s, "#CCCCCC"), label=s.replace("_", " "))
               for s in used]
    handles += [Patch(color=KIND_COLORS["communication"], label="collectives"),
                Patch(facecolor=KIND_COLORS["reshard"], hatch="///", label="layout change"),
                Patch(color=KIND_COLORS["update"], label="optimizer update")]
    ax.legend(handles=handles, loc="lower right", fontsize=8, frameon=False)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# --- memory per device --------------------------------------------------------------------

@dataclass(frozen=True)
class DeviceMemory:
    device: int
    parameters: float
    gradients: float
    optimizer: float
    activations: float
    other: float = 0.0
    last_device: int | None = None  # the bar stands for devices device..last_device alike

    @property
    def label(self) -> str:
        if self.last_device is None or self.last_device == self.device:
            return f"dev {self.device}"
        return f"devs {self.device}-{self.last_device}"


def memory_by_device(plan: Plan) -> list[DeviceMemory]:
    """Bytes per device by kind, consecutive devices that hold the same merged into one bar
    (a pipeline stage's devices; all devices of a 1-D plan). 3-D plans carry the planner's
    own split (Predicted.memory_breakdown); for 1-D plans, which give one total per device
    and per layer, the split follows the cost model (strategies.catalog: weights, as many
    gradient bytes, the optimizer's state factor times the weights, the rest activations)."""
    return _merge_alike(_memory_per_device(plan))


def _merge_alike(rows: list[DeviceMemory]) -> list[DeviceMemory]:
    out: list[DeviceMemory] = []
    for r in rows:
        last = out[-1] if out else None
        if last is not None and (last.parameters, last.gradients, last.optimizer,
                                 last.activations, last.other) == (
                r.parameters, r.gradients, r.optimizer, r.activations, r.other):
            out[-1] = DeviceMemory(last.device, last.parameters, last.gradients,
                                   last.optimizer, last.activations, last.other, r.device)
        else:
            out.append(r)
    return out


def _memory_per_device(plan: Plan) -> list[DeviceMemory]:
    from strategies.catalog import OPTIMIZER_STATE_FACTOR

    if plan.predicted.memory_breakdown:
        return [DeviceMemory(d, b.parameters_bytes, b.gradients_bytes, b.optimizer_state_bytes,
                             b.activations_bytes,
                             max(0.0, plan.predicted.memory_bytes[d] - b.total_bytes))
                for d, b in enumerate(plan.predicted.memory_breakdown)]

    factor = OPTIMIZER_STATE_FACTOR.get(plan.optimizer, 2)
    params = acts = 0.0
    for l in plan.layers:
        local = l.param_bytes / plan.num_devices if l.model_parallel else l.param_bytes
        params += local
        acts += max(0.0, l.memory_bytes - local * (2 + factor))
    out = []
    for d, total in enumerate(plan.predicted.memory_bytes):
        other = max(0.0, total - params * (2 + factor) - acts)
        out.append(DeviceMemory(d, params, params, params * factor, acts, other))
    return out


def memory_chart(plan: Plan):
    """A stacked bar per device (parameters, gradients, optimizer state, activations) under
    the memory limit."""
    plt = _pyplot()
    rows = memory_by_device(plan)
    scale, unit = (1e9, "GB") if plan.predicted.memory_limit_bytes >= 1e9 else (1e6, "MB")
    fig, ax = plt.subplots(figsize=(max(5, 1.0 + 0.7 * len(rows)), 4.5))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for kind, color in MEMORY_COLORS.items():
        values = [getattr(r, kind) / scale for r in rows]
        if not any(values):
            continue
        ax.bar(x, values, bottom=bottom, color=color, label=MEMORY_LABELS.get(kind, kind),
               width=0.7)
        bottom = [b + v for b, v in zip(bottom, values)]
    limit = plan.predicted.memory_limit_bytes / scale
    ax.axhline(limit, color="black", linestyle="--", linewidth=1)
    ax.text(x[-1] + 0.4, limit, f"limit {limit:.1f} {unit}", va="bottom", ha="right", fontsize=8)
    ax.set_ylim(0, max(limit, max(bottom)) * 1.12)
    ax.set_xticks(x, [r.label for r in rows], fontsize=8)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_xlim(-0.6, len(rows) - 0.4)
    ax.set_title(f"{plan.model} on {plan.cluster.describe()}: memory per device", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncols=3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# --- the pipeline schedule ----------------------------------------------------------------

@dataclass(frozen=True)
class PipelineTimeline:
    """What a schedule needs to be drawn: per global stage, one microbatch's forward and
    backward compute, the communication each adds (its collectives and point-to-point
    sends), and after the last backward, per pipeline rank, the gradient synchronisation
    and the update. One stage and one microbatch is a plan without pipelining.

    `schedule` is a planner.pipeline.schedules name (GPipe, 1F1B, Interleaved1F1B, ...; "gpipe" and
    "1f1b" too) and `chunks` its stages per rank: the rows are the pp = stages / chunks
    ranks, and the times come from planner.pipeline.schedules.simulate, the simulation the planner
    prices a plan with, so the drawn bubble is the priced one. A split backward (I and W)
    takes half the backward each."""

    schedule: str
    microbatches: int
    forward_s: list[float]
    backward_s: list[float]
    send_s: float = 0.0  # per hop between ranks (the planner counts transfers in the stages)
    sync_s: list[float] | None = None  # per rank
    update_s: list[float] | None = None  # per rank
    devices: list[str] | None = None  # a label per rank, e.g. "devices 0-3"
    forward_comm_s: list[float] | None = None
    backward_comm_s: list[float] | None = None
    chunks: int = 1
    planned_bubble_s: float | None = None  # the plan's Predicted.bubble_s, for the title

    @property
    def stages(self) -> int:
        """Rows: the pipeline ranks."""
        return len(self.forward_s) // self.chunks

    @property
    def name(self) -> str:
        return {"gpipe": "GPipe", "1f1b": "1F1B"}.get(self.schedule, self.schedule)

    def duration(self, kind: str, stage: int) -> tuple[float, float]:
        """(compute, communication) of one microbatch's forward or backward on global
        stage `stage`."""
        comp = (self.forward_s if kind == "forward" else self.backward_s)[stage]
        comm = self.forward_comm_s if kind == "forward" else self.backward_comm_s
        return comp, (comm[stage] if comm else 0.0)


@dataclass(frozen=True)
class Action:
    stage: int  # the row: pipeline rank
    kind: Literal["forward", "backward", "communication", "update"]
    microbatch: int | None
    start_s: float
    end_s: float
    part: str = ""  # F, B, I or W (the schedule's action), "" for sync and update
    chunk: int | None = None  # the global stage


def stage_order(schedule: str, stages: int, microbatches: int, stage: int):
    """The (kind, microbatch) order one stage of GPipe or 1F1B runs (planner.pipeline.schedules)."""
    from planner.pipeline.schedules import actions

    name = {"gpipe": "GPipe", "1f1b": "1F1B"}.get(schedule, schedule)
    kinds = {"F": "forward", "B": "backward"}
    return [(kinds[a.kind], a.microbatch) for a in actions(name, stages, 1, microbatches)[stage]]


def simulate(t: PipelineTimeline) -> list[Action]:
    """Start and end of every action, from planner.pipeline.schedules.simulate. A forward or
    backward with communication is two actions, compute then communication, with the same
    microbatch; after its last action each rank synchronises gradients and updates."""
    from planner.pipeline.schedules import SCHEDULES, simulate as run

    if t.name not in SCHEDULES:
        raise ValueError(f"schedule: {t.schedule!r} is not one of {SCHEDULES}")
    S, pp = len(t.forward_s), t.stages
    fwd = [sum(t.duration("forward", k)) for k in range(S)]
    half = [sum(t.duration("backward", k)) / 2 for k in range(S)]
    sim = run(t.name, pp, t.chunks, t.microbatches, fwd, half, half, t.send_s)
    out = []
    for a in sim.actions:
        kind = "forward" if a.kind == "F" else "backward"
        comp, comm = t.duration(kind, a.stage)
        share = comp / (comp + comm) if comp + comm > 0 else 1.0
        split = a.start_s + share * (a.end_s - a.start_s)
        out.append(Action(a.rank, kind, a.microbatch, a.start_s, split, a.kind, a.stage))
        if split < a.end_s:
            out.append(Action(a.rank, "communication", a.microbatch, split, a.end_s, a.kind,
                              a.stage))
    free = [max((a.end_s for a in sim.actions if a.rank == r), default=0.0) for r in range(pp)]
    for r in range(pp):
        for kind, times in (("communication", t.sync_s), ("update", t.update_s)):
            if times and times[r] > 0:
                out.append(Action(r, kind, None, free[r], free[r] + times[r]))
                free[r] += times[r]
    return out


def bubble_s(t: PipelineTimeline, actions: list[Action] | None = None) -> float:
    """The pipeline bubble: the idle time, until the last microbatch action ends, of the
    busiest rank (the others idle longer: they also wait for it). The planner's
    Predicted.bubble_s is this number from the same simulation."""
    actions = actions if actions is not None else simulate(t)
    work = [a for a in actions if a.microbatch is not None]
    end = max(a.end_s for a in work)
    busy = [sum(a.end_s - a.start_s for a in work if a.stage == r) for r in range(t.stages)]
    return end - max(busy)


def _span(ranks: list[int]) -> str:
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"devices {ranks[0]}-{ranks[-1]}"
    return "devices " + ", ".join(map(str, ranks)) if len(ranks) > 1 else f"device {ranks[0]}"


def timeline_from_plan(plan: Plan) -> PipelineTimeline:
    """The adapter from a Plan. With pipeline stages: a row per stage, each microbatch's
    forward and backward from the stage's predicted microbatch time (its layers' compute
    split forward:backward as 1:2, since a backward computes two products per forward one,
    the rest communication, split alike), gradient sync and update once per step, as the
    schedule runs them, which is how the planner prices it: the drawn bubble is the plan's. Without: every
    layer on every device, one row, one microbatch."""
    if plan.pipeline is not None:
        return _pipelined(plan)
    compute = sum(l.compute_s + l.reshard_in_s for l in plan.layers)
    own = sum(l.communication_s for l in plan.layers)
    update = sum(l.update_s for l in plan.layers)
    n = plan.num_devices
    return PipelineTimeline("gpipe", 1, [compute / 3], [2 * compute / 3], 0.0, [own], [update],
                            [f"devices 0-{n - 1}" if n > 1 else "device 0"])


def _pipelined(plan: Plan) -> PipelineTimeline:
    """Per global stage, the planner's microbatch time split as planner.pipeline.schedules.price
    splits it (the forward its measured share, PipelinePlan.forward_share; the backward
    the rest), compute and communication alike. A stage's compute is the plan's own
    (StagePlan.compute_s: with a zero-bubble schedule's split backward and the prologue a
    later stage reruns); plans saved without it sum their layers'."""
    pipe, m = plan.pipeline, plan.pipeline.microbatches
    S = len(pipe.stages)
    pp = S // pipe.chunks
    rank = [st.pipeline_rank if st.pipeline_rank is not None else st.index
            for st in pipe.stages]
    compute = [0.0] * S
    update = [0.0] * pp
    for l in plan.layers:
        compute[l.stage] += l.compute_s / m
        update[rank[l.stage]] += l.update_s
    compute = [min(c if st.compute_s is None else st.compute_s, st.microbatch_s)
               for c, st in zip(compute, pipe.stages)]
    comm = [st.microbatch_s - c for st, c in zip(pipe.stages, compute)]
    once = [0.0] * pp
    labels = [""] * pp
    for st, r in zip(pipe.stages, rank):
        once[r] += st.step_s
        labels[r] = _span(st.ranks)
    f = pipe.forward_share
    return PipelineTimeline(
        pipe.schedule, m,
        forward_s=[c * f for c in compute], backward_s=[c * (1 - f) for c in compute],
        forward_comm_s=[c * f for c in comm], backward_comm_s=[c * (1 - f) for c in comm],
        sync_s=[max(0.0, o - u) for o, u in zip(once, update)], update_s=update,
        devices=labels, chunks=pipe.chunks, planned_bubble_s=plan.predicted.bubble_s)


def timeline_chart(t: PipelineTimeline, title: str = ""):
    """Gantt chart, a row per stage: forward and backward per microbatch (numbered), the
    communication each carries, gradient synchronisation, update; idle time is hatched
    (the pipeline bubble, and waits for a slower stage)."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    actions = simulate(t)
    end = max(a.end_s for a in actions)
    height = 2.1 + 0.6 * t.stages
    fig, ax = plt.subplots(figsize=(11, height))
    for s in range(t.stages):
        ax.broken_barh([(0, _ms(end))], (s - 0.4, 0.8), facecolors="#FBFBFB",
                       edgecolor="#EBA0A0", hatch="//", linewidth=0)
    slots = max(1, 2 * t.microbatches)  # label microbatches only where there is room
    for a in actions:
        ax.broken_barh([(_ms(a.start_s), _ms(a.end_s - a.start_s))], (a.stage - 0.4, 0.8),
                       facecolors=ACTION_COLORS[a.kind], edgecolor="white",
                       linewidth=0.5 if slots <= 64 else 0)
        width = _ms(a.end_s - a.start_s)
        if (a.microbatch is not None and a.kind != "communication"
                and width > _ms(end) / 45 and slots <= 64):
            ax.text(_ms(a.start_s) + width / 2, a.stage, str(a.microbatch), ha="center",
                    va="center", color="white", fontsize=7)
    labels = t.devices or [f"stage {s}" for s in range(t.stages)]
    ax.set_yticks(range(t.stages), [f"stage {s}\n{labels[s]}" if t.devices else labels[s]
                                    for s in range(t.stages)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, _ms(end) * 1.01)
    ax.set_xlabel("time in one training step (ms)")
    if t.stages == 1 and t.microbatches == 1:
        what = "no pipeline (every layer on every device, one microbatch)"
    else:
        bubble = bubble_s(t, actions)
        from planner.pipeline.schedules import LABELS

        chunks = f" x {t.chunks} chunks" if t.chunks > 1 else ""
        what = (f"{LABELS[t.name]} schedule, {t.stages} ranks{chunks} x {t.microbatches} "
                f"microbatches: bubble {_ms(bubble):.1f} ms ({bubble / end:.0%} of the step)")
        if t.planned_bubble_s is not None:
            what += f", plan {_ms(t.planned_bubble_s):.1f} ms"
    ax.set_title((title + "\n" if title else "") + f"{what}; step {_ms(end):.1f} ms",
                 fontsize=10)
    handles = [Patch(color=c, label=ACTION_LABELS.get(k, k)) for k, c in ACTION_COLORS.items()]
    handles.append(Patch(facecolor="#FBFBFB", edgecolor="#EBA0A0", hatch="//",
                         label="idle (bubble)"))
    fig.legend(handles=handles, fontsize=8, frameon=False, ncols=3, loc="lower center")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout(rect=(0, 0.45 / height, 1, 1))  # room below the axis for the legend
    return fig


# --- files --------------------------------------------------------------------------------

def write_plots(plan: Plan, directory: str | Path, formats=("png", "svg")) -> list[Path]:
    """Write strategy_map, memory and timeline pictures of `plan` into `directory`."""
    plt = _pyplot()
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    figures = {"strategy_map": strategy_map(plan), "memory": memory_chart(plan),
               "timeline": timeline_chart(timeline_from_plan(plan),
                                          f"{plan.model} on {plan.cluster.describe()}")}
    written = []
    for name, fig in figures.items():
        for fmt in formats:
            path = directory / f"{name}.{fmt}"
            fig.savefig(path, dpi=130 if fmt == "png" else None, bbox_inches="tight")
            written.append(path)
        plt.close(fig)
    return written
