"""Llama 3 70 B and 405 B presets planned on 32 and 64 nodes of 8 H100: the plan, its
predicted throughput, how long planning took (before and after tracing three blocks and
repeating them), and the configuration torchtitan runs these models in, priced beside it.

    PYTHONPATH=$PWD python benchmarks/llm_presets.py [--skip-before] [--cases 70b,405b]

Per case:
- tracing: torch.export of the whole model (before, `tracer="export"`) and of three blocks
  repeated to all of them (after, `tracer="blocks"`, profiler.repeat_blocks), each timed,
  and whether the two graphs are equal (layers, names, FLOPs, parameters, edges, shapes);
- planning: `planner.optimize(model, devices, mesh="auto", tracer=...)` timed end to end
  (trace, FLOPs, candidate strategies, integer programs, baselines) with each tracer, and
  whether both give the same plan;
- the plan: mesh, pipeline schedule and virtual stages where it has one, the strategies
  and levers (fsdp, recompute) its layers use, precision, predicted step time, tokens/s per
  GPU and MFU, solver status and gap; or, where nothing fits, what it needs;
- torchtitan's configuration, FSDP over the nodes x tensor parallel 8 inside each node:
  this build has no 2-D FSDP x TP plan to price (issue 12 builds it), so the closest two
  are priced by the same cost model: FSDP over all devices (1-D), and tensor parallel 8 on
  one node at one FSDP replica's share of the batch (the TP half of the 2-D plan: its
  compute and tensor-parallel collectives, but neither FSDP's sharding of weights across
  the nodes nor its collectives).

Global batches: 70 B, 256 sequences of 8192 (torchtitan's llama3_70b.toml: local batch 8
per FSDP rank x 32 FSDP ranks with TP 8 on 256 GPUs, 2 M tokens); 405 B, 512 sequences of
8192 (4 M tokens, the Llama 3 paper's first pre-training stage by tokens; torchtitan's
405 B toml has local batch 2 x 64 FSDP ranks = 128 sequences, which a 1-D plan cannot split
over 512 devices).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass

import planner
from planner.baseline import LABELS, ONE_D_KINDS, available, solve_baseline, summarize
from planner.choices import layer_choices
from planner.profiled import profiled_graph, trace_model
from planner.report.throughput import llm_throughput, plan_throughput
from profiler.presets import load_llm
from strategies.parse import parse_devices
from strategies.memory import split_name

GB = 1e9
LIFTED_BYTES = 10e12


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
    started = time.perf_counter()
    try:
        return fn(), time.perf_counter() - started
    except planner.PlanDoesNotFit as error:
        return error, time.perf_counter() - started


def describe_plan(plan, shape, seq: int) -> list[str]:
    mesh = plan.mesh
    dims = " x ".join(f"{n} {s}" for n, s in zip(mesh.dim_names, mesh.shape))
    lines = [f"mesh: {dims} ({mesh.nodes} nodes x {mesh.devices_per_node}); "
             f"{plan.mesh_choice or '1-D'}"]
    if plan.pipeline is not None:
        p = plan.pipeline
        lines.append(f"pipeline: {p.schedule}, {len(p.stages)} stages, {p.chunks} virtual "
                     f"stage(s) per rank, {p.microbatches} microbatches, bubble "
                     f"{p.bubble_fraction:.1%}")
    else:
        lines.append(f"pipeline: none (one stage); microbatches {plan.microbatches}")
    kinds = Counter(split_name(l.strategy)[0] for l in plan.layers)
    recompute = sum(l.recompute for l in plan.layers)
    fsdp = sum(split_name(l.strategy)[0] == "fsdp" for l in plan.layers)
    lines.append("strategies: " + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))
    lines.append(f"levers: fsdp on {fsdp} layers, recompute on {recompute} layers")
    if plan.standard_choice:
        lines.append(f"standard: {plan.standard_choice}")
    lines.append(f"precision: {plan.precision} (FLOP rates at {plan.cluster.compute_dtype})")
    p = plan.predicted
    t = plan_throughput(plan, shape, seq)
    lines.append(f"predicted step {p.step_time_s:.3f} s (compute {p.compute_s:.3f}, "
                 f"communication {p.communication_s:.3f}, bubble {p.bubble_s:.3f}); "
                 f"memory {max(p.memory_bytes) / GB:.1f} of {p.memory_limit_bytes / GB:.1f} GB")
    lines.append(f"throughput: {t.tokens_per_s_per_device:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}")
    s = plan.solver
    gap = (s.objective_s - s.bound_s) / s.objective_s if s.objective_s else 0.0
    lines.append(f"solver: {s.status} ({s.backend}), gap {gap:.2%}, objective "
                 f"{s.objective_s:.4f} s, bound {s.bound_s:.4f} s, {s.num_variables:,} "
                 f"variables, {s.seconds:.2f} s solving")
    return lines


def price_baselines(case: Case, model, inputs, kwargs, shape, seq: int) -> list[str]:
    """The 1-D baselines on all devices, and tensor parallel on one node at one FSDP
    replica's batch: the closest this build prices to FSDP x TP."""
    lines = []
    cluster = parse_devices(case.devices)
    replicas = cluster.num_devices // case.tp
    graph, cluster = profiled_graph(model, cluster, inputs, kwargs, tracer="blocks")
    budget = cluster.device.memory_bytes
    peak = cluster.device.peak_flops[cluster.compute_dtype]
    for kind in available(ONE_D_KINDS):
        lines.append(_baseline_line(f"{LABELS[kind]} over {cluster.num_devices}",
                                    graph, cluster, kind, budget, case.batch, seq,
                                    cluster.num_devices, shape, peak))
    node = cluster.with_devices(1, case.tp)
    per_replica = case.batch // replicas
    graph, node = profiled_graph(model, node, (inputs[0][:per_replica],), kwargs,
                                 tracer="blocks")
    lines.append(_baseline_line(
        f"tensor parallel {case.tp} on one node at {per_replica} sequences (the TP half of "
        f"FSDP {replicas} x TP {case.tp}; weights not sharded across nodes)",
        graph, node, "tensor", budget, per_replica, seq, case.tp, shape, peak))
    return lines


def _baseline_line(title, graph, cluster, kind, budget, batch, seq, devices, shape, peak):
    started = time.perf_counter()
    choices, solution = solve_baseline(graph, cluster, "adam", kind)
    b = summarize(choices, solution, cluster, budget)
    seconds = time.perf_counter() - started
    if b.fits:
        t = llm_throughput(b.step_time_s, batch, seq, devices, shape, peak)
        speed = f"{t.tokens_per_s_per_device:,.0f} tokens/s/GPU, MFU {t.mfu:.1%}"
    else:
        speed = f"does not fit: needs {b.memory_bytes / GB:.1f} GB of {budget / GB:.1f}"
    return (f"{title}: step {b.step_time_s:.3f} s, memory {b.memory_bytes / GB:.1f} GB; "
            f"{speed} (priced in {seconds:.1f} s)")


def least_memory_bytes(case: Case, model, inputs, kwargs) -> float:
    """The least memory per device any 1-D assignment takes (optimize's does-not-fit
    figure): each layer's smallest option."""
    graph, cluster = profiled_graph(model, case.devices, inputs, kwargs, tracer="blocks")
    choices = layer_choices(graph, cluster, "adam", None)
    return sum(min(c.memory_bytes for c in row.costs) for row in choices.layers)


def _optimize(case: Case, model, inputs, kwargs, memory_limit_bytes: float):
    return planner.optimize(model, case.devices, example_inputs=inputs, example_kwargs=kwargs,
                            mesh="auto", tracer="blocks", memory_limit_bytes=memory_limit_bytes)


def _solver_line(plan, seconds: float) -> str:
    if isinstance(plan, Exception):
        return f"planned in {seconds:.1f} s: {plan}"
    s = plan.solver
    gap = (s.objective_s - s.bound_s) / s.objective_s if s.objective_s else 0.0
    kinds = Counter(split_name(l.strategy)[0] + ("+recompute" if l.recompute else "")
                    for l in plan.layers)
    return (f"planned in {seconds:.1f} s, solver {s.status}, gap {gap:.2%}, "
            f"{s.num_variables:,} variables, {s.seconds:.2f} s solving; "
            + ", ".join(f"{k} {n}" for k, n in kinds.most_common()))


def same_outcome(a, b) -> bool:
    """Both tracers' optimize() results agree: the same strategies, prediction and mesh,
    or the same does-not-fit message."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return type(a) is type(b) and str(a) == str(b)
    return ([(l.name, l.strategy) for l in a.layers] == [(l.name, l.strategy) for l in b.layers]
            and a.predicted.step_time_s == b.predicted.step_time_s and a.mesh == b.mesh)


def run(case: Case, before: bool) -> None:
    print(f"== {case.preset} on {case.devices}, seq {case.seq}, global batch {case.batch} "
          f"sequences ({case.batch * case.seq / 1e6:.1f} M tokens), adam, bf16-mixed ==")
    (model, inputs, kwargs, shape, seq), build_s = timed(
        lambda: load_llm(case.preset, case.batch, case.seq))
    print(f"model: {shape.params / 1e9:.1f} B parameters, {shape.layers} blocks, built on "
          f"meta in {build_s:.1f} s")
    after, after_trace_s = timed(lambda: trace_model(model, inputs, kwargs, tracer="blocks"))
    print(f"trace after  (3 blocks repeated): {after_trace_s:6.1f} s, {len(after.layers)} layers")
    if before:
        whole, before_trace_s = timed(lambda: trace_model(model, inputs, kwargs, tracer="export"))
        print(f"trace before (torch.export whole): {before_trace_s:6.1f} s, "
              f"{len(whole.layers)} layers; graphs equal: {whole == after}")
        del whole
    outcomes = {}
    for tracer in (("export", "blocks") if before else ("blocks",)):
        outcome, seconds = timed(lambda: planner.optimize(
            model, case.devices, example_inputs=inputs, example_kwargs=kwargs, mesh="auto",
            tracer=tracer))
        outcomes[tracer] = outcome
        label = "before" if tracer == "export" else "after "
        what = "does not fit" if isinstance(outcome, Exception) else "planned"
        print(f"planning {label} (optimize, tracer={tracer!r}): {seconds:6.1f} s, {what}")
    if before:
        print(f"same plan from both tracers: {same_outcome(*outcomes.values())}")
    plan = outcomes["blocks"]
    if isinstance(plan, Exception):
        print(f"hyplan's plan: none: {plan}")
        # the solve that fails on memory stops early: time the whole path (every integer
        # program, every baseline) with the limit lifted, and at 1.2x the least memory any
        # assignment takes, where memory binds and the solver has to work; neither is a
        # plan to run on these devices
        lifted, seconds = timed(lambda: _optimize(case, model, inputs, kwargs, LIFTED_BYTES))
        print(f"  timing only, memory limit lifted ({max(lifted.predicted.memory_bytes) / GB:.1f}"
              f" GB taken): {_solver_line(lifted, seconds)}")
        limit = 1.2 * least_memory_bytes(case, model, inputs, kwargs)
        binding, seconds = timed(lambda: _optimize(case, model, inputs, kwargs, limit))
        print(f"  timing only, memory limit {limit / GB:.1f} GB (binds): "
              f"{_solver_line(binding, seconds)}")
    else:
        print("hyplan's plan:")
        print("\n".join("  " + line for line in describe_plan(plan, shape, seq)))
    print("beside it, FSDP x TP as torchtitan runs it: no 2-D FSDP x TP plan in this build "
          "(issue 12); the closest, same cost model:")
    print("\n".join("  " + line for line in price_baselines(case, model, inputs, kwargs,
                                                           shape, seq)))
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="70b,405b", help="comma-separated: 70b, 405b")
    parser.add_argument("--skip-before", action="store_true",
                        help="skip the whole-model torch.export trace and plan (slow)")
    args = parser.parse_args()
    for key in args.cases.split(","):
        run(CASES[key], before=not args.skip_before)


if __name__ == "__main__":
    main()
