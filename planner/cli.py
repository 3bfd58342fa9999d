"""`hyplan`: plan a model from the command line (a dry run: nothing is trained), or show a
saved plan.

    hyplan plan examples/alexnet.py --devices 8xK20 --batch 1024 --json plan.json
    hyplan plan llama3-8b --devices 8xH100 --seq 8192 --batch 16
    hyplan plan path/to/config.json --devices 2x8xA100 --seq 4096 --batch 64
    hyplan show plan.json

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
import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

EXIT_USAGE = 2
_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line naming the fix, not the usage block."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"hyplan: error: {message}; see `{self.prog} --help`\n")


def parse_memory(text: str) -> float:
    """Bytes from "40GB" (10^9), "40GiB" (2^30), "512MB", "1.5TB" or a plain byte count."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"--memory-limit: cannot read {text!r}; write e.g. 40GB, 40GiB, "
                         f"512MB or a number of bytes")
    number, unit = match.groups()
    nbytes = float(number) * _UNITS[(unit or "").lower()]
    if nbytes <= 0:
        raise ValueError(f"--memory-limit: must be positive, got {text!r}")
    return nbytes


# --- loading the user's model -------------------------------------------------------------

@contextlib.contextmanager
def _on_path(folder: str):
    """Let the user's file import its neighbours, as `python FILE` would; undone after."""
    sys.path.insert(0, folder)
    try:
        yield
    finally:
        with contextlib.suppress(ValueError):
            sys.path.remove(folder)


def _split_factory(spec: str) -> tuple[str, str]:
    """"a/b.py:make" → ("a/b.py", "make"); no ":factory" means `build`."""
    if not os.path.exists(spec) and ":" in spec:
        where, _, factory = spec.rpartition(":")
        if factory.isidentifier():
            return where, factory
    return spec, "build"


def _is_file(where: str) -> bool:
    return where.endswith(".py") or os.sep in where or "/" in where or os.path.isfile(where)


_HOW = "a Python file or package.module[:factory] whose build(batch, device) returns " \
       "(model, example_inputs, loss_fn)"


def load_factory(spec: str) -> Callable:
    """The model factory that MODEL names (a file or a module, `build` unless `:factory`)."""
    from planner.extras import install_hint

    where, factory = _split_factory(spec)
    if _is_file(where):
        path = Path(where)
        if not path.is_file():
            raise ValueError(f"model: file {where!r} not found; pass {_HOW}")
        name = "_hyplan_model_" + re.sub(r"\W", "_", path.stem)
        module_spec = importlib.util.spec_from_file_location(name, path)
        if module_spec is None or module_spec.loader is None:
            raise ValueError(f"model: cannot load {where!r} as Python; pass {_HOW}")
        module = importlib.util.module_from_spec(module_spec)
        sys.modules[name] = module  # dataclasses and pickling look their module up here
        with _on_path(str(path.resolve().parent)):
            try:
                module_spec.loader.exec_module(module)
            except ImportError as error:
                del sys.modules[name]
                raise ValueError(f"model: {where} " + (install_hint(error) or f"failed to "
                                 f"import: {error}; install what it needs in this "
                                 f"virtualenv")) from None
            except SyntaxError as error:
                del sys.modules[name]
                raise ValueError(f"model: {where} is not valid Python (line {error.lineno}: "
                                 f"{error.msg}); pass {_HOW}") from None
    else:
        with _on_path(os.getcwd()):
            try:
                module = importlib.import_module(where)
            except ImportError as error:
                hint = install_hint(error) if error.name != where else None
                raise ValueError(f"model: {where} {hint}" if hint else
                                 f"model: cannot import {where!r} ({error}); pass {_HOW}, "
                                 f"from the folder that holds the package") from None
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise ValueError(f"model: {where} defines no function {factory}(batch, device); add "
                         f"one returning (model, example_inputs, loss_fn), or name another "
                         f"as {where}:FUNCTION")
    return fn


def build_model(factory: Callable, batch: int, device: str):
    """(model, example_inputs) from the factory, checking its contract."""
    name = getattr(factory, "__name__", "build")
    try:
        inspect.signature(factory).bind(batch, device=device)
    except TypeError:
        raise ValueError(f"model: {name}() must accept (batch, device=...); define it as "
                         f"def {name}(batch: int, device: str = 'meta')") from None
    except ValueError:  # a builtin without a signature: just call it
        pass
    built = factory(batch, device=device)
    if not isinstance(built, (tuple, list)) or len(built) < 2:
        raise ValueError(f"model: {name}() returned {type(built).__name__}; return "
                         f"(model, example_inputs, loss_fn)")
    model, inputs = built[0], built[1]
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs)


def forward_kwargs(factory: Callable) -> dict:
    """The `example_kwargs` dict the factory's module defines (none: {})."""
    module = sys.modules.get(getattr(factory, "__module__", None) or "")
    kwargs = getattr(module, "example_kwargs", None) or {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise ValueError(f"model: example_kwargs must be a dict of keyword arguments for "
                         f"the forward, e.g. {{'use_cache': False}}; got {kwargs!r}")
    return dict(kwargs)


# --- commands -----------------------------------------------------------------------------

def _prefer_standard(args) -> dict:
    """--prefer-standard, when given (else optimize()'s default)."""
    if args.prefer_standard is None:
        return {}
    if not 0 <= args.prefer_standard < 1:
        raise ValueError(f"--prefer-standard: a fraction in [0, 1), got {args.prefer_standard}")
    return {"prefer_standard": args.prefer_standard}


def _cluster(devices: str, dtype: str | None, precision: str | None = None):
    from pydantic import ValidationError

    from strategies import Cluster, parse_devices

    try:
        cluster = parse_devices(devices).at_precision(precision)
    except ValueError as error:  # name the flag, not the Python argument
        raise ValueError(str(error).replace("precision:", "--precision:", 1)) from None
    if dtype is None or dtype == cluster.compute_dtype:
        return cluster
    try:  # model_copy would skip validation; constructing checks the device knows the dtype
        return Cluster(**{**cluster.model_dump(), "dtype": dtype})
    except ValidationError as error:
        message = error.errors()[0]["msg"].removeprefix("Value error, ")
        raise ValueError(f"--dtype: {message}") from None


def _is_llm(spec: str) -> bool:
    """MODEL names an LLM preset or a Hugging Face config.json (not a Python model file)."""
    from profiler.presets import PRESETS, is_config_path

    return spec in PRESETS or is_config_path(spec)


def _plan(args) -> int:
    import planner

    if args.batch <= 0:
        raise ValueError(f"--batch: the global batch must be positive, got {args.batch}")
    memory_limit = parse_memory(args.memory_limit) if args.memory_limit else None
    llm = _is_llm(args.model)
    cluster = _cluster(args.devices, args.dtype, args.precision)  # a typo fails fast
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
        plan = planner.optimize(model, cluster, example_inputs=inputs, example_kwargs=kwargs,
                                optimizer=args.optimizer, memory_limit_bytes=memory_limit,
                                mesh=args.mesh, tracer="blocks" if llm else "auto",
                                **_prefer_standard(args))
    except planner.PlanDoesNotFit as error:  # name the flags, not the Python arguments
        message = str(error).replace("optimizer='sgd'", "--optimizer sgd")
        raise planner.PlanDoesNotFit(message.replace("memory_limit_bytes", "--memory-limit")) \
            from None
    print(plan.explain(), end="")
    if shape is not None:
        from planner.throughput import plan_throughput

        print(f"Model: {shape.name}, {shape.params / 1e9:.2f} B parameters, sequence "
              f"{args.seq}, global batch {args.batch} sequences, {cluster.compute_dtype} FLOP rates")
        print(plan_throughput(plan, shape, args.seq).describe(), end="")
    if args.json:
        plan.save(args.json)
        print(f"Plan written to {args.json}; view it with `hyplan show {args.json}`")
    _write_plots(plan, args.plot)
    return 0


def _check_plot(directory: str | None) -> None:
    """--plot without matplotlib fails before any planning, in one line."""
    if directory:
        from planner.extras import require

        require("matplotlib", "--plot")


def _write_plots(plan, directory: str | None) -> None:
    if directory:
        from planner.plot import write_plots

        written = write_plots(plan, directory)
        print(f"Pictures written to {directory}: {', '.join(sorted({p.stem for p in written}))} "
              f"(.png, .svg)")


def _show(args) -> int:
    import planner

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


def parser() -> argparse.ArgumentParser:
    top = _Parser(prog="hyplan", description="Plan how to parallelize a PyTorch model layer "
                  "by layer (data, tensor or sharded data parallel, pipeline stages), show the "
                  "plan before anything runs, and train with it under torchrun.")
    commands = top.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                  parser_class=_Parser)

    plan = commands.add_parser(
        "plan", help="plan a model for some devices (a dry run: nothing is trained)",
        description="Plan MODEL for DEVICES at a global batch: trace it, cost each layer's "
        "strategies, solve the integer program and print the plan. Models are built on the "
        "meta device (nothing allocated), except for Nxcpu devices, where layers are timed "
        "on this machine.")
    plan.add_argument("model", metavar="MODEL",
                      help="a Python file (examples/alexnet.py) or package.module[:factory] "
                      "whose build(batch, device='meta') returns (model, example_inputs, "
                      "loss_fn); or an LLM preset (llama3-8b, llama3-70b, llama3-405b, "
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
    plan.add_argument("--prefer-standard", metavar="FRACTION", type=float,
                      help="keep the best standard plan (DDP, tensor parallel, FSDP) when it is "
                      "predicted within this fraction of the optimum (default 0.03, "
                      "planner.optimize's; 0 keeps the optimum)")
    plan.add_argument("--json", metavar="FILE", help="also save the plan as JSON to FILE")
    plan.add_argument("--plot", metavar="DIR", help="also draw the plan (strategy map, memory "
                      "per device, schedule timeline) as PNG and SVG into DIR")
    plan.set_defaults(run=_plan)

    show = commands.add_parser("show", help="print a saved plan",
                               description="Print a plan saved with `hyplan plan --json`.")
    show.add_argument("plan", metavar="PLAN.json")
    show.add_argument("--plot", metavar="DIR", help="also draw the plan as PNG and SVG into DIR")
    show.set_defaults(run=_show)

    from planner import cli_train  # verbs that live in their own modules
    from planner.cli_calibrate import add_calibrate
    from planner.compare import add_compare

    add_compare(commands)
    add_calibrate(commands)
    cli_train.add_parser(commands)
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
