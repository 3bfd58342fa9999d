"""What planning for this machine costs a new user: the first plan for N processes runs the
quick calibration (into a fresh cache directory here); later plans read the cached
profile. Prints the seconds of each, for 2 and 4 processes and the example MLP, and checks
what the calibration measured (check_profile: every collective the price list reads, a fit
past the shared cache, the gap curve). The suite runs no multi-process calibration: it
takes most of a minute with the machine to itself.

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


COLLECTIVES = {"all_reduce", "bucket_all_reduce", "all_gather", "reduce_scatter", "all_to_all",
               "send_recv", "fsdp_layer", "tp_layer"}


def check_profile(cluster, world: int) -> None:
    """What a first-use calibration of `world` processes must measure: each collective the
    price list reads; past the shared cache (where the host reports one under 128 MB, the
    largest message) a regime of its own for each but tp_layer (one line over the weights'
    bytes of tensor-parallel pairs); the small all-reduce after each compute gap of GAPS_S,
    at least the compute asked for, made non-decreasing; and the profile read back from the
    cache in under a second."""
    from profiler.calibrate import GAPS_S
    from strategies import parse_devices

    link = cluster.intra_node
    assert cluster.cores == os.cpu_count() and cluster.num_devices == world
    assert COLLECTIVES <= set(link.collectives), COLLECTIVES - set(link.collectives)
    if cluster.device.cache_bytes and cluster.device.cache_bytes < 128 * 2**20:
        assert all(f.regimes and f.regimes[0].above_bytes == cluster.device.cache_bytes
                   for name, f in link.collectives.items() if name != "tp_layer")
    curve = link.gap_curve
    assert curve is not None and len(curve.gaps_s) == len(GAPS_S)
    assert all(wall >= 0.8 * asked for wall, asked in zip(curve.gaps_s, GAPS_S))
    assert list(curve.gaps_s) == sorted(curve.gaps_s)
    assert list(curve.seconds) == sorted(curve.seconds) and curve.seconds[0] > 0
    began = time.perf_counter()
    assert parse_devices(f"{world}xcpu") == cluster
    assert time.perf_counter() - began < 1.0


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
        check_profile(cluster, world)
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
        print("  checked: every collective the price list reads, a fit past the shared cache, "
              "the gap curve")


if __name__ == "__main__":
    main()
