"""The conformance table: model x plan kind -> largest relative parameter difference from
one process after 3 SGD steps, the strategies the plan used, and pass / fail / refused.

The models are tests/zoo.py's (Hugging Face configs no one here wrote, random init, and a
plain torch model); the plans are hyplan's DDP, FSDP, tensor and pipeline baselines and its
own optimum (prefer_standard=0), run on gloo ranks exactly as tests/test_zoo.py runs them.

    python benchmarks/zoo_table.py [--ranks 2] [MODEL ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from distributed import run_ranks  # noqa: E402
from test_zoo import KINDS, make_plan, run_plans  # noqa: E402
from zoo import ZOO, reference  # noqa: E402


def relative_difference(results: list, key, expected: dict) -> float:
    """max over parameters of ||got - expected|| / ||expected||, over every rank."""
    worst = 0.0
    for result in results:
        for name, value in result[key].items():
            scale = expected[name].norm().clamp_min(1e-6)
            worst = max(worst, ((value - expected[name]).norm() / scale).item())
    return worst


def passes(results: list, key, expected: dict) -> bool:
    seen = set()
    for result in results:
        for name, value in result[key].items():
            seen.add(name)
            if not torch.allclose(value, expected[name], rtol=1e-5, atol=1e-6):
                return False
    return seen == set(expected)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(ZOO))
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    started = time.perf_counter()
    plans, refused = {}, {}
    for name in args.models:
        for kind in KINDS:
            try:
                plans[(name, kind)] = make_plan(name, kind, f"{args.ranks}xcpu")
            except ValueError as error:
                refused[(name, kind)] = str(error)
    jobs = [(name, kind, plan.to_json()) for (name, kind), plan in plans.items()]
    results = run_ranks(run_plans, args.ranks, jobs)
    print(f"{'model':14s} {'plan':9s} {'result':8s} {'max rel diff':>12s}  strategies / reason")
    counts = {"pass": 0, "FAIL": 0, "refused": 0}
    for name in args.models:
        expected = reference(ZOO[name])
        for kind in KINDS:
            key = (name, kind)
            if key in refused:
                counts["refused"] += 1
                print(f"{name:14s} {kind:9s} {'refused':8s} {'':>12s}  {refused[key]}")
                continue
            errors = [r[key] for r in results if isinstance(r[key], str)]
            strategies = ", ".join(sorted({l.strategy for l in plans[key].layers}))
            if errors:
                counts["FAIL"] += 1
                print(f"{name:14s} {kind:9s} {'FAIL':8s} {'':>12s}  {errors[0][:200]}")
                continue
            ok = passes(results, key, expected)
            counts["pass" if ok else "FAIL"] += 1
            print(f"{name:14s} {kind:9s} {'pass' if ok else 'FAIL':8s} "
                  f"{relative_difference(results, key, expected):12.1e}  {strategies}")
    print(f"{counts['pass']} passed, {counts['FAIL']} failed, {counts['refused']} refused "
          f"up front ({args.ranks} ranks, {time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
