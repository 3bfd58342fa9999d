"""What the CLI's verbs read from their arguments: MODEL (a file or module whose factory
builds the model), --devices with --dtype and --precision, --memory-limit sizes.

MODEL is a Python file, or `package.module[:factory]`, whose `build(batch, device="meta")`
returns `(model, example_inputs, loss_fn)`; the file may also define `example_kwargs`, a
dict of keyword arguments for every forward (e.g. `{"use_cache": False}` for a Hugging Face
model), passed to the tracer and, in `hyplan train`, to each training forward.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import inspect
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path

from planner.extras import install_hint

_SIZE = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1}
for _i, _p in enumerate("kmgt", start=1):
    _UNITS[_p] = _UNITS[_p + "b"] = 1000**_i
    _UNITS[_p + "i"] = _UNITS[_p + "ib"] = 1024**_i


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


def cluster_arg(devices: str, dtype: str | None, precision: str | None = None):
    """The Cluster that --devices, --dtype and --precision describe; errors name the flag."""
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
