"""What a small collective costs a step against how long the ranks computed before it.

Each of `--sizes` is all-reduced 40 times on 2 gloo processes, each call after every rank
computes for `gap` ms (matmul bursts, profiler.calibrate._compute_burst), and timed as the
calibration times in-step collectives (from the last rank's arrival to the last rank's
exit, trimmed mean: profiler.calibrate._call_seconds). The quick calibration prices every
blocking collective at the 8 ms column; a chain of small tensor-parallel layers issues
them well under a millisecond apart.

Measured idle (2-core VM, 2026-11-24): 16 KB 0.23 / 1.00 / 2.38 / 3.76 ms after 0 / 0.5 /
2 / 8 ms of compute; 256 KB 0.46 / 1.35 / 2.21 / 4.35 ms; 1 MB 1.85 / 1.44 / 2.37 / 4.84 ms.

    python benchmarks/collective_gap.py [--sizes 16384 262144 1048576] [--gaps 0 0.5 2 8]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from profiler.calibrate import _call_seconds, _compute_burst  # noqa: E402
from profiler.launch import OtherLoad, run_ranks  # noqa: E402

CALLS = 40


def _rank(rank: int, world: int, nbytes: int, gaps_ms: list[float]) -> dict:
    device = torch.device("cpu")
    x = torch.randn(nbytes // 4)
    out = {}
    for gap in gaps_ms:
        burst = _compute_burst(device, gap / 1e3) if gap > 0 else (lambda: None)
        dist.all_reduce(x)
        dist.barrier()
        spans = []
        for _ in range(CALLS):
            burst()
            begin = time.perf_counter()
            dist.all_reduce(x)
            spans.append((begin, time.perf_counter()))
        out[gap] = spans
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[16 << 10, 256 << 10, 1 << 20])
    parser.add_argument("--gaps", type=float, nargs="+", default=[0.0, 0.5, 2.0, 8.0],
                        help="ms of compute before each call")
    args = parser.parse_args()
    print(f"all-reduce on 2 gloo processes, ms per call after a gap of compute ({CALLS} calls)")
    print(f"{'bytes':>10}" + "".join(f"{f'{g:g} ms gap':>13}" for g in args.gaps))
    with OtherLoad() as load:
        for nbytes in args.sizes:
            per_rank = run_ranks(_rank, 2, nbytes, args.gaps)
            print(f"{nbytes:>10}" + "".join(
                f"{_call_seconds([r[g] for r in per_rank]) * 1e3:>10.2f} ms" for g in args.gaps))
    if load.cores is not None:
        print(f"other processes used {load.cores:.2f} cores meanwhile")


if __name__ == "__main__":
    main()
