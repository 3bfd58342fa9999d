"""Random-plan fuzzing over the zoo: every plan the planner may offer must run and train
exactly like one process.

For each model of tests/zoo.py (Hugging Face configs no one here wrote, and a plain torch
model), draw random feasible plans from the planner's own options (tests/random_plans.py:
the real integer program under a random objective), run each for 3 SGD steps on 2 gloo
ranks, and compare every parameter with one process on the whole batch (rtol 1e-5).
Prints a line per model and the totals: drawn, ran, matched.

    python benchmarks/random_plans.py [--per-model 20] [--seed 0] [--ranks 2] [MODEL ...]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

from distributed import run_ranks  # noqa: E402
from random_plans import random_plans  # noqa: E402
from test_zoo import run_plans  # noqa: E402
from zoo import ZOO, reference  # noqa: E402


def matches(got: dict, expected: dict) -> bool:
    try:
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)
    except AssertionError:
        return False
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="*", default=list(ZOO))
    parser.add_argument("--per-model", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    totals = {"drawn": 0, "ran": 0, "matched": 0}
    failures = []
    print(f"{'model':15s} {'drawn':>5s} {'ran':>5s} {'matched':>7s}  strategies seen")
    for name in args.models:
        entry = ZOO[name]
        started = time.perf_counter()
        inputs, kwargs = entry.example()
        plans = random_plans(entry.make(), f"{args.ranks}xcpu", inputs, args.per_model,
                             args.seed, kwargs=kwargs)
        jobs = [(name, str(i), plan.to_json()) for i, plan in enumerate(plans)]
        results = run_ranks(run_plans, args.ranks, jobs)
        expected = reference(entry)
        ran = matched = 0
        for i, _ in enumerate(plans):
            got = [r[(name, str(i))] for r in results]
            if any(isinstance(g, str) for g in got):
                failures.append((name, i, next(g for g in got if isinstance(g, str))[:300]))
                continue
            ran += 1
            if all(matches(g, expected) for g in got):
                matched += 1
            else:
                failures.append((name, i, "parameters differ from one process"))
        seen = sorted({l.strategy for p in plans for l in p.layers})
        print(f"{name:15s} {len(plans):5d} {ran:5d} {matched:7d}  {', '.join(seen)} "
              f"({time.perf_counter() - started:.0f} s)", flush=True)
        totals["drawn"] += len(plans)
        totals["ran"] += ran
        totals["matched"] += matched
    print(f"total: {totals['drawn']} drawn, {totals['ran']} ran, {totals['matched']} matched "
          f"({args.ranks} ranks, seed {args.seed})")
    for name, i, why in failures:
        print(f"  {name} plan {i}: {why}")


if __name__ == "__main__":
    main()
