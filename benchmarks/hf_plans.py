"""Plans of Hugging Face models (torch.export graphs) with mesh="auto": GPT-2 XL on one
8xA100-80GB box and on 4x8xH100, a 7 B Llama on 4x8xH100 (batch 64 x 2048), each built on
the meta device from its config (benchmarks/scale.py: nothing downloaded, no weight
allocated).

    PYTHONPATH=$PWD python benchmarks/hf_plans.py              # all three
    PYTHONPATH=$PWD python benchmarks/hf_plans.py llama-7b     # one model, its devices

Per plan: the mesh (pp x dp x tp) and which won (1-D or 3-D), where the tp groups lie
(their ranks and link), the levers used (layers sharded over dp, checkpointed blocks),
the schedule, the predicted step, and the planning time: wall seconds and this process's
CPU seconds (the machine may be shared; CPU seconds are what the planner itself spent).
"""

from __future__ import annotations

import os
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from scale import gpt2_xl, llama_7b  # noqa: E402

import planner  # noqa: E402
from planner.report.explain import mesh_lines  # noqa: E402

CASES = {"gpt2-xl": (lambda: gpt2_xl(batch=16, seq=1024), ("8xA100-80GB", "4x8xH100")),
         "llama-7b": (lambda: llama_7b(batch=64, seq=2048), ("4x8xH100",))}


def describe(plan) -> list[str]:
    """The figures of one plan, a line each."""
    pp, dp, tp = (plan.mesh.size(d) for d in ("pp", "dp", "tp"))
    lines = [f"mesh pp {pp} x dp {dp} x tp {tp} on {plan.num_devices} devices "
             f"({plan.mesh.nodes} node(s) of {plan.mesh.devices_per_node}); {plan.mesh_choice}"]
    if plan.is_mesh_3d:  # each group's ranks, node span and link, as explain() shows them
        lines += mesh_lines(plan)[1:]
    if plan.pipeline is not None:
        p = plan.pipeline
        lines.append(f"schedule {p.schedule} (chunks {p.chunks}), {p.microbatches} "
                     f"microbatches of {p.microbatch_rows} rows, bubble "
                     f"{p.bubble_fraction:.0%}")
    else:
        lines.append(f"no pipeline, {plan.microbatches} microbatch(es)")
    sharded = sum(l.dp_shard or l.strategy == "fsdp" for l in plan.layers)
    recomputed = sum(l.recompute for l in plan.layers)
    what = (f"{len(plan.recompute_blocks)} blocks" if plan.recompute_blocks
            else f"{recomputed} layers")
    lines.append(f"levers: fsdp on {sharded} layers, recompute {what}")
    used = Counter(l.strategy for l in plan.layers if l.param_bytes)
    lines.append(f"strategies of layers with weights: {dict(sorted(used.items()))}")
    shapes = plan.search.best_per_shape if plan.search is not None else []
    for label, keep in (("tp > 1", lambda c: c.tp > 1), ("tp = 1", lambda c: c.tp == 1)):
        kept = [c for c in shapes if keep(c)]
        if not kept:
            continue
        solved = [c for c in kept if c.step_time_s is not None]
        c = (min(solved, key=lambda c: c.step_time_s) if solved
             else min(kept, key=lambda c: c.bound_s or float("inf")))
        step = (f"{c.step_time_s:.3f} s" if c.step_time_s is not None
                else f"not solved, bound {c.bound_s or float('inf'):.3f} s")
        lines.append(f"best shape with {label}: pp {c.pp} x dp {c.dp} x tp {c.tp}, {step} "
                     f"({c.outcome}); {len(kept)} of {len(shapes)} mesh shapes have {label}")
        unsolved = [u for u in kept if u.step_time_s is None and u.bound_s is not None]
        low = min(unsolved, key=lambda u: u.bound_s, default=None)
        if solved and low is not None and low.bound_s < c.step_time_s:
            lines.append(f"  (unsolved beside it: pp {low.pp} x dp {low.dp} x tp {low.tp}, "
                         f"bound {low.bound_s:.3f} s, {low.outcome})")
    pred = plan.predicted
    lines.append(f"predicted step {pred.step_time_s:.3f} s (compute {pred.compute_s:.3f}, "
                 f"communication {pred.communication_s:.3f}, bubble {pred.bubble_s:.3f}), "
                 f"peak memory {max(pred.memory_bytes) / 1e9:.1f} GB of "
                 f"{pred.memory_limit_bytes / 1e9:.0f}; solver {plan.solver.status}")
    return lines


def run(name: str) -> None:
    make, devices = CASES[name]
    model, args, kwargs = make()
    for where in devices:
        wall, cpu = time.perf_counter(), time.process_time()
        plan = planner.optimize(model, where, example_inputs=args, example_kwargs=kwargs,
                                mesh="auto")
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        print(f"{name} on {where}: planned in {wall:.1f} s wall, {cpu:.1f} CPU s")
        for line in describe(plan):
            print(f"  {line}")
        sys.stdout.flush()


if __name__ == "__main__":
    for case in sys.argv[1:] or list(CASES):
        run(case)
