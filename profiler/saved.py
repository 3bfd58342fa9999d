"""What autograd keeps for backward, per layer, measured rather than assumed.

A layer is often said to keep its output for backward, and often does not: a Linear
keeps its input, a ReLU its output, an in-place ReLU the very storage the BatchNorm before
it made, a tanh GELU written out (Hugging Face's `NewGELUActivation`) four tensors of its
output's size, a view none of its own. So the traced graph's forward is run once, on fake
tensors of a device's kind (nothing is allocated; the kernel a device picks decides what
it saves), under `torch.autograd.graph.saved_tensors_hooks`, node by node, and every
tensor autograd saves is recorded by its storage: a storage is held once however many
views of it are saved, and it is held whole (a saved slice keeps its whole storage
alive).

Each storage's bytes go to the layer that *produced* it (the first node whose output it
is), so that a layer's figure is what its output costs wherever it is kept; a storage
made inside a node and saved there (a module's intermediate, a norm's statistics) goes to
that node. Storages of parameters, buffers and constants are the weights' and are left
out. What is counted is what is still saved when the forward has ended, the start of the
backward (a tensor saved by a branch whose result nobody reads is freed with it), and what
the forward returns, which the training step holds until then (the logits the loss reads:
strategies.step_memory.loss_held_bytes prices what the loss adds to them).

The figure is kept as bytes per byte of the layer's output (`Layer.saved_per_output`), so
that wherever a layer is re-sized, to a microbatch's rows or to a precision's activation
bytes, its kept bytes follow its output's (`Layer.activation_bytes`).

Of that figure, the storages only the layers reading it save (its output kept by a
Linear, a norm or an activation after it, never by the layer itself) are recorded apart
(`Layer.users_saved_per_output`): where a plan changes the layout between the layer and
every reader, each reader saves the copy the change makes instead
(strategies.step_memory.reshard_copy_bytes), and those storages are freed after the
forward reads them. Measured (benchmarks/memory.py, GPT-2 4 layers, tensor plan on 2
ranks): at the peak no storage of c_fc's output nor of the GELU's is alive, only the
all-gathered copy the GELU saves and the cloned shard c_proj saves.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import replace

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree


class _Saved:
    """What a pack hook hands autograd in place of the tensor: alive exactly as long as
    autograd keeps the saved tensor (a weak reference to it tells)."""

    __slots__ = ("tensor", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


class SavedByLayer:
    """Records, while a forward runs inside it, each saved tensor's storage and the layer
    it belongs to. Call `produced` with each node's output (`layer`: the layer node it
    belongs to, None for parameters, buffers and constants) as the nodes run, with
    `running` naming the layer of the node being run; `totals()` after the forward."""

    def __init__(self):
        self.running: str | None = None
        self._owner: dict[int, str | None] = {}  # storage -> layer node (None: weights)
        self._kept: list = []  # the storages seen: alive, so no key is reused
        # (holder, storage, bytes, the layer that saved it)
        self._saved: list[tuple[weakref.ref, int, int, str | None]] = []
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    def produced(self, value, layer: str | None) -> None:
        """Storages in `value` not seen before belong to `layer`."""
        for t in pytree.tree_leaves(value):
            if isinstance(t, torch.Tensor):
                self._own(t, layer)

    def _own(self, t: torch.Tensor, layer: str | None) -> int:
        key = _storage_key(t)
        if key not in self._owner:
            self._owner[key] = layer
            self._kept.append(t.untyped_storage())
        return key

    def _pack(self, t: torch.Tensor):
        holder = _Saved(t)
        key = self._own(t, self.running)
        self._saved.append((weakref.ref(holder), key, t.untyped_storage().nbytes(),
                            self.running))
        return holder

    @staticmethod
    def _unpack(holder: _Saved) -> torch.Tensor:
        return holder.tensor

    def totals(self, returned=()) -> Saved:
        """{layer node: bytes of the storages it produced that autograd still keeps, or
        that the forward `returned`}, each storage once; `.by_users`: of those, the
        storages only other layers save (none saved by the layer that made it, none
        returned)."""
        kept = [(lambda: True, self._own(t, self.running), t.untyped_storage().nbytes(), None)
                for t in pytree.tree_leaves(returned) if isinstance(t, torch.Tensor)]
        out, savers, sizes = Saved(), {}, {}
        for ref, key, nbytes, saver in self._saved + kept:
            if ref() is None:
                continue
            # a returned storage is held by the step: as if its maker kept it
            savers.setdefault(key, set()).add(saver if saver is not None
                                              else self._owner.get(key))
            sizes[key] = nbytes
        for key, nbytes in sizes.items():
            layer = self._owner.get(key)
            if layer is None:
                continue
            out[layer] = out.get(layer, 0) + nbytes
            if layer not in savers[key]:
                out.by_users[layer] = out.by_users.get(layer, 0) + nbytes
        return out


class Saved(dict):
    """{layer node: saved bytes it produced}, and `by_users`: the part only the layers
    reading its output save (SavedByLayer.totals)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.by_users: dict[str, int] = {}


class _Recording(fx.Interpreter):
    """An fx Interpreter that tells `recorder` which layer each node runs for and what it
    produced; `layer_of(node)` names it (None: a parameter, buffer or constant)."""

    def __init__(self, module: fx.GraphModule, recorder: SavedByLayer,
                 layer_of: Callable[[fx.Node], str | None], run: Callable | None = None):
        super().__init__(module)
        self.recorder, self.layer_of, self._run = recorder, layer_of, run

    def run_node(self, n: fx.Node):
        layer = self.layer_of(n)
        self.recorder.running = layer
        result = self._run(self, n) if self._run is not None else super().run_node(n)
        self.recorder.produced(result, layer)
        return result


def run_recorded(module: fx.GraphModule, inputs: list, layer_of, weights=(),
                 run: Callable | None = None) -> Saved:
    """{layer node: saved bytes it produced} of one forward of `module` on `inputs`;
    `weights`: tensors (parameters, buffers) whose storages are no layer's; `run(interp,
    node)`: how to run a node, where the Interpreter's own way does not do."""
    recorder = SavedByLayer()
    for w in weights:
        recorder.produced(w, None)
    with recorder, torch.enable_grad():
        result = _Recording(module, recorder, layer_of, run).run(*inputs)
        totals = recorder.totals(result)
    del result
    return totals


def first_layer(node: fx.Node, layer_of: Callable[[fx.Node], str | None]) -> str | None:
    """The layer `node` runs for (`layer_of`), or where it is part of none (a tuple-valued
    op: an LSTM, a `max` with its indices), the first layer that reads what it made."""
    layer = layer_of(node)
    if layer is not None:
        return layer
    for user in node.users:
        layer = first_layer(user, layer_of)
        if layer is not None:
            return layer
    return None


def per_output(saved: dict[str, int], layers) -> dict[str, float]:
    """{layer node: saved bytes per byte of its output} (`Layer.saved_per_output`); a layer
    with an empty output is left out (its figure stays the output's, 0). Where `saved` is
    a run's Saved, the result's `by_users` holds the same ratio of the part only its readers
    save (`Layer.users_saved_per_output`)."""
    ratios = Ratios({l.node: saved.get(l.node, 0) / l.output.nbytes for l in layers
                     if l.output.nbytes > 0})
    by_users = getattr(saved, "by_users", None)
    if by_users is not None:
        ratios.by_users = {l.node: by_users.get(l.node, 0) / l.output.nbytes for l in layers
                           if l.output.nbytes > 0}
    return ratios


class Ratios(dict):
    """per_output's {layer node: ratio}, with `by_users` (None: not measured)."""

    by_users: dict[str, float] | None = None


def with_saved(layers, ratios: dict[str, float]) -> list:
    """`layers` with their measured `saved_per_output` and `users_saved_per_output` (None
    where not measured)."""
    by_users = getattr(ratios, "by_users", None) or {}
    return [replace(l, saved_per_output=ratios.get(l.node),
                    users_saved_per_output=by_users.get(l.node)) for l in layers]
