"""The model builders of benchmarks/scale.py, importable from the tests."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location(
    "scale_benchmark", Path(__file__).resolve().parents[1] / "benchmarks" / "scale.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
llama_7b = _module.llama_7b
