"""What is worked out once per model in a process: a cache weakly keyed by the model, so a
model its user drops takes its entries with it. The trace (planner.profiled), the whole
step and the split backward (profiler.whole_step) each keep one."""

from __future__ import annotations

import weakref
from typing import Callable, TypeVar

from torch import nn

T = TypeVar("T")


class PerModel:
    """{model: {key: value}}, each value made once by `make()`."""

    def __init__(self) -> None:
        self._known: "weakref.WeakKeyDictionary[nn.Module, dict]" = weakref.WeakKeyDictionary()

    def get(self, model: nn.Module, key, make: Callable[[], T]) -> T:
        """make(), kept under (model, key); made each time for a model that cannot be
        weakly referenced."""
        try:
            known = self._known.setdefault(model, {})
        except TypeError:
            return make()
        if key not in known:
            known[key] = make()
        return known[key]

    def __len__(self) -> int:
        """How many models hold entries."""
        return len(self._known)
