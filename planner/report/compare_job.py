"""A user's torchtitan or Megatron-LM configuration beside hyplan's plan for the same job
(`hyplan compare MODEL --torchtitan job.toml`, planner.cli.compare, prints it), and a
plan's nearest expressible configuration beside the plan (`hyplan export`).

Both sides are priced by one price list: the job by planner.price_job (the 3-D search
restricted to the job's shape and choices), hyplan's plan by planner.optimize. What to
change is read off the two JobConfigs (planner.export.express of hyplan's plan), the gain
off the two step times; a configuration that does not fit is never shown as a speed.

    result = compare_job(model, "8xH100", job, inputs, kwargs, tracer="blocks")
    print(advice(result))
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from planner.export import Expressed, JobConfig, express
from planner.optimize import optimize
from planner.plan import Plan
from planner.price_job import price_job
from planner.report.explain import _gb, _ms, does_not_fit
from planner.search import DEFAULT_SEARCH_TIME_S

SAME = 0.005  # step times closer than this fraction are "as fast"
# JobConfig fields a user changes, with the words that name them
LEVERS = (("dp_replicate", "data-parallel replicas"), ("dp_shard", "FSDP shard degree"),
          ("tp", "tensor parallel"), ("pp", "pipeline stages"), ("schedule", "schedule"),
          ("chunks", "stages per rank"), ("microbatches", "microbatches"),
          ("recompute", "activation checkpointing"))


@dataclass(frozen=True)
class JobComparison:
    """The user's job priced (`priced`), hyplan's plan for the same model, batch and
    devices (`chosen`) and its nearest expressible configuration priced (`runnable`,
    None where the plan is expressed exactly)."""

    job: JobConfig
    label: str  # where the job came from ("torchtitan llama3_8b.toml")
    priced: Plan
    chosen: Plan
    expressed: Expressed
    runnable: Plan | None
    seq: int  # tokens per sequence (0: not a sequence model)


def compare_job(model, devices, job: JobConfig, example_inputs: Sequence,
                example_kwargs: dict | None = None, *, label: str = "your configuration",
                optimizer: str = "adam", tracer: str = "auto",
                memory_limit_bytes: float | None = None,
                search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> JobComparison:
    """Price `job` and plan the same model, batch and devices with hyplan (mesh "auto")."""
    kw = {"optimizer": optimizer, "tracer": tracer, "memory_limit_bytes": memory_limit_bytes,
          "search_time_s": search_time_s}
    priced = price_job(model, devices, job, example_inputs, example_kwargs, **kw)
    chosen = optimize(model, priced.cluster, example_inputs, example_kwargs, mesh="auto",
                      precision=job.precision, **kw)
    expressed = express(chosen, seq_len=job.seq_len or None)
    runnable = None
    if not expressed.exact:
        runnable = nearest_price(model, chosen, expressed, example_inputs, example_kwargs,
                                 tracer=tracer, search_time_s=search_time_s)
    return JobComparison(job, label, priced, chosen, expressed, runnable, job.seq_len)


def nearest_price(model, plan: Plan, expressed: Expressed, example_inputs,
                  example_kwargs=None, *, tracer: str = "auto",
                  search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> Plan | None:
    """The price of the configuration the frameworks run nearest to `plan`, or None
    where hyplan cannot price it (a ValueError's reason is then in the caller's hands)."""
    return price_job(model, plan.cluster, expressed.job, example_inputs, example_kwargs,
                     optimizer=plan.optimizer, tracer=tracer,
                     memory_limit_bytes=plan.predicted.memory_limit_bytes,
                     search_time_s=search_time_s)


def fits(plan: Plan) -> bool:
    p = plan.predicted
    return max(p.memory_bytes) <= p.memory_limit_bytes


def speed(plan: Plan, seq: int) -> str:
    """Step time and throughput per device (tokens for a sequence model), or what it needs
    where it does not fit."""
    p = plan.predicted
    if not fits(plan):
        return does_not_fit(max(p.memory_bytes), p.memory_limit_bytes)
    per_device = plan.global_batch / p.step_time_s / plan.cluster.num_devices
    rate = (f"{per_device * seq:,.0f} tokens/s/GPU" if seq
            else f"{per_device:,.{0 if per_device >= 100 else 1}f} samples/s/device")
    return f"step {_ms(p.step_time_s)}, {rate}, {_gb(max(p.memory_bytes))} per device"


def changes(mine: JobConfig, theirs: JobConfig, recompute: bool = True) -> list[str]:
    """What differs from `mine` in `theirs`, lever by lever ("tensor parallel 1 -> 4");
    `recompute`: whether checkpointing is priced for this model (planner.price_job)."""
    out = []
    for field, words in LEVERS:
        a, b = getattr(mine, field), getattr(theirs, field)
        if field in ("schedule", "chunks") and mine.pp == theirs.pp == 1:
            continue
        if field == "recompute" and not recompute:
            continue
        if a != b:
            out.append(f"{words} {a} -> {b}")
    return out


def gain(before: Plan, after: Plan) -> str:
    """How much faster `after` is, in words."""
    ratio = before.predicted.step_time_s / after.predicted.step_time_s
    if abs(ratio - 1) < SAME:
        return "as fast (within 0.5%)"
    return f"{ratio:.2f}x faster" if ratio > 1 else f"{1 / ratio:.2f}x slower"


def advice(c: JobComparison) -> str:
    """One short paragraph: both prices, what to change and the predicted gain."""
    target = c.runnable or c.chosen
    text = (f"{c.label} ({c.job.describe()}): {speed(c.priced, c.seq)}. hyplan's plan "
            f"({c.expressed.job.describe()}): {speed(c.chosen, c.seq)}.")
    if c.runnable is not None:
        text += (f" hyplan's plan chooses per layer where the frameworks choose per model "
                 f"({len(c.expressed.departures)} departure(s), `hyplan export` lists them);"
                 f" the nearest configuration they run: {speed(c.runnable, c.seq)}.")
    if not fits(target) and not fits(c.priced):
        return text + " Neither runs within memory as priced; add devices or lower the batch."
    if not fits(target):
        return text + " Keep yours: hyplan's configuration does not fit."
    if not fits(c.priced):
        return text + f" Yours does not fit; change {_listed(changes(c.job, c.expressed.job))}."
    # a model whose blocks hyplan does not checkpoint: the job's mode was not priced
    priced_recompute = bool(c.priced.recompute_blocks or c.chosen.recompute_blocks)
    moves = changes(c.job, c.expressed.job, priced_recompute)
    verdict = gain(c.priced, target)
    own = (f" hyplan's own per-layer plan, {gain(c.priced, c.chosen)}, runs under hyplan's "
           f"executor." if c.runnable is not None and fits(c.chosen) else "")
    if not moves or verdict.startswith("as fast"):
        return text + " Keep yours: hyplan finds nothing faster to change (within 0.5%)." + own
    if verdict.endswith("slower"):
        return text + f" Keep yours: hyplan's configuration is predicted {verdict}." + own
    return text + f" Change {_listed(moves)}: predicted {verdict}."


def _listed(items: list[str]) -> str:
    return "; ".join(items) if items else "nothing in the degrees (the layers' splits differ)"
