"""The traced model as the planner sees it: layers in execution order, with shapes and costs.

A layer is one node of the torch.fx graph that yields a tensor: a leaf module call (its
`name` is the module path, e.g. "classifier.1"), a function or a tensor method (its `name`
is the fx node's name, e.g. "flatten"), or a model input ("placeholder").
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field, replace

import torch
import torch.fx


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: str
    nbytes: int
    # how dim 0 holds the batch, where the tracer knows it (torch.export at a second
    # batch size, profiler.row_factors): 1: dim 0 is the batch; k > 1: the batch's rows with k
    # entries each, one row's together (OPT's `reshape(-1, hidden)`: batch x tokens;
    # BLOOM's attention: batch x heads); 0: dim 0 is not the batch (a table, a mask, a
    # size that equals the batch by chance). None: not known (torch.fx graphs), a dim 0
    # equal to the batch is taken for it (`rows_in_dim0`)
    row_factor: int | None = None

    @staticmethod
    def of(t: torch.Tensor, row_factor: int | None = None) -> "TensorMeta":
        return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                          t.numel() * t.element_size(), row_factor)

    def has_rows(self, batch: int) -> bool:
        return rows_in_dim0(self.shape, batch, self.row_factor)

    @property
    def feature_dim(self) -> int:
        """The dim a feature-sharded layout splits: channels of an NCHW map, else the last."""
        return 1 if len(self.shape) == 4 else len(self.shape) - 1


def rows_in_dim0(shape, batch: int, row_factor: int | None) -> bool:
    """Does dim 0 of a tensor of `shape` carry the `batch` rows, alone or merged with the
    dims after it (`TensorMeta.row_factor`)? Splitting dim 0 evenly then splits the
    batch: each rank's part is its rows' entries, as the model's own code makes them from
    its rows. A plan's layer carries the same two (LayerPlan.output_shape, .row_factor)."""
    if row_factor is None:
        return bool(shape) and shape[0] == batch
    return row_factor > 0 and bool(shape) and shape[0] == batch * row_factor


@dataclass(frozen=True)
class Layer:
    name: str  # module path for modules, fx node name otherwise
    node: str  # fx node name
    op: str  # placeholder | call_module | call_function | call_method
    kind: str  # module class name, or function / method name
    inputs: tuple[str, ...]  # fx node names of the layers whose outputs it reads
    output: TensorMeta
    module_type: type | None = None  # for call_module: the class, for the strategy registry
    attrs: dict = field(default_factory=dict)  # shape facts strategies need (features, ...)
    # parameters: `params` names (as the root model's named_parameters() does) every
    # trainable parameter this layer reads, its own module's or a bare one (a cls_token, a
    # position table); `param_bytes` / `param_count` count those it *owns*, the ones no
    # earlier layer read, so that a parameter several layers use (tied embeddings) is
    # counted once in memory and its gradient reduced once
    param_bytes: int = 0
    param_count: int = 0
    params: tuple[str, ...] = ()
    # filled by profiler.profile:
    fwd_flops: int = 0
    bwd_flops: int = 0
    measured_s: float | None = None  # forward + backward, at `measured_batch` rows
    measured_batch: int | None = None
    # forward + backward timed at the shapes a `measured_parts`-way split gives it, over
    # `shards_batch` rows (the whole batch): "whole" (unsplit), "out" (output features /
    # channels split), "in" (input features split); filled for Linear and Conv2d layers
    # when timed here
    measured_shards: dict = field(default_factory=dict)
    measured_parts: int | None = None
    shards_batch: int | None = None
    # bytes autograd keeps for backward that this layer produced (its output where some
    # op saves it, what it makes and saves inside), per byte of its output, measured on
    # the traced forward (profiler.saved); None: not measured
    saved_per_output: float | None = None
    # of that, the storages only the layers reading its output save (profiler.saved), per
    # byte of its output: what a layout change before every reader replaces by its copy
    # (strategies.step_memory.replaced_bytes); None: not measured
    users_saved_per_output: float | None = None

    @property
    def is_input(self) -> bool:
        return self.op == "placeholder"

    @property
    def activation_bytes(self) -> float:
        """The bytes this layer keeps for backward: measured (`saved_per_output`) where
        it was, else its output. A ratio to the output, so that a layer re-sized to a
        microbatch's rows or a precision's activation bytes keeps the same share."""
        if self.saved_per_output is None:
            return self.output.nbytes
        return self.output.nbytes * self.saved_per_output


def count_once(layers: list[Layer], model: torch.nn.Module) -> list[Layer]:
    """The layers with `param_bytes` / `param_count` of the parameters each owns: the
    first layer (in execution order) that reads a parameter owns it."""
    sizes = {name: (p.numel(), p.numel() * p.element_size())
             for name, p in model.named_parameters()}
    seen: set[str] = set()
    out = []
    for layer in layers:
        owned = [n for n in layer.params if n not in seen and n in sizes]
        seen.update(owned)
        out.append(replace(layer, param_count=sum(sizes[n][0] for n in owned),
                           param_bytes=sum(sizes[n][1] for n in owned)))
    return out


def canonical_names(model: torch.nn.Module) -> dict[int, str]:
    """{id(parameter): its name in model.named_parameters()}: one name per parameter,
    however many modules hold it (a tied embedding is named where it is first held)."""
    return {id(p): name for name, p in model.named_parameters()}


@dataclass(frozen=True)
class ModelGraph:
    model_name: str
    layers: tuple[Layer, ...]
    outputs: tuple[str, ...]  # fx node names whose values the model returns
    batch_size: int
    fingerprint: str  # profiler.trace.fingerprint of the traced module
    # the traced module itself, for profile() to run layers; not part of the value
    module: torch.fx.GraphModule | None = field(default=None, compare=False, repr=False)
    example_kwargs: dict = field(default_factory=dict, compare=False, repr=False)
    tracer: str = "fx"  # "fx" (profiler.trace) or "export" (profiler.export_trace)
    # export graphs: the model's transformer blocks (profiler.blocks), where a pipeline may
    # cut, or why it may not; per layer node the innermost module that ran it ("": the root)
    blocks: tuple[str, ...] = ()
    no_blocks_why: str = ""
    scopes: dict = field(default_factory=dict, compare=False, repr=False)
    # the module classes an export graph kept whole, so that a re-export groups the same way
    units: tuple[type, ...] = field(default=(), compare=False, repr=False)
    # a step with the backward split as zero-bubble pipeline schedules split it, over one
    # with a plain backward, measured on this machine (profiler.whole_step); 1.0 unmeasured
    split_backward: float = 1.0
    # the forward's share of a training step's forward + backward, measured on this
    # machine (profiler.whole_step.forward_share); a third unmeasured (a matmul's backward
    # is two products of its forward's size)
    forward_share: float = 1 / 3

    def __post_init__(self):
        object.__setattr__(self, "_by_node", {layer.node: layer for layer in self.layers})

    def layer(self, node: str) -> Layer:
        return self._by_node[node]

    @property
    def param_bytes(self) -> int:
        return sum(layer.param_bytes for layer in self.layers)

    def readers(self, node: str) -> int:
        """How many inputs of layers read this layer's output (a layer reading it twice
        counts twice: each is an edge of the plan)."""
        counts = self.__dict__.get("_readers")
        if counts is None:
            counts = collections.Counter(n for layer in self.layers for n in layer.inputs)
            object.__setattr__(self, "_readers", counts)
        return counts[node]

    def carries_gradient(self, node: str) -> bool:
        """Does a gradient flow back into this layer's output? Only where a trainable
        parameter lies upstream of it: not into a model input, an integer or boolean value
        (token ids, a mask), nor a float made from buffers and constants alone (a rotary
        cos/sin table from `inv_freq`), whose layout change therefore has no backward half."""
        carrying = self.__dict__.get("_carrying")
        if carrying is None:
            carrying = set()
            for layer in self.layers:  # execution order: inputs come first
                floating = layer.output.dtype.startswith(("float", "bfloat", "complex"))
                if floating and not layer.is_input and (
                        layer.params or any(n in carrying for n in layer.inputs)):
                    carrying.add(layer.node)
            object.__setattr__(self, "_carrying", frozenset(carrying))
        return node in carrying

    def tied_groups(self) -> list[tuple[str, ...]]:
        """Layers (by node) that share a parameter, joined transitively: each group must
        treat its parameters as one unit (one strategy, one gradient reduction)."""
        parent: dict[str, str] = {}

        def root(node: str) -> str:
            while parent.get(node, node) != node:
                node = parent[node]
            return node

        first: dict[str, str] = {}  # parameter -> the first layer reading it
        for layer in self.layers:
            for name in layer.params:
                if name in first:
                    parent[root(layer.node)] = root(first[name])
                else:
                    first[name] = layer.node
        groups: dict[str, list[str]] = {}
        for layer in self.layers:
            if layer.node in parent or any(parent.get(n) == layer.node for n in parent):
                groups.setdefault(root(layer.node), []).append(layer.node)
        return [tuple(g) for g in groups.values() if len(g) > 1]
