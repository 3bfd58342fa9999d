"""`hyplan compare`: the chosen plan beside the hand-written baselines, in one table.

Every row is costed by the same model on the same profiled graph (planner.report.compare).

    hyplan compare examples/mlp.py --devices 2xcpu --batch 64
"""

from __future__ import annotations

from planner.cli.model_args import build_model, cluster_arg, load_factory, parse_memory
from planner.report.compare import compare, render


def _compare_command(args) -> int:
    """The body of `hyplan compare`."""
    if args.batch <= 0:
        raise ValueError(f"--batch: the global batch must be positive, got {args.batch}")
    memory_limit = parse_memory(args.memory_limit) if args.memory_limit else None
    cluster = cluster_arg(args.devices, args.dtype, args.precision)
    model, inputs = build_model(load_factory(args.model), args.batch,
                                "cpu" if cluster.device.kind == "cpu" else "meta")
    rows = compare(model, cluster, inputs, optimizer=args.optimizer,
                   memory_limit_bytes=memory_limit)
    print(render(rows), end="")
    return 0


def add_compare(commands) -> None:
    """Register the `compare` verb on the CLI's subcommands."""
    cmp = commands.add_parser(
        "compare", help="the chosen plan against the DDP / FSDP / tensor / pipeline baselines",
        description="Plan MODEL as `hyplan plan` does, cost the hand-written baselines (pure "
        "data parallel, Megatron-style tensor parallel, FSDP, pipeline) with the same model, "
        "and print them side by side.")
    cmp.add_argument("model", metavar="MODEL",
                     help="a Python file or package.module[:factory], as for `hyplan plan`")
    cmp.add_argument("--devices", required=True,
                     help="COUNTxNAME, NODESxCOUNTxNAME or [COUNTx]PROFILE.json")
    cmp.add_argument("--batch", required=True, type=int, help="the global batch")
    cmp.add_argument("--optimizer", default="adam",
                     choices=["adam", "adamw", "sgd", "sgd_momentum"])
    cmp.add_argument("--memory-limit", metavar="SIZE", help="per device, e.g. 40GB")
    cmp.add_argument("--precision", default=None, choices=["bf16-mixed", "fp16-mixed", "fp32"],
                     help="the training precision (default: the device's, as `hyplan plan`)")
    cmp.add_argument("--dtype", default=None, help="read the FLOP rate at this dtype")
    cmp.set_defaults(run=_compare_command)
