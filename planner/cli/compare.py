"""`hyplan compare`: the chosen plan beside the hand-written baselines, in one table; or,
with --torchtitan job.toml or --megatron "ARGS", the user's own configuration priced
beside hyplan's plan for the same job, and what to change (planner.report.compare_job).

Every row is costed by the same model on the same profiled graph (planner.report.compare).

    hyplan compare examples/mlp.py --devices 2xcpu --batch 64
    hyplan compare llama3-8b --devices 8xH100 --torchtitan llama3_8b.toml
    hyplan compare llama3-8b --devices 8xH100 --seq 8192 \
        --megatron "--tensor-model-parallel-size 2 --micro-batch-size 1 --global-batch-size 16"
"""

from __future__ import annotations

from dataclasses import replace

from planner.cli.job_args import build_any, read_job
from planner.cli.model_args import build_model, cluster_arg, load_factory, parse_memory
from planner.report.compare import compare, render
from planner.report.compare_job import advice, compare_job


def _compare_command(args) -> int:
    """The body of `hyplan compare`."""
    if args.torchtitan or args.megatron:
        return _compare_job(args)
    if args.batch is None:
        raise ValueError("--batch: the global batch is needed (or give a job: --torchtitan "
                         "FILE or --megatron ARGS, which say it)")
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


def _compare_job(args) -> int:
    """`hyplan compare MODEL --torchtitan FILE | --megatron ARGS`: the user's job priced
    beside hyplan's plan for the same model, batch and devices."""
    cluster = cluster_arg(args.devices, args.dtype, args.precision)
    job, label = read_job(args.torchtitan, args.megatron, cluster.num_devices)
    if args.batch is not None and args.batch != job.global_batch:
        raise ValueError(f"--batch {args.batch}: the job's global batch is "
                         f"{job.global_batch}; drop --batch or make them agree")
    if args.seq and job.seq_len and args.seq != job.seq_len:
        raise ValueError(f"--seq {args.seq}: the job's seq_len is {job.seq_len}; drop --seq "
                         f"or make them agree")
    built = build_any(args.model, job.global_batch, job.seq_len or args.seq, cluster)
    if built.seq and not job.seq_len:
        job = replace(job, seq_len=built.seq)
    memory_limit = parse_memory(args.memory_limit) if args.memory_limit else None
    result = compare_job(built.model, cluster, job, built.inputs, built.kwargs, label=label,
                         optimizer=args.optimizer, tracer=built.tracer,
                         memory_limit_bytes=memory_limit)
    print(advice(result))
    return 0


def add_compare(commands) -> None:
    """Register the `compare` verb on the CLI's subcommands."""
    cmp = commands.add_parser(
        "compare", help="the chosen plan against the DDP / FSDP / tensor / pipeline baselines, "
        "or against your torchtitan / Megatron-LM configuration",
        description="Plan MODEL as `hyplan plan` does, cost the hand-written baselines (pure "
        "data parallel, Megatron-style tensor parallel, FSDP, pipeline) with the same model, "
        "and print them side by side; with --torchtitan or --megatron, price that job "
        "beside hyplan's plan and say what to change.")
    cmp.add_argument("model", metavar="MODEL",
                     help="a Python file or package.module[:factory], as for `hyplan plan`; "
                     "with a job also an LLM preset or config.json")
    cmp.add_argument("--devices", required=True,
                     help="COUNTxNAME, NODESxCOUNTxNAME or [COUNTx]PROFILE.json")
    cmp.add_argument("--batch", type=int, help="the global batch (a job's own by default)")
    cmp.add_argument("--seq", type=int, default=None,
                     help="tokens per sequence, for an LLM preset whose job does not say")
    job = cmp.add_mutually_exclusive_group()
    job.add_argument("--torchtitan", metavar="JOB.toml",
                     help="price this torchtitan job file beside hyplan's plan and say what "
                     "to change")
    job.add_argument("--megatron", metavar="ARGS",
                     help="likewise for Megatron-LM's arguments, one quoted string")
    cmp.add_argument("--optimizer", default="adam",
                     choices=["adam", "adamw", "sgd", "sgd_momentum"])
    cmp.add_argument("--memory-limit", metavar="SIZE", help="per device, e.g. 40GB")
    cmp.add_argument("--precision", default=None, choices=["bf16-mixed", "fp16-mixed", "fp32"],
                     help="the training precision (default: the device's, as `hyplan plan`)")
    cmp.add_argument("--dtype", default=None, help="read the FLOP rate at this dtype")
    cmp.set_defaults(run=_compare_command)
