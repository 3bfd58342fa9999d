"""`hyplan calibrate`: measure this machine's compute and collectives again.

Planning for this machine (`--devices 2xcpu`) calibrates on first use and caches the
profile (strategies.profile_cache); this verb measures again, more thoroughly unless
`--quick`, and replaces the cached profiles, so later plans price with the new figures.
`--out FILE` also writes one profile of every count, for `--devices 2xFILE` elsewhere.

    hyplan calibrate                      # refresh the cached profiles for 2 and 4 processes
    hyplan calibrate --processes 2 4 --out cpu-profile.json
    hyplan plan examples/mlp.py --devices 2xcpu-profile.json --batch 64
"""

from __future__ import annotations


def _calibrate(args) -> int:
    from strategies.calibrated import ClusterProfile
    from strategies.profile_cache import refresh

    if any(p < 1 for p in args.processes):
        raise ValueError(f"--processes: each count must be at least 1, got {args.processes}")
    made = refresh(args.processes, quick=args.quick, quiet_wait_s=args.wait_for_quiet)
    for profile, path in made:
        print(f"Cached profile for {max(profile.links, default=1)} process(es): {path} "
              f"({profile.seconds:.0f} s)")
    if args.out:
        # one file with every count: links and per-count figures merged
        first = made[0][0]
        merged = {key: {} for key in ("links", "dtensor_layer_overhead_s",
                                      "dtensor_reshard_overhead_s", "compute_slowdown",
                                      "memory_slowdown", "step_overhead_s",
                                      "fsdp_overhead_s_per_byte")}
        samples = []
        for profile, _ in made:
            for key, table in merged.items():
                table.update(getattr(profile, key))
            samples += profile.samples
        # the compute figures of the largest count (the threads each of its processes gets)
        device = made[-1][0].device
        whole = ClusterProfile.model_validate({
            **first.model_dump(by_alias=True), **merged, "samples": samples,
            "device": device, "threads_per_process": made[-1][0].threads_per_process,
            "seconds": sum(p.seconds for p, _ in made)})
        whole.save(args.out)
        counts = "/".join(str(p) for p in sorted(whole.links))
        print(f"Cluster profile written to {args.out}; plan on it with `hyplan plan MODEL "
              f"--devices {max(whole.links, default=1)}x{args.out} --batch N` ({counts} "
              f"processes measured)")
    return 0


def add_calibrate(commands) -> None:
    """Register the `calibrate` verb on the CLI's subcommands."""
    cal = commands.add_parser(
        "calibrate", help="measure this machine (compute, collectives) and refresh the profile "
        "planning for it uses",
        description="Time matmul, conv2d and memory copies, and all-reduce, all-gather, "
        "reduce-scatter, all-to-all and send/recv over real process groups (gloo on CPU, NCCL "
        "with CUDA events on GPUs); fit latency and bandwidth per collective, piecewise where "
        "it changes with size; replace the cached profile that planning for this machine "
        "(--devices Nxcpu) uses, made on first use by a quick calibration. --out also saves "
        "a profile that `--devices [COUNTx]PROFILE.json` plans on.")
    cal.add_argument("--processes", type=int, nargs="+", default=[2, 4], metavar="N",
                     help="process counts to measure (default: 2 4)")
    cal.add_argument("--out", metavar="FILE",
                     help="also write one profile of every count to FILE")
    cal.add_argument("--quick", action="store_true",
                     help="fewer sizes and repeats (what first use runs: under a minute per "
                     "count on a small machine)")
    cal.add_argument("--wait-for-quiet", type=float, default=0.0, metavar="SECONDS",
                     help="on a shared machine: before each measurement, wait up to this "
                     "long for other processes' load to pause (default: 0, do not wait)")
    cal.set_defaults(run=_calibrate)
