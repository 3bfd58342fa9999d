"""How much a plan's predicted step moves from one planning to the next on the same
profile: each of K fresh processes plans every model of benchmarks/fidelity.py for `Nxcpu`
as a user does (the layers timed here, priced with the cached profile) and reports each
plan kind's predicted step and its compute; printed are the min / median / max over the K
plannings and the relative spread ((max - min) / median).

Why: a profile is fixed once made, but the layers are timed again at every planning, and
this VM's speed drifts (matmul and conv2d together, about +-8% over 5-20 s windows, per
call +-15%). On 2026-11-25 fc_cnn's hybrid plan was priced 135-169 ms in six plannings,
so a fidelity run's error is as much the planning's window as the cost model.

    PYTHONPATH=. python benchmarks/planning_spread.py --runs 4 [--procs 2] [--models mlp fc_cnn]
        (HYPLAN_CACHE_DIR=DIR plans on that cache's profile; a fresh one calibrates first)
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))


def _one_planning(models: list[str], procs: int, out) -> None:
    """In a fresh process (no layer time cached): every plan kind of every model."""
    import fidelity
    from strategies import parse_devices

    cluster = parse_devices(f"{procs}xcpu")
    figures = {}
    for key in models:
        for kind, plan in fidelity.plans_for(key, cluster).items():
            p = plan.predicted
            figures[(key, kind)] = (p.step_time_s, p.compute_s)
    out.put(figures)


def _spread(values: list[float]) -> float:
    """(max - min) / median."""
    return (max(values) - min(values)) / statistics.median(values)


def main() -> None:
    import fidelity

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--models", nargs="+", default=list(fidelity.MODELS))
    args = parser.parse_args()
    ctx = mp.get_context("spawn")
    runs = []
    for _ in range(args.runs):
        queue = ctx.Queue()
        proc = ctx.Process(target=_one_planning, args=(args.models, args.procs, queue))
        proc.start()
        runs.append(queue.get())
        proc.join()
    print(f"{args.runs} plannings on {args.procs}xcpu, each in a fresh process "
          f"(predicted step, ms: min / median / max, spread; compute's spread)")
    spreads = []
    for case in runs[0]:
        steps = [r[case][0] * 1e3 for r in runs]
        spreads.append(_spread(steps))
        print(f"  {case[0]:<10} {case[1]:<9} {min(steps):8.1f} {statistics.median(steps):8.1f}"
              f" {max(steps):8.1f}   {spreads[-1]:4.0%}"
              f"   compute {_spread([r[case][1] for r in runs]):4.0%}")
    print(f"median spread {statistics.median(spreads):.0%}, largest {max(spreads):.0%}")


if __name__ == "__main__":
    main()
