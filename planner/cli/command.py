"""`hyplan`: plan a model from the command line (a dry run: nothing is trained), show a
saved plan, compare it with the baselines, calibrate this machine, or train under torchrun.
Each verb lives in its own module (plan, compare, calibrate, train); this one is the parser.

    hyplan plan examples/alexnet.py --devices 8xK20 --batch 1024 --json plan.json
    hyplan plan llama3-8b --devices 8xH100 --seq 8192 --batch 16
    hyplan plan path/to/config.json --devices 2x8xA100 --seq 4096 --batch 64
    hyplan show plan.json
    hyplan export plan.json --to torchtitan -o job.toml
    hyplan compare llama3-8b --devices 8xH100 --torchtitan job.toml

MODEL is a Python file, or `package.module[:factory]`, whose `build(batch, device="meta")`
returns `(model, example_inputs, loss_fn)`; the file may also define `example_kwargs`, a
dict of keyword arguments for every forward (e.g. `{"use_cache": False}` for a Hugging Face
model), passed to the tracer and, in `hyplan train`, to each training forward. MODEL may
also be an LLM preset or a Hugging Face causal-LM config.json (profiler.presets), for which
the plan also prints tokens/s and MFU. Every user error ends in one line on stderr,
`hyplan: error: ...`, and exit status 2.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from planner.cli.calibrate import add_calibrate
from planner.cli.compare import add_compare
from planner.cli.export import add_export
from planner.cli.plan import add_plan, add_show
from planner.cli.train import add_train

EXIT_USAGE = 2


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line naming the fix, not the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"hyplan: error: {message}; see `{self.prog} --help`\n")


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="hyplan", description="Plan how to parallelize a PyTorch model layer "
                  "by layer (data, tensor or sharded data parallel, pipeline stages), show the "
                  "plan before anything runs, and train with it under torchrun.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                  parser_class=_Parser)

    add_plan(commands)
    add_show(commands)
    add_compare(commands)
    add_export(commands)
    add_calibrate(commands)
    add_train(commands)
    return top


def main(argv: Sequence[str] | None = None) -> int:
    """The `hyplan` command. Returns the exit status: 0, or 2 for a user error."""
    try:
        args = parser().parse_args(argv)
    except SystemExit as exit_:  # --help, or a usage error already printed
        return exit_.code if isinstance(exit_.code, int) else EXIT_USAGE
    try:
        return args.run(args)
    except FileNotFoundError as error:
        print(f"hyplan: error: {error.filename}: no such file", file=sys.stderr)
    except ValueError as error:  # PlanFileError, PlanDoesNotFit, TraceError are ValueErrors
        message = " ".join(str(error).split())
        print(f"hyplan: error: {message}", file=sys.stderr)
    except BrokenPipeError:  # `hyplan plan ... | head`: the reader has all it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    return EXIT_USAGE


if __name__ == "__main__":
    raise SystemExit(main())
