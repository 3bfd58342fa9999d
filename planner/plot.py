"""Pictures of a plan (matplotlib, Agg): the strategy map, memory per device by kind, and
the pipeline schedule as a timeline per device.

Each picture is drawn from a small typed description (`LayerBar`, `DeviceMemory`,
`PipelineTimeline`), and each description is read from a Plan by one adapter function
(`layer_bars`, `memory_by_device`, `timeline_from_plan`). Plans that carry pipeline
stages and a memory breakdown change only the adapters.

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
    "feature_parallel": "#8172B3",
}
KIND_COLORS = {"compute": None, "communication": "#2F2F2F", "reshard": "#A0A0A0",
               "update": "#55A868"}
MEMORY_COLORS = {"parameters": "#4C72B0", "gradients": "#DD8452", "optimizer": "#55A868",
                 "activations": "#C44E52", "other": "#BBBBBB"}
MEMORY_LABELS = {"optimizer": "optimizer state", "other": "inputs and other"}
ACTION_COLORS = {"forward": "#4C72B0", "backward": "#DD8452", "communication": "#2F2F2F",
                 "update": "#55A868"}
ACTION_LABELS = {"communication": "gradient sync", "update": "optimizer update"}


def _pyplot():
    import matplotlib

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


def memory_by_device(plan: Plan) -> list[DeviceMemory]:
    """Bytes per device by kind. Today's plans give one total per device and per layer; the
    split follows the cost model (strategies.catalog: weights, as many gradient bytes, the
    optimizer's state factor times the weights, the rest activations)."""
    from strategies.catalog import OPTIMIZER_STATE_FACTOR

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
    x = [r.device for r in rows]
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
    ax.set_xticks(x, [f"dev {d}" for d in x], fontsize=8)
    ax.set_ylabel(f"memory per device ({unit})")
    ax.set_title(f"{plan.model} on {plan.cluster.describe()}: memory per device", fontsize=10)
    ax.legend(fontsize=8, frameon=False, loc="upper left", ncols=3)
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout()
    return fig


# --- the pipeline schedule ----------------------------------------------------------------

@dataclass(frozen=True)
class PipelineTimeline:
    """What a schedule needs to be drawn: per stage, one microbatch's forward and backward
    time, the send to the next stage, and after the last backward the gradient
    synchronisation and the update. One stage and one microbatch is a plan without
    pipelining."""

    schedule: Literal["gpipe", "1f1b"]
    microbatches: int
    forward_s: list[float]
    backward_s: list[float]
    send_s: float = 0.0
    sync_s: list[float] | None = None
    update_s: list[float] | None = None
    devices: list[str] | None = None  # a label per stage, e.g. "devices 0-3"

    @property
    def stages(self) -> int:
        return len(self.forward_s)


@dataclass(frozen=True)
class Action:
    stage: int
    kind: Literal["forward", "backward", "communication", "update"]
    microbatch: int | None
    start_s: float
    end_s: float


def stage_order(schedule: str, stages: int, microbatches: int, stage: int):
    """The (kind, microbatch) order one stage runs: GPipe does every forward, then every
    backward; 1F1B warms up with `stages - stage - 1` forwards, then alternates."""
    if schedule == "gpipe":
        return ([("forward", i) for i in range(microbatches)]
                + [("backward", i) for i in range(microbatches)])
    warmup = min(stages - stage - 1, microbatches)
    order = [("forward", i) for i in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("forward", warmup + i), ("backward", i)]
    order += [("backward", i) for i in range(microbatches - warmup, microbatches)]
    return order


def simulate(t: PipelineTimeline) -> list[Action]:
    """Start and end of every action: each waits for its stage to be free and for its input
    (the previous stage's forward, or the next stage's backward, plus the send)."""
    if t.schedule not in ("gpipe", "1f1b"):
        raise ValueError(f"schedule: {t.schedule!r} is not gpipe or 1f1b")
    p, m = t.stages, t.microbatches
    orders = [stage_order(t.schedule, p, m, s) for s in range(p)]
    done: dict[tuple[str, int, int], float] = {}
    free, nxt, actions = [0.0] * p, [0] * p, []
    while any(nxt[s] < len(orders[s]) for s in range(p)):
        progressed = False
        for s in range(p):
            if nxt[s] >= len(orders[s]):
                continue
            kind, i = orders[s][nxt[s]]
            dep = (("forward", s - 1, i) if kind == "forward" and s > 0 else
                   ("backward", s + 1, i) if kind == "backward" and s < p - 1 else None)
            if dep is not None and dep not in done:
                continue
            ready = done[dep] + t.send_s if dep else 0.0
            if kind == "backward":
                ready = max(ready, done[("forward", s, i)])
            start = max(free[s], ready)
            end = start + (t.forward_s[s] if kind == "forward" else t.backward_s[s])
            done[(kind, s, i)] = free[s] = end
            actions.append(Action(s, kind, i, start, end))
            nxt[s] += 1
            progressed = True
        assert progressed, "schedule deadlocked"
    for s in range(p):
        for kind, times in (("communication", t.sync_s), ("update", t.update_s)):
            if times and times[s] > 0:
                actions.append(Action(s, kind, None, free[s], free[s] + times[s]))
                free[s] += times[s]
    return actions


def timeline_from_plan(plan: Plan) -> PipelineTimeline:
    """The adapter from a Plan. A plan with pipeline stages would give one entry per stage;
    today's plans run every layer on every device: one stage, one microbatch, its compute
    split forward:backward as 1:2 (a backward computes two products per forward one)."""
    compute = sum(l.compute_s + l.reshard_in_s for l in plan.layers)
    own = sum(l.communication_s for l in plan.layers)
    update = sum(l.update_s for l in plan.layers)
    n = plan.num_devices
    return PipelineTimeline("gpipe", 1, [compute / 3], [2 * compute / 3], 0.0, [own], [update],
                            [f"devices 0-{n - 1}" if n > 1 else "device 0"])


def timeline_chart(t: PipelineTimeline, title: str = ""):
    """Gantt chart, a row per stage: forward and backward per microbatch (numbered),
    gradient synchronisation, update; the idle time inside the step is the bubble."""
    plt = _pyplot()
    from matplotlib.patches import Patch

    actions = simulate(t)
    end = max(a.end_s for a in actions)
    height = 1.9 + 0.6 * t.stages
    fig, ax = plt.subplots(figsize=(11, height))
    idle_total = 0.0
    for s in range(t.stages):
        busy = sorted((a.start_s, a.end_s) for a in actions if a.stage == s)
        ax.broken_barh([(0, _ms(end))], (s - 0.4, 0.8), facecolors="#FBFBFB",
                       edgecolor="#EBA0A0", hatch="//", linewidth=0)
        idle_total += end - sum(b - a for a, b in busy)
    for a in actions:
        ax.broken_barh([(_ms(a.start_s), _ms(a.end_s - a.start_s))], (a.stage - 0.4, 0.8),
                       facecolors=ACTION_COLORS[a.kind], edgecolor="white", linewidth=0.5)
        width = _ms(a.end_s - a.start_s)
        if a.microbatch is not None and width > _ms(end) / 60:
            ax.text(_ms(a.start_s) + width / 2, a.stage, str(a.microbatch), ha="center",
                    va="center", color="white", fontsize=7)
    labels = t.devices or [f"stage {s}" for s in range(t.stages)]
    ax.set_yticks(range(t.stages), [f"stage {s}\n{labels[s]}" if t.devices else labels[s]
                                    for s in range(t.stages)], fontsize=8)
    ax.invert_yaxis()
    ax.set_xlim(0, _ms(end) * 1.01)
    ax.set_xlabel("time in one training step (ms)")
    bubble = idle_total / (end * t.stages)
    what = ("no pipeline (every layer on every device, one microbatch)"
            if t.stages == 1 and t.microbatches == 1 else
            f"{t.schedule.upper()} schedule, {t.stages} stages x {t.microbatches} microbatches")
    ax.set_title((title + "\n" if title else "") + f"{what}: step {_ms(end):.1f} ms, "
                 f"bubble {bubble:.0%}", fontsize=10)
    handles = [Patch(color=c, label=ACTION_LABELS.get(k, k)) for k, c in ACTION_COLORS.items()]
    handles.append(Patch(facecolor="#FBFBFB", edgecolor="#EBA0A0", hatch="//",
                         label="bubble (idle)"))
    fig.legend(handles=handles, fontsize=8, frameon=False, ncols=5, loc="lower center")
    ax.spines[["top", "right"]].set_visible(False)
    fig.tight_layout(rect=(0, 0.3 / height, 1, 1))  # room below the axis for the legend
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
