"""One fidelity case, term by term: each planned layer's predicted time beside what
executor.StepMonitor measured inside its hooks on every rank, and the step's remainder.

A model of benchmarks/fidelity.py is planned as a user plans it (`Nxcpu`, the cached
profile: set HYPLAN_CACHE_DIR to choose one), as hyplan's plan or a baseline, run on N gloo
processes for 11 steps (3 warm-up) with the monitor, then 10 more without it. Read the
columns knowing where the executor spends time outside a layer's hooks: a row-parallel
layer's output reduction is issued asynchronously (torch's RowwiseParallel, async_op=True)
and waited for by the next op, so its time shows in the layer after it; a column-parallel
layer's input-gradient all-reduce runs in DTensor's from_local backward, after the layer's
backward hook, so it shows in the remainder ("rest").

    HYPLAN_CACHE_DIR=DIR python benchmarks/layer_terms.py fc_cnn hyplan [--procs 2] [--all]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import executor  # noqa: E402
import fidelity  # noqa: E402
import planner  # noqa: E402
from profiler.launch import OtherLoad, run_ranks  # noqa: E402


def _rank(rank: int, world: int, model_key: str, plan_json: str) -> dict:
    case = fidelity.Case(model_key, plan_json)
    monitor = executor.StepMonitor(case.model, case.plan, steps=8, skip=3, optimizer=case.opt)
    for _ in range(11):
        with monitor.step():
            case.step()
    drift = monitor.drift()
    plain = []
    for _ in range(10):
        begin = time.perf_counter()
        case.step()
        plain.append(time.perf_counter() - begin)
    return {"step": drift.step_s, "layers": drift.layer_s, "reshard": drift.reshard_s,
            "rest": drift.rest_s, "update": drift.update_s or 0.0,
            "plain": statistics.median(plain)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", choices=list(fidelity.MODELS))
    parser.add_argument("kind", choices=["hyplan", *fidelity.BASELINE_KINDS])
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--all", action="store_true", help="every layer, not only those "
                        "with 0.3 ms or more predicted or measured")
    args = parser.parse_args()

    from strategies import parse_devices

    cluster = parse_devices(f"{args.procs}xcpu")
    build, batch = fidelity.MODELS[args.model]
    model, x, _, _ = build(batch)
    leaves = fidelity._leaves(args.model)
    plan = (planner.optimize(model, cluster, example_inputs=(x,), optimizer="sgd",
                             leaf_modules=leaves) if args.kind == "hyplan"
            else fidelity.baseline(model, cluster, args.kind, (x,), optimizer="sgd",
                                   leaf_modules=leaves))
    print(f"priced with {cluster.source}")
    with OtherLoad() as load:
        per_rank = run_ranks(_rank, args.procs, args.model, plan.to_json())
    p = plan.predicted
    print(f"{args.model} {args.kind} on {args.procs} processes: predicted {p.step_time_s * 1e3:.1f}"
          f" ms (compute {p.compute_s * 1e3:.1f}, communication {p.communication_s * 1e3:.1f},"
          f" other {p.other_s * 1e3:.1f}); measured {max(r['plain'] for r in per_rank) * 1e3:.1f}"
          f" ms ({max(r['step'] for r in per_rank) * 1e3:.1f} with the monitor's hooks)")
    ranks = "".join(f"{f'rank {i}':>9}" for i in range(args.procs))
    print(f"{'layer':<40}{'strategy':<18}{'compute':>9}{'comm':>7}{'edges in':>9}{ranks}")
    for layer in plan.layers:
        measured = [r["layers"].get(layer.name) for r in per_rank]
        big = max([layer.compute_s, layer.communication_s, layer.reshard_in_s]
                  + [m or 0.0 for m in measured]) >= 0.3e-3
        if not (args.all or big):
            continue
        print(f"{layer.name[:39]:<40}{layer.strategy[:17]:<18}{layer.compute_s * 1e3:9.2f}"
              f"{layer.communication_s * 1e3:7.2f}{layer.reshard_in_s * 1e3:9.2f}"
              + "".join(f"{m * 1e3:9.2f}" if m is not None else f"{'-':>9}" for m in measured))
    for key, label in (("reshard", "Reshard modules"), ("update", "optimizer"),
                       ("rest", "rest (outside hooks, with the optimizer)")):
        print(f"{label:<58}{'':>25}" + "".join(f"{r[key] * 1e3:9.2f}" for r in per_rank))
    if load.cores is not None:
        print(f"other processes used {load.cores:.2f} cores meanwhile")


if __name__ == "__main__":
    main()
