"""One pipelined fidelity case, action by action: each stage's forward and backward as the
planner's schedule simulation prices them, beside what torch.distributed.pipelining's
runtime spent in them on every rank, and where the rest of the step went (waiting for a
transfer, the runtime's own bookkeeping, gradient sync and the update).

A model of benchmarks/fidelity.py is planned as a user plans it (`Nxcpu`, the cached
profile: set HYPLAN_CACHE_DIR to choose one) with the "pipeline" baseline, or read from
--plan FILE; --schedule replaces the plan's schedule (same cut and microbatches). It runs on
N gloo processes: 4 warm-up steps, then 8 timed ones with each stage's forward_one_chunk,
backward_one_chunk and backward_weight_one_chunk, and the runtime's waits for its transfers
(schedules._wait_batch_p2p), timed around the call.

    HYPLAN_CACHE_DIR=DIR python benchmarks/pipeline_terms.py hf_gpt2 [--procs 2]
        [--schedule Interleaved1F1B] [--plan FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import fidelity  # noqa: E402
import planner  # noqa: E402
from planner import schedules  # noqa: E402
from planner.report.plot import timeline_from_plan  # noqa: E402
from profiler.launch import run_ranks  # noqa: E402

WARMUP, STEPS = 4, 8


def _hooked(log: list):
    """Wrap the stage's three compute calls and the runtime's transfer wait so that each
    call appends (kind, stage, microbatch, start, end) to `log`."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from torch.distributed.pipelining import stage as torch_stage

    base = torch_stage._PipelineStageBase

    def wrap(method, kind_of):
        def timed(self, chunk, *args, **kwargs):
            t0 = time.perf_counter()
            out = method(self, chunk, *args, **kwargs)
            log.append((kind_of(args, kwargs), self.stage_index, chunk, t0, time.perf_counter()))
            return out
        return timed

    def backward_kind(args, kwargs):
        full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
        return "B" if full else "I"

    base.forward_one_chunk = wrap(base.forward_one_chunk, lambda a, k: "F")
    base.backward_one_chunk = wrap(base.backward_one_chunk, backward_kind)
    base.backward_weight_one_chunk = wrap(base.backward_weight_one_chunk, lambda a, k: "W")
    wait = torch_schedules._wait_batch_p2p

    def timed_wait(work):
        t0 = time.perf_counter()
        out = wait(work)
        log.append(("wait", -1, -1, t0, time.perf_counter()))
        return out
    torch_schedules._wait_batch_p2p = timed_wait


def _rank(rank: int, world: int, model_key: str, plan_json: str) -> dict:
    log: list = []
    _hooked(log)
    case = fidelity.Case(model_key, plan_json)
    for _ in range(WARMUP):
        case.step()
    steps = []
    for _ in range(STEPS):
        log.clear()
        t0 = time.perf_counter()
        case.step()
        end = time.perf_counter()
        steps.append({"step": end - t0,
                      "actions": [(k, s, i, a - t0, b - t0) for k, s, i, a, b in log]})
    return {"steps": steps}


def _median_step(steps: list[dict]) -> dict:
    return sorted(steps, key=lambda s: s["step"])[len(steps) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(fidelity.MODELS))
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--plan", help="a pipelined plan's JSON (else the pipeline baseline)")
    parser.add_argument("--schedule", help="run the plan under this torch schedule instead")
    args = parser.parse_args()

    if args.plan:
        plan = planner.Plan.from_json(Path(args.plan).read_text())
    else:
        from planner.baseline import baseline

        build, batch = fidelity.MODELS[args.model]
        model, x, _, _ = build(batch)
        plan = baseline(model, f"{args.procs}xcpu", "pipeline", (x,), optimizer="sgd",
                        leaf_modules=fidelity._leaves(args.model))
    if args.schedule:
        plan = plan.model_copy(update={"pipeline": plan.pipeline.model_copy(
            update={"schedule": args.schedule})})
    pipe = plan.pipeline
    t = timeline_from_plan(plan)
    S, pp, m = len(pipe.stages), len(pipe.stages) // pipe.chunks, pipe.microbatches
    fwd = [f + c for f, c in zip(t.forward_s, t.forward_comm_s)]
    bwd = [b + c for b, c in zip(t.backward_s, t.backward_comm_s)]
    sim = schedules.simulate(pipe.schedule, pp, pipe.chunks, m, fwd,
                             [b / 2 for b in bwd], [b / 2 for b in bwd])
    print(f"{args.model}: {pipe.schedule}, pp {pp} x v {pipe.chunks}, m {m}; predicted step "
          f"{plan.predicted.step_time_s * 1e3:.1f} ms (schedule makespan "
          f"{sim.makespan_s * 1e3:.1f} ms)")

    results = run_ranks(_rank, args.procs, args.model, plan.to_json())
    ranks = schedules.placement(pipe.schedule, pp, pipe.chunks)
    print(f"\nper global stage, per microbatch (ms): predicted | measured median over "
          f"{STEPS} steps x {m} microbatches")
    print(f"{'stage':>5} {'rank':>4} {'F pred':>7} {'F meas':>7} {'B pred':>7} {'B meas':>7}")
    by = defaultdict(list)  # (stage, F or B) -> per step and rank, ms per microbatch
    for res in results:
        for step in res["steps"]:
            total = defaultdict(float)
            for kind, s, _, a, b in step["actions"]:
                if kind != "wait":
                    total[(s, "F" if kind == "F" else "B")] += (b - a) / m
            for key, value in total.items():
                by[key].append(value)
    for s in range(S):
        meas_f, meas_b = (statistics.median(by[(s, k)]) if by[(s, k)] else 0.0 for k in "FB")
        print(f"{s:>5} {ranks[s]:>4} {fwd[s] * 1e3:7.2f} {meas_f * 1e3:7.2f} "
              f"{bwd[s] * 1e3:7.2f} {meas_b * 1e3:7.2f}")

    print("\nper rank, its median step (ms): step | actions busy | transfer waits | rest")
    sim_busy = sim.busy_s
    per_stage = plan.mesh.size("dp") * plan.mesh.size("tp")  # ranks of one pipeline rank
    for r, res in enumerate(results):
        med = _median_step(res["steps"])
        busy = sum(b - a for k, *_, a, b in med["actions"] if k != "wait")
        waits = sum(b - a for k, *_, a, b in med["actions"] if k == "wait")
        print(f"rank {r}: {med['step'] * 1e3:7.1f} | {busy * 1e3:6.1f} (pred "
              f"{sim_busy[r // per_stage] * 1e3:5.1f}) | {waits * 1e3:6.1f} | "
              f"{(med['step'] - busy - waits) * 1e3:6.1f}")
        last = max((b for *_, b in med["actions"]), default=0.0)
        print(f"        last action ends {last * 1e3:.1f} ms; order: " + " ".join(
            f"{k}{s}.{i}" for k, s, i, *_ in med["actions"] if k != "wait"))


if __name__ == "__main__":
    main()
