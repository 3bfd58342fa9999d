"""Random-plan fuzzing of the token split: random feasible plans of a small GPT
(examples/gpt.py, fx-traced, attention kept whole) drawn from the planner's own options
(tests/random_plans.py), each run for 3 SGD steps on gloo ranks and compared with one
process (rtol 1e-5). Prints how often each token-split option was drawn and how many plans
matched.

    PYTHONPATH=$PWD python benchmarks/sequence_parallel_fuzz.py [--plans 16] [--seed 0] [--ranks 2]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402

import test_sequence_parallel as sp  # noqa: E402
from distributed import run_ranks  # noqa: E402
from random_plans import random_plans  # noqa: E402


def run(rank: int, world: int, jobs: list, rows: int) -> dict:
    out = {}
    for i, plan_json in jobs:
        try:
            out[i] = sp._train_planned(rank, world, plan_json, rows)
        except Exception as error:  # noqa: BLE001 - reported per plan
            out[i] = f"{type(error).__name__}: {error}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--plans", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=2)
    args = parser.parse_args()
    rows = args.ranks
    plans = random_plans(sp._model(), f"{args.ranks}xcpu", (sp._batch(0, rows)[0],),
                         args.plans, args.seed)
    drawn = Counter(f"{l.strategy} -> {l.output_layout}" for p in plans for l in p.layers
                    if "sequence" in (l.input_layout, l.output_layout))
    print(f"{len(plans)} plans on {args.ranks} ranks; token-split layers drawn: {dict(drawn)}")
    results = run_ranks(run, args.ranks, [(i, p.to_json()) for i, p in enumerate(plans)], rows)
    expected = {k: v.detach() for k, v in sp._train(sp._model(), lambda b: b, rows).named_parameters()}
    matched = 0
    for i, _ in enumerate(plans):
        try:
            for result in results:
                assert not isinstance(result[i], str), result[i]
                for key, value in result[i].items():
                    torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6)
            matched += 1
        except AssertionError as error:
            print(f"plan {i}: {str(error)[:300]}")
    print(f"{matched} of {len(plans)} plans match one process")


if __name__ == "__main__":
    main()
