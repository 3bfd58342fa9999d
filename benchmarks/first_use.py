"""What planning for this machine costs a new user: the first plan for N processes runs the
quick calibration (into a fresh cache directory here); later plans read the cached
profile. Prints the seconds of each, for 2 and 4 processes and the example MLP.

    python benchmarks/first_use.py [--worlds 2 4]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    os.environ["HYPLAN_CACHE_DIR"] = tempfile.mkdtemp(prefix="hyplan-cache-")

    import planner
    from examples.mlp import build
    from strategies import parse_devices

    for world in args.worlds:
        began = time.perf_counter()
        cluster = parse_devices(f"{world}xcpu")
        first = time.perf_counter() - began
        began = time.perf_counter()
        parse_devices(f"{world}xcpu")
        cached = time.perf_counter() - began
        model, inputs = build(64, "cpu")[:2]
        began = time.perf_counter()
        plan = planner.optimize(model, f"{world}xcpu", example_inputs=inputs)
        planned = time.perf_counter() - began
        print(f"{world} processes: first use (quick calibration) {first:.1f} s; cached profile "
              f"read in {cached * 1e3:.1f} ms; a whole plan of the example MLP (batch 64) with "
              f"it {planned:.1f} s, predicted {plan.predicted.step_time_s * 1e3:.1f} ms/step")
        print(f"  priced with: {cluster.source}")


if __name__ == "__main__":
    main()
