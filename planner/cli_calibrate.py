"""`hyplan calibrate`: measure this machine's compute and collectives, save a cluster profile.

    hyplan calibrate --processes 2 4 --out cpu-profile.json
    hyplan plan examples/mlp.py --devices 2xcpu-profile.json --batch 64
"""

from __future__ import annotations


def _calibrate(args) -> int:
    from profiler.calibrate import calibrate

    if any(p < 2 for p in args.processes):
        raise ValueError(f"--processes: each count must be at least 2 (collectives need two "
                         f"ranks), got {args.processes}")
    profile = calibrate(tuple(sorted(set(args.processes))), quick=args.quick,
                        quiet_wait_s=args.wait_for_quiet)
    profile.save(args.out)
    counts = "/".join(str(p) for p in sorted(profile.links))
    print(f"Cluster profile written to {args.out}; plan on it with `hyplan plan MODEL "
          f"--devices {max(profile.links)}x{args.out} --batch N` ({counts} processes measured)")
    return 0


def add_calibrate(commands) -> None:
    """Register the `calibrate` verb on the CLI's subcommands."""
    cal = commands.add_parser(
        "calibrate", help="measure this machine (compute, collectives) and save a profile",
        description="Time matmul, conv2d and memory copies, and all-reduce, all-gather, "
        "reduce-scatter, all-to-all and send/recv over real process groups (gloo on CPU, NCCL "
        "with CUDA events on GPUs); fit latency and bandwidth per collective; save a cluster "
        "profile that `--devices [COUNTx]PROFILE.json` plans on.")
    cal.add_argument("--processes", type=int, nargs="+", default=[2, 4], metavar="N",
                     help="process counts to measure collectives on (default: 2 4)")
    cal.add_argument("--out", default="hyplan-profile.json", metavar="FILE",
                     help="where to write the profile (default: hyplan-profile.json)")
    cal.add_argument("--quick", action="store_true",
                     help="fewer sizes and repeats (about 20 s on a small machine)")
    cal.add_argument("--wait-for-quiet", type=float, default=0.0, metavar="SECONDS",
                     help="on a shared machine: before each measurement, wait up to this "
                     "long for other processes' load to pause (default: 0, do not wait)")
    cal.set_defaults(run=_calibrate)
