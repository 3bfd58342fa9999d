"""torchtitan's published Llama 3 jobs, imported from their own TOML, priced by hyplan, and
hyplan's own plan for each job beside them, exported back to TOML and Megatron-LM args.

    PYTHONPATH=$PWD python benchmarks/torchtitan_jobs.py [--jobs 8b-8,8b-128,70b,405b-1f1b,405b-int]

Each job is the job file torchtitan ran (benchmarks/jobs/, copied verbatim from
pytorch/torchtitan at the commit the benchmark names) with the overrides its command line
gave, read by planner.export.read_torchtitan and priced by planner.price_job (the 3-D
search restricted to the job's shape, FSDP pinned, the same price list as hyplan's own
plans), with the kernel levers the job turns priced (planner.price_job.job_levers:
torch.compile, float8, async TP, and torchtitan's sequence-parallel TP where tp > 1).

Sources (pytorch/torchtitan):
- 8B on 8 and 128 H100, FSDP, local batch 2, seq 8192, selective (op) AC:
  benchmarks/llama3_h100_202412_torchtitan.md (commit 31a17bf), tables 1 and 3: eager
  5,762 and 5,605 tokens/s/GPU, torch.compile 6,667 and 6,514, compile + float8 8,532 and
  8,380; job file train_configs/llama3_8b.toml at 9dec370 (the table's torchtitan
  version), `--training.batch_size 2`, compile and float8 as overrides.
- 70B on 256 H100, FSDP 32 x TP 8, local batch 16, full AC, bf16, torch.compile:
  benchmarks/asyncTP_llama3_h100_2025-06_torchtitan.md, table "Llama3 70b on 256 H100s
  with FSDP=32, TP=8, torch.compile, full AC, local batch size 16": bfloat16 597.3
  (vanilla TP) and 652.4 (async TP), float8 tensorwise 809.8 and 942.4; job file
  torchtitan/models/llama3/train_configs/llama3_70b.toml at 820504e (that file's
  torchtitan version) with the table's settings as overrides.
- 405B on 512 H100, FSDP 8 x TP 8 x PP 8, local batch 32 (global 256), full AC, with
  torch.compile + float8 + async TP: llama3_h100_202412_torchtitan.md table 5: 100 (1F1B)
  and 128 (Interleaved 1F1B) tokens/s/GPU; job file train_configs/llama3_405b.toml at
  9dec370 (it enables compile, float8 and async TP itself), pp and schedule as the table.
  Microbatches: that torchtitan's default (9dec370 pipelining_utils.py: n_microbatches =
  pipeline_parallel_degree, 8 of 4 rows, for both schedules; interleaved runs 2 stages per
  rank, generate_split_points' default); the table does not say.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass, field, replace
from pathlib import Path

import planner
from planner.export import express, read_torchtitan, to_megatron, to_torchtitan
from profiler.presets import load_llm

JOBS_DIR = Path(__file__).parent / "jobs"


@dataclass(frozen=True)
class Job:
    key: str
    preset: str
    devices: str
    file: str
    overrides: dict = field(default_factory=dict)
    published: float = 0.0  # tokens/s/GPU
    levers: str = ""  # what the published run turned on beyond eager ("" : eager)
    source: str = ""


JOBS = {j.key: j for j in [
    *[Job(key, "llama3-8b", devices, "llama3_8b_9dec370.toml",
          {"training.batch_size": 2, **extra}, published, levers,
          f"llama3_h100_202412_torchtitan.md table {table} ({row})")
      for devices, table, runs in [("8xH100-96GB", 1, (("8b-8", 5762), ("8b-8-compile", 6667),
                                                         ("8b-8-float8", 8532))),
                                    ("16x8xH100-96GB", 3, (("8b-128", 5605),
                                                           ("8b-128-compile", 6514),
                                                           ("8b-128-float8", 8380)))]
      for (key, published), (extra, levers, row) in zip(runs, [
          ({}, "", "FSDP"),
          ({"training.compile": True}, "compile", "FSDP + torch.compile"),
          ({"training.compile": True, "float8.enable_float8_linear": True},
           "compile + float8", "FSDP + torch.compile + Float8")])],
    *[Job(key, "llama3-70b", "32x8xH100-96GB", "llama3_70b_820504e.toml",
          {"activation_checkpoint.mode": "full", "training.local_batch_size": 16,
           "training.compile": True, **extra}, published, levers,
          f"asyncTP_llama3_h100_2025-06_torchtitan.md, 70b table, {row} ({published})")
      for key, extra, published, levers, row in [
          ("70b", {}, 597.3, "compile", "bfloat16, vanilla TP"),
          ("70b-async", {"parallelism.enable_async_tensor_parallel": True}, 652.4,
           "compile + async TP", "bfloat16, async TP"),
          ("70b-float8", {"model.converters": ["float8"]}, 809.8, "compile + float8",
           "float8 tensorwise, vanilla TP"),
          ("70b-float8-async", {"model.converters": ["float8"],
                                "parallelism.enable_async_tensor_parallel": True}, 942.4,
           "compile + float8 + async TP", "float8 tensorwise, async TP")]],
    Job("405b-1f1b", "llama3-405b", "64x8xH100-96GB", "llama3_405b_9dec370.toml",
        {"training.batch_size": 32, "experimental.pipeline_parallel_degree": 8,
         "experimental.pipeline_parallel_schedule": "1F1B"}, 100,
        "compile + float8 + async TP", "llama3_h100_202412_torchtitan.md table 5, 1F1B"),
    Job("405b-int", "llama3-405b", "64x8xH100-96GB", "llama3_405b_9dec370.toml",
        {"training.batch_size": 32, "experimental.pipeline_parallel_degree": 8,
         "experimental.pipeline_parallel_schedule": "Interleaved1F1B"}, 128,
        "compile + float8 + async TP",
        "llama3_h100_202412_torchtitan.md table 5, Interleaved 1F1B"),
]}


def devices_of(spec: str) -> int:
    count = 1
    for part in spec.split("x")[:-1]:
        count *= int(part)
    return count


def tokens_per_gpu(plan, seq: int) -> float:
    return plan.global_batch * seq / plan.predicted.step_time_s / plan.cluster.num_devices


def fits(plan) -> bool:
    return max(plan.predicted.memory_bytes) <= plan.predicted.memory_limit_bytes


def describe(plan, seq: int, throughput: str = "") -> str:
    """A priced plan in one line: step and its terms, `throughput` (default tokens/s per
    GPU; benchmarks/megatron_jobs.py's adds the paper's TFLOP/s), memory, recompute."""
    p = plan.predicted
    blocks = len(plan.recompute_blocks)
    layers = sum(l.recompute for l in plan.layers)  # a 1-D plan recomputes layer by layer
    throughput = throughput or f"{tokens_per_gpu(plan, seq):,.0f} tokens/s/GPU"
    return (f"step {p.step_time_s:.3f} s (compute {p.compute_s:.3f}, communication "
            f"{p.communication_s:.3f}, bubble {p.bubble_s:.3f}), {throughput}, memory "
            f"{max(p.memory_bytes) / 1e9:.1f} of {p.memory_limit_bytes / 1e9:.1f} GB "
            f"({'fits' if fits(plan) else 'does not fit'}), recompute "
            + (f"{'every' if '*' in plan.recompute_blocks else blocks} block(s)" if blocks
               else f"{layers} layer(s)"))


def price_nearest(config, model, devices: str, inputs, kwargs):
    """(price_job's plan, the job priced): the job itself, or where hyplan does not run
    its microbatches (tensor parallelism on rows tp divides: planner.price_job says so)
    the fewest microbatches it does run, said here."""
    try:
        return planner.price_job(model, devices, config, inputs, kwargs, tracer="blocks"), config
    except ValueError as error:
        print(f"  not as written: {error}")
    local = config.global_batch // config.dp
    for m in range(config.microbatches + 1, local + 1):
        if local % m:
            continue
        nearest = replace(config, microbatches=m)
        try:
            plan = planner.price_job(model, devices, nearest, inputs, kwargs, tracer="blocks")
        except ValueError:
            continue
        print(f"  priced instead: {nearest.describe()} (gradient accumulation: FSDP gathers "
              f"and scatters per microbatch, {m}x the job's)")
        return plan, nearest
    raise ValueError(f"no microbatch count of {config.describe()} runs in hyplan")


def price(job: Job, built, own: dict) -> None:
    """One published job: imported, priced beside its figure; hyplan's plan beside it."""
    model, inputs, kwargs, _, seq = built
    config = read_torchtitan((JOBS_DIR / job.file).read_text(), devices_of(job.devices),
                             overrides=job.overrides)
    print(f"== {job.key}: {job.preset} on {job.devices} ({job.file} + {job.overrides})")
    print(f"  imported: {config.describe()}; global batch {config.global_batch}, seq "
          f"{config.seq_len}, {config.precision}")
    started = time.perf_counter()
    priced, config = price_nearest(config, model, job.devices, inputs, kwargs)
    got = tokens_per_gpu(priced, seq)
    levers = priced.cluster.levers.describe()
    print(f"  priced in {time.perf_counter() - started:.1f} s: {describe(priced, seq)}")
    print(f"  solver: {priced.solver.status}, gap {priced.solver.gap:.2%}; {priced.solver.note}")
    print("  | job | published tokens/s/GPU | hyplan | error | priced with |")
    shown = f"{got:,.0f}" + ("" if fits(priced) else " (does not fit as priced)")
    print(f"  | {job.key} | {job.published:,.0f} ({job.levers or 'eager'}) | {shown} | "
          f"{got / job.published - 1:+.1%} | {levers} |")
    print(f"  source: pytorch/torchtitan benchmarks/{job.source}")
    # hyplan's plan for the same job, priced with the job's kernel levers (the job's
    # cluster), as `hyplan compare --torchtitan` does (planner.report.compare_job): the
    # export hands them back to torchtitan
    key = (job.preset, job.devices, config.global_batch, seq, priced.cluster.levers)
    if key not in own:
        started = time.perf_counter()
        own[key] = planner.optimize(model, priced.cluster, inputs, kwargs, mesh="auto",
                                    tracer="blocks", precision=config.precision)
        print(f"  hyplan's plan (planned in {time.perf_counter() - started:.1f} s):")
    else:
        print("  hyplan's plan (the same job as above):")
    plan = own[key]
    expressed = express(plan)
    # a job that does not fit is no rival in speed: what it needs, never a ratio
    beside = (f"{tokens_per_gpu(plan, seq) / got:.2f}x the job's tokens/s" if fits(priced)
              else "the job does not fit: no ratio")
    print(f"    {expressed.job.describe()}: {describe(plan, seq)}; {beside}; solver "
          f"{plan.solver.status}, gap {plan.solver.gap:.2%}")
    for d in expressed.departures:
        print(f"    departs: {d}")
    print("    torchtitan TOML:")
    print("\n".join("      " + line for line in to_torchtitan(expressed).text.splitlines()
                    if line))
    print(f"    Megatron-LM: {to_megatron(expressed).text}")
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", default=",".join(JOBS), help="comma-separated: "
                        + ", ".join(JOBS))
    args = parser.parse_args()
    own: dict = {}
    models: dict = {}
    for key in args.jobs.split(","):
        job = JOBS[key]
        config = read_torchtitan((JOBS_DIR / job.file).read_text(), devices_of(job.devices),
                                 overrides=job.overrides)
        build = (job.preset, config.global_batch, config.seq_len)
        if build not in models:
            models.clear()  # one big model on meta at a time
            models[build] = load_llm(job.preset, config.global_batch, config.seq_len)
        price(job, models[build], own)


if __name__ == "__main__":
    main()
