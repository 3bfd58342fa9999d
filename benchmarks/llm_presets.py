"""Llama 3 70 B and 405 B presets planned on 32 and 64 nodes of 8 H100 by the 3-D search,
with torchtitan's configuration, FSDP over the nodes x tensor parallel 8 inside each node,
priced beside it by the same price list (planner.price).

    PYTHONPATH=$PWD python benchmarks/llm_presets.py [--cases 70b,405b] [--compare-trace]
        [--search-time SECONDS|prove]

Per case:
- tracing: three blocks traced with torch.export and repeated to all of them
  (`tracer="blocks"`, profiler.repeat_blocks), timed; with --compare-trace also the whole
  model by torch.export, and whether the two graphs are equal;
- planning: `planner.optimize(model, devices, mesh="auto", tracer="blocks")` end to end
  (trace, FLOPs, the 1-D integer program, the 3-D search over pp x dp x tp, stage cuts,
  microbatches, schedules and the levers: fsdp / hsdp per layer, whole-block recompute),
  its wall time and the CPU seconds of this process (the machine may be shared: CPU
  seconds are what the planning itself cost), and the machine's load average beside
  them; by default within planner.optimize's default budget (search_time_s,
  planner.search.DEFAULT_SEARCH_TIME_S: "optimal", or "feasible" with its gap and why),
  --search-time SECONDS another, 'prove' until the optimum is proven;
- the plan: mesh, schedule and microbatches, the levers its layers use, predicted step
  time, tokens/s per GPU and MFU, memory per device, solver status and gap;
- torchtitan's configuration (planner.baseline "fsdp_tp" at tp 8): one stage, dp over the
  nodes x tp 8 inside each node, every layer FSDP2 can shard fully sharded over dp; the
  search picks each layer's tp strategy, the microbatches and whole-block recompute within
  device memory; where nothing fits, what it needs, and its price with memory unbounded.

Global batches: 70 B, 256 sequences of 8192 (torchtitan's llama3_70b.toml: local batch 8
per FSDP rank x 32 FSDP ranks with TP 8 on 256 GPUs, 2 M tokens); 405 B, 512 sequences of
8192 (4 M tokens, the Llama 3 paper's first pre-training stage by tokens).
"""

from __future__ import annotations

import argparse
import os
import time
from collections import Counter
from dataclasses import dataclass

import planner
from planner.plan import EVERY_BLOCK
from planner.baseline import fsdp_tp
from planner.cli.plan import parse_search_time
from planner.search import DEFAULT_SEARCH_TIME_S
from planner.profiled import profiled_graph, trace_model
from planner.report.throughput import plan_throughput
from profiler.presets import load_llm

GB = 1e9
UNBOUNDED_BYTES = 1e15  # "memory unbounded": price a configuration that does not fit


@dataclass(frozen=True)
class Case:
    key: str
    preset: str
    devices: str
    seq: int
    batch: int  # global, in sequences
    tp: int = 8  # torchtitan's tensor-parallel degree (one node)


CASES = {
    "70b": Case("70b", "llama3-70b", "32x8xH100", 8192, 256),
    "405b": Case("405b", "llama3-405b", "64x8xH100", 8192, 512),
}


def timed(fn):
    """(fn()'s result or its PlanDoesNotFit, wall seconds, CPU seconds of this process)."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        out = fn()
    except planner.PlanDoesNotFit as error:
        out = error
    return out, time.perf_counter() - wall, time.process_time() - cpu


def describe_plan(plan, shape, seq: int) -> list[str]:
    """The plan in the figures an LLM trainer reads: mesh, schedule, levers, speed, memory,
    and how sure the solver is."""
    dims = " x ".join(f"{n} {s}" for n, s in zip(plan.mesh.dim_names, plan.mesh.shape))
    lines = [f"mesh: {dims} ({plan.mesh.nodes} nodes x {plan.mesh.devices_per_node}); "
             f"{plan.mesh_choice or '3-D'}"]
    if plan.pipeline is not None:
        p = plan.pipeline
        lines.append(f"pipeline: {p.schedule}, {len(p.stages)} stages, {p.chunks} virtual "
                     f"stage(s) per rank, {p.microbatches} microbatches of {p.microbatch_rows} "
                     f"sequences, bubble {p.bubble_fraction:.1%}")
    else:
        lines.append(f"pipeline: none (one stage); {plan.microbatches} microbatch(es) per step")
    weighted = [l for l in plan.layers if l.param_bytes]
    fsdp = sum(l.dp_shard and not l.hsdp for l in weighted)
    hsdp = sum(l.hsdp for l in weighted)
    kinds = Counter(l.strategy for l in weighted)
    lines.append(f"weighted layers ({len(weighted)}): " + ", ".join(
        f"{k} {n}" for k, n in kinds.most_common()))
    lines.append(f"levers: +fsdp on {fsdp}, +hsdp on {hsdp}, replicated over dp on "
                 f"{len(weighted) - fsdp - hsdp}; whole-block recompute: "
                 f"{_recomputed(plan, shape.layers)}; precision {plan.precision}")
    p = plan.predicted
    t = plan_throughput(plan, shape, seq)
    fits = max(p.memory_bytes) <= p.memory_limit_bytes
    lines.append(f"predicted step {p.step_time_s:.3f} s (compute {p.compute_s:.3f}, "
                 f"communication {p.communication_s:.3f}, bubble {p.bubble_s:.3f}); "
                 f"memory {max(p.memory_bytes) / GB:.1f} of {p.memory_limit_bytes / GB:.1f} GB "
                 f"per device ({'fits' if fits else 'does not fit'})")
    lines.append(f"throughput: {t.tokens_per_s_per_device:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}")
    s = plan.solver
    lines.append(f"solver: {s.status} ({s.backend}), gap {s.gap:.2%}, objective "
                 f"{s.objective_s:.4f} s, bound {s.bound_s:.4f} s, {s.seconds:.1f} s solving"
                 + (f"; {s.note}" if s.note else ""))
    if plan.search is not None:
        lines.append(f"search: {plan.search.candidates} candidates, {plan.search.solved} "
                     f"solved, {plan.search.pruned} pruned or dropped unsolved")
    return lines


def price_fsdp_tp(case: Case, model, inputs, kwargs, shape, seq: int) -> list[str]:
    """torchtitan's FSDP x TP 8, the best of its kind within device memory (else what it
    needs, and its price with memory unbounded)."""
    graph, cluster = profiled_graph(model, case.devices, inputs, kwargs, tracer="blocks")
    budget = cluster.device.memory_bytes
    plan, wall, cpu = timed(lambda: fsdp_tp(graph, cluster, "adam", budget,
                                            time.perf_counter(), tp=case.tp))
    lines = [f"priced in {wall:.1f} s wall, {cpu:.1f} s CPU"]
    if isinstance(plan, Exception):
        lines.append(f"within {budget / GB:.1f} GB: none: {plan}")
        plan, wall, cpu = timed(lambda: fsdp_tp(graph, cluster, "adam", UNBOUNDED_BYTES,
                                                time.perf_counter(), tp=case.tp))
        lines.append(f"with memory unbounded (priced in {wall:.1f} s):")
    lines += describe_plan(plan, shape, seq)[:-1]  # no search line: its shapes are fixed
    return lines


def _recomputed(plan, blocks: int) -> str:
    """How many of the model's blocks the plan checkpoints."""
    chosen = plan.recompute_blocks
    count = blocks if EVERY_BLOCK in chosen else len(chosen)
    return f"{count} of {blocks} blocks"


def run(case: Case, compare_trace: bool,
        search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> None:
    print(f"== {case.preset} on {case.devices}, seq {case.seq}, global batch {case.batch} "
          f"sequences ({case.batch * case.seq / 1e6:.1f} M tokens), adam, bf16-mixed ==")
    (model, inputs, kwargs, shape, seq), build_s, _ = timed(
        lambda: load_llm(case.preset, case.batch, case.seq))
    print(f"model: {shape.params / 1e9:.1f} B parameters, {shape.layers} blocks, built on "
          f"meta in {build_s:.1f} s")
    blocks, trace_s, _ = timed(lambda: trace_model(model, inputs, kwargs, tracer="blocks"))
    print(f"trace (3 blocks repeated): {trace_s:.1f} s, {len(blocks.layers)} layers")
    if compare_trace:
        whole, whole_s, _ = timed(lambda: trace_model(model, inputs, kwargs, tracer="export"))
        print(f"trace (torch.export whole): {whole_s:.1f} s, {len(whole.layers)} layers; "
              f"graphs equal: {whole == blocks}")
        del whole
    plan, wall, cpu = timed(lambda: planner.optimize(
        model, case.devices, example_inputs=inputs, example_kwargs=kwargs, mesh="auto",
        tracer="blocks", search_time_s=search_time_s))
    budget = ("search_time_s=None (prove)" if search_time_s is None else
              f"search_time_s={search_time_s:g}"
              + (" (the default)" if search_time_s == DEFAULT_SEARCH_TIME_S else ""))
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"planning (optimize, mesh='auto', tracer='blocks', {budget}): {wall:.1f} s wall, "
          f"{cpu:.1f} s CPU; load average {load}")
    if isinstance(plan, Exception):
        print(f"hyplan's plan: none: {plan}")
    else:
        print("hyplan's plan:")
        print("\n".join("  " + line for line in describe_plan(plan, shape, seq)))
    replicas = int(case.devices.split("x")[0])
    print(f"beside it, torchtitan's FSDP {replicas} x TP {case.tp} (baseline 'fsdp_tp', "
          f"same price list):")
    print("\n".join("  " + line for line in price_fsdp_tp(case, model, inputs, kwargs,
                                                          shape, seq)))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="70b,405b", help="comma-separated: 70b, 405b")
    parser.add_argument("--compare-trace", action="store_true",
                        help="also trace the whole model with torch.export (slow) and "
                             "compare the graphs")
    parser.add_argument("--search-time", type=parse_search_time, default=DEFAULT_SEARCH_TIME_S,
                        metavar="SECONDS|prove",
                        help=f"planner.optimize's search_time_s (default "
                             f"{DEFAULT_SEARCH_TIME_S:g}, its default; 'prove': no limit)")
    args = parser.parse_args()
    for key in args.cases.split(","):
        run(CASES[key], compare_trace=args.compare_trace, search_time_s=args.search_time)


if __name__ == "__main__":
    main()
