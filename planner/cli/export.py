"""`hyplan export`: a saved plan as the job torchtitan runs (TOML) or the arguments
Megatron-LM takes, with what it cannot say (planner.export.Departure: which layers, why).

    hyplan export plan.json --to torchtitan -o job.toml
    hyplan export plan.json --to megatron --model examples/alexnet.py

A per-layer hybrid (AlexNet's data-parallel convolutions beside model-parallel
classifiers) has no spelling there: the export is the nearest configuration they run, and
with --model (the plan's MODEL, as given to `hyplan plan`) that configuration is priced
beside the plan's own price (planner.price_job, the same price list). Every line that is
not the job itself starts with "# ", so the output pastes into a TOML file or a shell.
"""

from __future__ import annotations

from pathlib import Path

from planner.cli.job_args import build_any
from planner.export import express, seq_len_of, to_megatron, to_torchtitan
from planner.plan import Plan
from planner.report.compare_job import gain, nearest_price, speed

WRITERS = {"torchtitan": to_torchtitan, "megatron": to_megatron}


def _export(args) -> int:
    plan = Plan.load(args.plan)
    expressed = express(plan)
    exported = WRITERS[args.to](expressed)
    if args.output:
        Path(args.output).write_text(exported.text + ("\n" if args.to == "megatron" else ""))
        print(f"# wrote {args.output} ({args.to}: {exported.job.describe()})")
    else:
        print(exported.text.rstrip("\n"))
    print("\n".join(f"# {line}" for line in _report(plan, exported, expressed, args)))
    return 0


def _report(plan: Plan, exported, expressed, args) -> list[str]:
    """What the export could not say, and the prices of the plan and of what was written."""
    seq = seq_len_of(plan)
    if not exported.departures:
        lines = [f"exact: {args.to} runs this plan as written ({speed(plan, seq)})"]
    else:
        lines = [(f"{args.to} cannot express this plan exactly; the export is the nearest "
                  f"configuration it runs. The plan differs in:")]
        lines += [f"  - {d}" for d in exported.departures]
    if not args.model:
        if exported.departures:
            lines.append("pass --model MODEL (the plan's) to price the nearest "
                         "configuration beside the plan")
        return lines
    built = build_any(args.model, plan.global_batch, seq, plan.cluster)
    nearest = nearest_price(built.model, plan, expressed, built.inputs, built.kwargs,
                            tracer=built.tracer)
    if nearest.fingerprint != plan.fingerprint:
        raise ValueError(f"--model: {args.model} is not the model {plan.model} the plan was "
                         f"made for (its traced graph differs); pass the plan's MODEL")
    lines.append(f"the plan: {speed(plan, seq)}")
    lines.append(f"the exported configuration, priced by the same price list: "
                 f"{speed(nearest, seq)}"
                 + (f" (the plan is {gain(nearest, plan)})" if exported.departures else ""))
    return lines


def add_export(commands) -> None:
    """Register the `export` verb on the CLI's subcommands."""
    cmd = commands.add_parser(
        "export", help="a saved plan as a torchtitan job file or Megatron-LM arguments",
        description="Write PLAN.json as the job TOML torchtitan runs or the arguments "
        "Megatron-LM takes; say which layers the framework cannot express and why; with "
        "--model, price the written configuration beside the plan.")
    cmd.add_argument("plan", metavar="PLAN.json", help="a plan saved by `hyplan plan --json`")
    cmd.add_argument("--to", required=True, choices=sorted(WRITERS))
    cmd.add_argument("-o", "--output", metavar="FILE",
                     help="write the job here (default: print it)")
    cmd.add_argument("--model", metavar="MODEL",
                     help="the plan's MODEL (as for `hyplan plan`), to price the written "
                     "configuration beside the plan")
    cmd.set_defaults(run=_export)
