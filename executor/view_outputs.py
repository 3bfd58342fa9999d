"""Module outputs that a later op writes in place: where that breaks a step, and where it
does not.

DTensor hands a tensor-parallel module's output (and a layout change's, `Reshard`) to the
model's code through `to_local`, a view made inside an autograd Function, which autograd
forbids writing in place: torchvision's `ReLU(inplace=True)` after a column-split Linear
(AlexNet, VGG), `Hardswish(inplace=True)` (MobileNetV3), Falcon's `mlp_output +=
attention_output` each stopped the first step with "Output 0 of _ToTorchTensor is a view
and is being modified inplace". `own_output` hands on a copy instead: both executors
register it on the modules they make parallel, the fx one only where the traced graph
shows a write (`written_in_place`), so a layer whose readers only read pays no copy.

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

import torch
import torch.fx as fx

from executor.styles import MeanOverRanks, Reshard

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


def _opaque(module) -> bool:
    """A module the graph calls without showing its code: a leaf the tracer kept whole
    (an attention block, torch's TransformerEncoderLayer, a user's leaf), not one of
    torch.nn's one-op layers (whose only write is `inplace`) nor the executor's own."""
    if isinstance(module, (Reshard, MeanOverRanks)):
        return False
    return (next(module.children(), None) is not None
            or not type(module).__module__.startswith("torch.nn."))


def _writes_in_place(node: fx.Node, gm: fx.GraphModule, unseen: bool) -> bool:
    if node.op == "call_module":
        module = gm.get_submodule(str(node.target))
        return bool(getattr(module, "inplace", False)) or (unseen and _opaque(module))
    if node.op == "call_function" and node.target in _IN_PLACE_OPERATORS:
        return True
    name = _name(node)
    if node.op not in ("call_function", "call_method"):
        return False
    if node.kwargs.get("inplace") is True:  # F.relu(x, inplace=True): Inception, DenseNet
        return True
    if name in _IN_PLACE_DUNDERS:  # x.__iadd__(y), x.__setitem__(i, y)
        return True
    return name.endswith("_") and not name.endswith("__")


def written_in_place(node: fx.Node, gm: fx.GraphModule, unseen: bool = False) -> bool:
    """Whether any op writes in place into `node`'s output or into a view of it; with
    `unseen`, a module whose code the graph does not show (`_opaque`) counts as one that
    may."""
    seen, stack = set(), [node]
    while stack:
        for user in stack.pop().users:
            if user in seen:
                continue
            seen.add(user)
            if _writes_in_place(user, gm, unseen):
                return True
            if user.op in ("call_function", "call_method") and _name(user) in _ALIASING:
                stack.append(user)
    return False


def own_output(module, args, output):
    """Forward hook: a module's output as a tensor of its own where it is a view (DTensor's
    `to_local` hands on one, which autograd forbids writing in place; see the module
    docstring), else as it is."""
    if isinstance(output, torch.Tensor) and output._is_view():
        return output.clone()
    return output


def own_written_outputs(gm: fx.GraphModule, paths: Iterable[str]) -> set[str]:
    """Register `own_output` on the modules of `gm` at `paths` whose output some op writes
    in place (or a view of it), or may (a module whose code the graph does not show reads
    it); returns their paths. A module called more than once is hooked once, when any of
    its calls' outputs is written."""
    paths, hooked = set(paths), set()
    for node in gm.graph.nodes:
        target = str(node.target)
        if (node.op == "call_module" and target in paths and target not in hooked
                and written_in_place(node, gm, unseen=True)):
            gm.get_submodule(target).register_forward_hook(own_output)
            hooked.add(target)
    return hooked


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
