"""FSDP2's "returned a view tensor" warning, kept only where the traced graph says it may
matter.

FSDP2 registers its pre-backward hook on a wrapped module's output. When that output is a
view, an in-place op on it (`x += y`, `relu_`, `ReLU(inplace=True)`) would drop the hook and
skip the backward all-gather, so FSDP2 warns, on every rank, at every step of the run
(Hugging Face GPT-2's Conv1D ends in `.view`, as do many attention blocks). The executor
has the graph: where no op writes in place into such an output, or into a view of it, the
warning describes a hazard this model does not have, and it is silenced for that module
class (the warning names the class, not the instance, so a class is silenced only when
every one of its fsdp instances is safe; otherwise the warning stays, as FSDP2 wrote it).
"""

from __future__ import annotations

import operator
import re
import warnings
from collections.abc import Iterable

import torch.fx as fx

# ops whose result may alias their input: an in-place write through them reaches the view
_ALIASING = {"view", "view_as", "reshape", "reshape_as", "transpose", "permute", "t",
             "getitem", "__getitem__", "split", "chunk", "unbind", "unsqueeze", "squeeze",
             "expand", "expand_as", "narrow", "select", "flatten", "unflatten", "movedim",
             "swapaxes", "swapdims", "as_strided", "contiguous", "detach", "diagonal",
             "split_with_sizes", "tensor_split", "unfold", "alias"}
_IN_PLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv,
                       operator.ifloordiv, operator.imod, operator.ipow, operator.iand,
                       operator.ior, operator.ixor, operator.ilshift, operator.irshift,
                       operator.setitem}
_IN_PLACE_DUNDERS = {f"__i{op}__" for op in ("add", "sub", "mul", "truediv", "floordiv", "mod",
                                               "pow", "and", "or", "xor", "lshift", "rshift",
                                               "matmul")} | {"__setitem__"}


def _name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    name = getattr(node.target, "__name__", "")
    overload = getattr(node.target, "_overloadpacket", None)  # aten ops of exported graphs
    return getattr(overload, "__name__", name) if overload is not None else name


def _writes_in_place(node: fx.Node, gm: fx.GraphModule) -> bool:
    if node.op == "call_module":
        return bool(getattr(gm.get_submodule(str(node.target)), "inplace", False))
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = _name(node)
    if node.op not in ("call_function", "call_method"):
        return False
    if name in _IN_PLACE_DUNDERS:  # x.__iadd__(y), x.__setitem__(i, y)
        return True
    return name.endswith("_") and not name.endswith("__")


def written_in_place(node: fx.Node, gm: fx.GraphModule) -> bool:
    """Whether any op writes in place into `node`'s output or into a view of it."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if _writes_in_place(user, gm):
                return True
            if user.op in ("call_function", "call_method") and _name(user) in _ALIASING:
                stack.append(user)
    return False


def view_warning(cls: str) -> str:
    """The regular expression of FSDP2's warning for a wrapped module of class `cls`."""
    return rf"FSDP2-wrapped module \(FSDP{re.escape(cls)}\) returned a view tensor"


def view_safety(gm: fx.GraphModule, paths: Iterable[str],
                safety: dict[str, bool] | None = None) -> dict[str, bool]:
    """{module class: whether no op writes in place into the output of any of its
    instances at `paths` (modules of `gm` about to be fully_sharded)}, joined with
    `safety` (another graph's verdicts: a pipeline's chunks on one rank)."""
    paths = set(paths)
    safety = dict(safety or {})
    for node in gm.graph.nodes:
        if node.op == "call_module" and str(node.target) in paths:
            cls = type(gm.get_submodule(str(node.target))).__name__
            safety[cls] = safety.get(cls, True) and not written_in_place(node, gm)
    return safety


def silence_safe_view_warnings(safety: dict[str, bool]) -> set[str]:
    """Silence FSDP2's view warning for every class `view_safety` found safe; returns
    them. Before fully_shard renames the classes, after every graph's verdict is in."""
    silenced = {cls for cls, ok in safety.items() if ok}
    for cls in silenced:
        warnings.filterwarnings("ignore", message=view_warning(cls), category=UserWarning)
    return silenced
