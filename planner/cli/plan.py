"""`hyplan plan` and `hyplan show`: plan a model (a dry run: nothing is trained), or show a
saved plan.

    hyplan plan examples/alexnet.py --devices 8xK20 --batch 1024 --json plan.json
    hyplan plan llama3-8b --devices 8xH100 --seq 8192 --batch 16
    hyplan plan llama3.1-8b --devices 8xH100 --seq 131072 --batch 2 --kind cp
    hyplan show plan.json
"""

from __future__ import annotations

import argparse

import planner
from planner.baseline import BASELINES
from planner.cli.model_args import (
    build_model,
    cluster_arg,
    forward_kwargs,
    load_factory,
    parse_memory,
)
from planner.cli.progress import search_progress
from planner.search import DEFAULT_SEARCH_TIME_S


def _prefer_standard(args) -> dict:
    """--prefer-standard, when given (else optimize()'s default)."""
    if args.prefer_standard is None:
        return {}
    if not 0 <= args.prefer_standard < 1:
        raise ValueError(f"--prefer-standard: a fraction in [0, 1), got {args.prefer_standard}")
    return {"prefer_standard": args.prefer_standard}


def _is_llm(spec: str) -> bool:
    """MODEL names an LLM preset or a Hugging Face config.json (not a Python model file)."""
    from profiler.presets import PRESETS, is_config_path

    return spec in PRESETS or is_config_path(spec)


def _plan(args) -> int:
    if args.batch <= 0:
        raise ValueError(f"--batch: the global batch must be positive, got {args.batch}")
    memory_limit = parse_memory(args.memory_limit) if args.memory_limit else None
    llm = _is_llm(args.model)
    cluster = cluster_arg(args.devices, args.dtype, args.precision)  # a typo fails fast
    _check_plot(args.plot)
    kwargs, shape = {}, None
    if llm:
        from profiler.presets import load_llm

        model, inputs, kwargs, shape, args.seq = load_llm(args.model, args.batch, args.seq)
    else:
        if args.seq is not None:
            raise ValueError("--seq: only for an LLM preset or a config.json; a model file "
                             "sets its own sequence length in build()")
        factory = load_factory(args.model)
        # On "meta" nothing is allocated; CPU devices are this machine, so layers get timed.
        device = "cpu" if cluster.device.kind == "cpu" else "meta"
        model, inputs = build_model(factory, args.batch, device)
        kwargs = forward_kwargs(factory)
    try:
        plan = _make_plan(args, model, cluster, inputs, kwargs, memory_limit, llm)
    except planner.PlanDoesNotFit as error:  # name the flags, not the Python arguments
        message = str(error).replace("optimizer='sgd'", "--optimizer sgd")
        raise planner.PlanDoesNotFit(message.replace("memory_limit_bytes", "--memory-limit")) \
            from None
    print(plan.explain(), end="")
    if shape is not None:
        from planner.report.throughput import plan_throughput

        print(f"Model: {shape.name}, {shape.params / 1e9:.2f} B parameters, sequence "
              f"{args.seq}, global batch {args.batch} sequences, {cluster.compute_dtype} FLOP rates")
        print(plan_throughput(plan, shape, args.seq).describe(), end="")
    if args.json:
        plan.save(args.json)
        print(f"Plan written to {args.json}; view it with `hyplan show {args.json}`")
    _write_plots(plan, args.plot)
    return 0


def _make_plan(args, model, cluster, inputs, kwargs, memory_limit, llm: bool):
    """optimize()'s plan, or with --kind the best plan of that kind (planner.baseline: "cp"
    for context parallelism at long context)."""
    tracer = "blocks" if llm else "auto"
    if args.kind is not None:
        return planner.baseline(model, cluster, args.kind, inputs, kwargs, optimizer=args.optimizer,
                        tracer=tracer)
    with search_progress():
        return planner.optimize(model, cluster, example_inputs=inputs, example_kwargs=kwargs,
                                optimizer=args.optimizer, memory_limit_bytes=memory_limit,
                                mesh=args.mesh, tracer=tracer, search_time_s=args.search_time,
                                **_prefer_standard(args))


def _check_plot(directory: str | None) -> None:
    """--plot without matplotlib fails before any planning, in one line."""
    if directory:
        from planner.extras import require

        require("matplotlib", "--plot")


def _write_plots(plan, directory: str | None) -> None:
    if directory:
        from planner.report.plot import write_plots

        written = write_plots(plan, directory)
        print(f"Pictures written to {directory}: {', '.join(sorted({p.stem for p in written}))} "
              f"(.png, .svg)")


def _show(args) -> int:
    _check_plot(args.plot)
    try:
        plan = planner.Plan.load(args.plan)
    except FileNotFoundError:
        raise ValueError(f"plan: file {args.plan!r} not found; write one with "
                         f"`hyplan plan MODEL --devices ... --batch ... --json FILE`") from None
    except UnicodeDecodeError:
        raise planner.PlanFileError(f"plan: {args.plan!r} is not a JSON text file; re-create "
                                    f"it with `hyplan plan ... --json FILE`") from None
    except OSError as error:
        raise ValueError(f"plan: cannot read {args.plan!r} ({error.strerror})") from None
    print(plan.explain(), end="")
    _write_plots(plan, args.plot)
    return 0


def add_plan(commands) -> None:
    """Register the `plan` verb on the CLI's subcommands."""
    plan = commands.add_parser(
        "plan", help="plan a model for some devices (a dry run: nothing is trained)",
        description="Plan MODEL for DEVICES at a global batch: trace it, cost each layer's "
        "strategies, solve the integer program and print the plan. Models are built on the "
        "meta device (nothing allocated), except for Nxcpu devices, where layers are timed "
        "on this machine.")
    plan.add_argument("model", metavar="MODEL",
                      help="a Python file (examples/alexnet.py) or package.module[:factory] "
                      "whose build(batch, device='meta') returns (model, example_inputs, "
                      "loss_fn); or an LLM preset (llama3-8b, llama3.1-8b, llama3-70b, llama3-405b, "
                      "mixtral-8x7b, gpt3-175b) or a Hugging Face causal-LM config.json, "
                      "built on the meta device")
    plan.add_argument("--seq", type=int, default=None,
                      help="tokens per sequence, for an LLM preset or config.json (default: "
                      "the model's context, at most 8192); --batch counts sequences")
    plan.add_argument("--devices", required=True,
                      help="COUNTxNAME or NODESxCOUNTxNAME, e.g. 8xV100, 2x8xH100, 4xcpu")
    plan.add_argument("--batch", required=True, type=int,
                      help="the GLOBAL batch, over all devices (each gets batch/devices rows "
                      "where a layer is data parallel)")
    plan.add_argument("--optimizer", default="adam",
                      choices=["adam", "adamw", "sgd", "sgd_momentum"],
                      help="whose state counts in memory (default: adam)")
    plan.add_argument("--memory-limit", metavar="SIZE",
                      help="per device, e.g. 40GB, 40GiB, 512MB or bytes (default: the "
                      "device's memory)")
    plan.add_argument("--precision", default=None, choices=["bf16-mixed", "fp16-mixed", "fp32"],
                      help="the training precision, priced as the executor runs it: compute "
                      "rate, activations and bytes sent in bf16/fp16, fp32 weights, gradients "
                      "and optimizer state (default: bf16-mixed on A100/H100, fp16-mixed on "
                      "V100, fp32 on older GPUs and CPUs)")
    plan.add_argument("--dtype", default=None,
                      help="read the FLOP rate at this dtype instead of the precision's, e.g. "
                      "tfloat32 for fp32 training with TF32 matmuls")
    plan.add_argument("--mesh", default="1d", choices=["1d", "3d", "auto"],
                      help="1d: all devices in one group, each layer data- or model-parallel "
                      "(default); 3d: search pipeline x data x tensor meshes, stage cuts, "
                      "microbatches and schedules; auto: both, keeping the 1-D plan unless a "
                      "3-D one is predicted at least 1%% faster")
    plan.add_argument("--search-time", metavar="SECONDS|prove", type=parse_search_time,
                      default=DEFAULT_SEARCH_TIME_S,
                      help="with --mesh 3d or auto: stop the search SECONDS after planning "
                      f"starts (default {DEFAULT_SEARCH_TIME_S:g}) and print the best plan "
                      "with its status and gap; 'prove' runs the search to its end, "
                      "which on the largest models takes many minutes (Ctrl-C prints the "
                      "best so far at any time)")
    plan.add_argument("--prefer-standard", metavar="FRACTION", type=float,
                      help="keep the best standard plan (DDP, tensor parallel, FSDP) when it is "
                      "predicted within this fraction of the optimum (default 0.03, "
                      "planner.optimize's; 0 keeps the optimum)")
    plan.add_argument("--kind", default=None, choices=list(BASELINES),
                      help="the best plan of one kind instead of hyplan's choice per layer "
                      "(planner.baseline), e.g. cp: context parallelism, each sequence split "
                      "over a cp group, for long context (--seq 131072)")
    plan.add_argument("--json", metavar="FILE", help="also save the plan as JSON to FILE")
    plan.add_argument("--plot", metavar="DIR", help="also draw the plan (strategy map, memory "
                      "per device, schedule timeline) as PNG and SVG into DIR")
    plan.set_defaults(run=_plan)


def parse_search_time(text: str) -> float | None:
    """--search-time: seconds, or 'prove' for no limit (planner.optimize's None)."""
    if text.strip().lower() == "prove":
        return None
    try:
        seconds = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is neither a number of seconds nor "
                                         f"'prove'") from None
    if seconds < 0:
        raise argparse.ArgumentTypeError(f"{text!r}: seconds cannot be negative")
    return seconds


def add_show(commands) -> None:
    """Register the `show` verb on the CLI's subcommands."""
    show = commands.add_parser("show", help="print a saved plan",
                               description="Print a plan saved with `hyplan plan --json`.")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--plot", metavar="DIR", help="also draw the plan as PNG and SVG into DIR")
    show.set_defaults(run=_show)
