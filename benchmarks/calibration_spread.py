"""How much the quick calibration (the one a first plan makes) moves from one run to the
next: it runs `strategies.calibrated.calibrate(quick=True)` K times on P processes and
prints, per fitted term and per raw sample, the min / median / max over runs and the
relative spread ((max - min) / median), with each run's seconds and the CPU other processes
used meanwhile. A term that moves a lot between calibrations moves every plan priced by it
(a 256 KB all-reduce priced 1.5 or 2.7 ms is +-35% of gpt_tiny's tensor step).

    PYTHONPATH=. nice -n 19 python benchmarks/calibration_spread.py --runs 4 [--procs 2]
        [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# messages a small model's plans issue: where a fit's latency and bandwidth are read
PRICE_BYTES = (16 << 10, 256 << 10, 1 << 20, 8 << 20, 64 << 20)


def terms(profile, world: int) -> dict[str, float]:
    """{term: value} of one profile: the fits, the prices they give at PRICE_BYTES, the
    fixed costs, and every raw sample (ms, GB/s, GFLOP/s as the name says)."""
    from profiler.calibrate import TP_ROWS
    from strategies.collectives import all_reduce_s, collective_time_s

    link = profile.links[world]
    out = {"calibration s": profile.seconds,
           "matmul GFLOP/s": profile.device.op_flops["matmul"] / 1e9,
           "conv2d GFLOP/s": profile.device.op_flops["conv2d"] / 1e9,
           "copy GB/s": profile.device.memory_bandwidth_bytes_per_s / 1e9}
    for name, fit in sorted(link.collectives.items()):
        out[f"{name} alpha ms"] = fit.latency_s * 1e3
        out[f"{name} beta GB/s"] = fit.bandwidth_bytes_per_s / 1e9
        for r in fit.regimes:
            out[f"{name} >{r.above_bytes / 2**20:g}MB alpha ms"] = r.latency_s * 1e3
            out[f"{name} >{r.above_bytes / 2**20:g}MB beta GB/s"] = r.bandwidth_bytes_per_s / 1e9
        if name != "tp_layer":
            for n in PRICE_BYTES:
                out[f"{name} price {_size(n)} ms"] = collective_time_s(name, n, world, link) * 1e3
    out["tp_layer price 4 MB weight ms"] = collective_time_s("tp_layer", 4 << 20, world,
                                                             link) * 1e3
    out["dtensor reshard ms"] = profile.dtensor_reshard_overhead_s.get(world, 0.0) * 1e3
    out["step overhead ms"] = profile.step_overhead_s.get(world, 0.0) * 1e3
    out["compute slowdown x"] = profile.compute_slowdown.get(world, 1.0)
    out["memory slowdown x"] = profile.memory_slowdown.get(world, 1.0)
    for s in profile.samples:
        out[f"sample {s.collective} {_size(s.nbytes)} ms"] = s.seconds * 1e3
        if s.collective == "tp_layer":  # the pair as measured: its fit's share plus the
            width = round((s.nbytes / 4) ** 0.5)  # two all-reduces the link prices
            act_bytes = TP_ROWS * width * 4
            out[f"tp pair beyond plain {width} wide ms"] = 2 * (
                s.seconds + all_reduce_s(act_bytes, world, link)) * 1e3
    return out


def _size(nbytes: float) -> str:
    for unit, scale in (("MB", 2**20), ("KB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:g} {unit}"
    return f"{nbytes:g} B"


def table(runs: list[dict[str, float]]) -> list[str]:
    """One line per term: min, median, max over runs and (max - min) / median."""
    keys = [k for k in runs[0] if all(k in r for r in runs)]
    lines = [f"{'term':<40} {'min':>10} {'median':>10} {'max':>10} {'spread':>7}"]
    for key in keys:
        values = [r[key] for r in runs]
        mid = statistics.median(values)
        spread = (max(values) - min(values)) / abs(mid) if mid else 0.0
        lines.append(f"{key:<40} {min(values):10.4g} {mid:10.4g} {max(values):10.4g} "
                     f"{spread:6.0%}")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--procs", type=int, default=2)
    parser.add_argument("--json", help="write each run's terms here")
    args = parser.parse_args()

    from strategies.calibrated import calibrate
    from strategies.profile_cache import measured

    runs, loads = [], []
    for i in range(args.runs):
        profile = measured(lambda: calibrate((args.procs,), quick=True, log=lambda *_: None))
        runs.append(terms(profile, args.procs))
        loads.append(profile.other_load_cores)
        print(f"run {i + 1}: {profile.seconds:.1f} s, other CPU {profile.other_load_cores:.2f} "
              f"cores; all_reduce 256 KB {runs[-1]['all_reduce price 256 KB ms']:.2f} ms, "
              f"tp_layer alpha {runs[-1].get('tp_layer alpha ms', 0.0):.2f} ms", flush=True)
    print(f"\n{args.runs} quick calibrations on {args.procs} processes "
          f"(other CPU {min(loads):.2f}-{max(loads):.2f} cores)")
    print("\n".join(table(runs)))
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))


if __name__ == "__main__":
    main()
