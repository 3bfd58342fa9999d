"""The AlexNet example, importable from tests (examples/ is not a package)."""

import importlib.util
from pathlib import Path

_path = Path(__file__).resolve().parents[1] / "examples" / "alexnet.py"
_spec = importlib.util.spec_from_file_location("hyplan_example_alexnet", _path)
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
build = _module.build
AlexNet = _module.AlexNet
