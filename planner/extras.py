"""Optional dependencies: a missing one is one line naming the pip extra that installs it,
never a traceback from deep inside the feature that needed it.

    hyplan: error: --plot needs matplotlib; install it with pip install 'hyplan[plot]'
"""

from __future__ import annotations

import importlib
from types import ModuleType

# top-level module -> the extra of pyproject.toml's [project.optional-dependencies]
EXTRAS = {"matplotlib": "plot", "transformers": "hf"}


class MissingExtra(ValueError):
    """An optional dependency is not installed; the message names the extra."""


def install_hint(error: ImportError) -> str | None:
    """"needs transformers; install it with pip install 'hyplan[hf]'" when `error` is a
    missing module one of hyplan's extras provides, else None."""
    module = (error.name or "").split(".")[0]
    if module not in EXTRAS:
        return None
    return f"needs {module}; install it with pip install 'hyplan[{EXTRAS[module]}]'"


def require(module: str, purpose: str) -> ModuleType:
    """Import `module` (one of EXTRAS), or raise MissingExtra saying that `purpose` needs it
    and how to install it."""
    try:
        return importlib.import_module(module)
    except ImportError as error:
        install = f"install it with pip install 'hyplan[{EXTRAS[module]}]'"
        if (error.name or module).split(".")[0] == module:
            raise MissingExtra(f"{purpose} needs {module}; {install}") from None
        # installed, but one of its own imports failed
        raise MissingExtra(f"{purpose} needs {module}, which failed to import ({error}); "
                           f"{install}") from None
