"""The per-layer strategies, what each costs, and the registry that says which apply where.

A strategy is a small frozen dataclass: the layout it takes, the layout it gives, and a
`cost` method. Costs are per device, for one training step of the whole global batch over
a 1-D group of `ranks` devices: compute (forward + backward), the collectives the layer
issues itself (gradient all-reduce, a row-parallel output reduction) and memory (weights,
gradients, optimizer state and the activations kept for backward: Layer.activation_bytes,
what autograd was measured to keep, shared as the output is). Layout changes *between*
layers are priced on the edges by `strategies.edges`.

The registry maps a layer to its candidates: `register(ModuleType, *strategies)` lets a user
add strategies for their own module types; a layer nobody knows is replicated, which is
always correct.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from torch import nn

from profiler.graph import Layer
from strategies import gpu_compute
from strategies.cluster import Cluster
from strategies.collectives import (
    all_gather_s, all_reduce_s, bucketed_all_reduce_s, collective_bytes, collective_time_s,
    reduce_scatter_s,
)
from strategies.layouts import Layout, sequence_splits
from strategies.precision import Precision
from strategies.rowwise import featurewise_binary, keeps_rows

OPTIMIZER_STATE_FACTOR = {"sgd": 0, "sgd_momentum": 1, "adam": 2, "adamw": 2}
# Words (of the master weights' element size) one parameter's update reads and writes in
# torch's own (single-tensor and foreach) implementations, which run one pass per op:
# sgd: param += -lr * grad (3); sgd_momentum: buf *= m (2), buf += grad (3), param +=
# buf (3); adam: exp_avg.lerp_ (3), exp_avg_sq.mul_ (2) .addcmul_ (3), sqrt (2), / bias
# correction (2), + eps (2), param.addcdiv_ (4); adamw adds param *= 1 - lr * wd (2). A
# fused Adam makes one pass (7 words); the default is not fused. Checked on an H100: a
# 953 M-parameter AdamW step (foreach) took 27.4 ms of kernels, 86 bytes a parameter at
# the measured copy bandwidth, against 80 counted here (benchmarks/results/gpu-h100.txt).
OPTIMIZER_UPDATE_WORDS = {"sgd": 3, "sgd_momentum": 8, "adam": 18, "adamw": 20}


@dataclass(frozen=True)
class CostContext:
    """What every cost needs besides the layer: the devices and the training setup."""

    cluster: Cluster
    ranks: int
    batch: int
    optimizer: str = "adam"

    @property
    def link(self):
        return self.cluster.link(self.ranks)

    @property
    def state_factor(self) -> int:
        return OPTIMIZER_STATE_FACTOR[self.optimizer]

    @property
    def precision(self) -> Precision:
        return self.cluster.training_precision


@dataclass(frozen=True)
class Cost:
    compute_s: float
    communication_s: float
    memory_bytes: float
    update_s: float = 0.0  # the optimizer's step over this device's weights
    notes: dict = field(default_factory=dict)  # figures explain() quotes

    @property
    def time_s(self) -> float:
        return self.compute_s + self.communication_s + self.update_s


def compute_s(layer: Layer, fraction: float, ctx: CostContext, split: str = "batch") -> float:
    """Forward + backward time of `fraction` of the layer's work on one device, `split` the
    way the work is divided ("batch" rows, "out" or "in" features, "feature" of a
    parameter-free op, "shard": heads or table rows, whose rank holds `fraction` of the
    weights too and does `fraction` of the work, as rows). Measured where the layer was
    timed here at that very shape (the data-parallel rows, a model-parallel shard, or
    whole), scaled from the nearest measurement otherwise, by shape on a GPU that has a
    `GPUShape` (strategies.gpu_compute), else a roofline over FLOPs and bytes moved."""
    if layer.is_input:
        return 0.0
    # forward writes the output once, backward reads it and writes its gradient
    moved = 3 * layer.output.nbytes * fraction
    # processes sharing the machine: parameter-free ops are memory-bound, the rest compute
    slowdown = (memory_contention(moved, ctx) if not layer.params
                else ctx.cluster.compute_slowdown)
    if layer.measured_s is not None:
        if split in ("batch", "shard") or round(1 / fraction) == 1:
            return rows_s(layer, ctx.batch * fraction) * slowdown
        if split in layer.measured_shards and layer.measured_parts == round(1 / fraction):
            # a feature shard runs every one of the context's rows, its time following
            # the whole layer's from the batch it was timed at to those rows
            timed_at = rows_s(layer, layer.shards_batch)
            along = (rows_s(layer, ctx.batch) / timed_at if timed_at > 0
                     else ctx.batch / layer.shards_batch)
            return layer.measured_shards[split] * along * slowdown
        return layer.measured_s * fraction * ctx.batch / layer.measured_batch * slowdown
    device = ctx.cluster.device
    if device.shape is not None and not device.op_flops:  # a GPU priced by its GEMM shapes
        return gpu_compute.layer_s(layer, fraction, split, device, ctx.cluster.compute_dtype,
                                   ctx.cluster.levers) * slowdown
    flops = (layer.fwd_flops + layer.bwd_flops) * fraction
    rate = device.op_flops.get(layer.kind.lower()) or device.achievable_flops(
        ctx.cluster.compute_dtype)
    return max(flops / rate, moved / device.memory_bandwidth_bytes_per_s) * slowdown


def dtensor_overhead_s(ctx: CostContext, weight_bytes: float) -> float:
    """What running a layer of `weight_bytes` (its whole weight) through DTensor's parallel
    styles costs beyond its math and collectives: where `hyplan calibrate` timed
    tensor-parallel pairs on this link, their fit ("tp_layer", a fixed part and a part per
    weight byte); else the tiny Linear's fixed figure (0 when not calibrated)."""
    if ctx.ranks <= 1:
        return 0.0
    if "tp_layer" in ctx.link.collectives:
        return collective_time_s("tp_layer", weight_bytes, ctx.ranks, ctx.link)
    return ctx.cluster.dtensor_layer_overhead_s


def split_compute_s(layer: Layer, ctx: CostContext, split: str = "batch") -> float:
    """A layer split over the ranks by a DTensor parallel style, as the executor runs every
    model-parallel strategy: its 1/ranks share of the work (`split` as in compute_s) and
    DTensor's per-layer cost for its weights (`dtensor_overhead_s`)."""
    return compute_s(layer, 1 / ctx.ranks, ctx, split) + dtensor_overhead_s(ctx, layer.param_bytes)


def weights_memory(param_bytes: float, ctx: CostContext, sharded: bool = False) -> float:
    """Weights, their gradients and the optimizer's state, as the precision keeps them
    (strategies.precision: fp32 masters, and autocast's low-precision copy unless FSDP2
    `sharded` them)."""
    return ctx.precision.weights_bytes(param_bytes, ctx.state_factor, sharded)


def rows_s(layer: Layer, rows: float) -> float:
    """Forward + backward of the whole layer on `rows` rows, from its timings on this
    machine: the data-parallel rows (`measured_batch`) and, for a leaf module with
    weights (profiler.profile.measure_shards), the whole batch (`shards_batch`). With
    both, on the line through them (a layer with weights has a part that does not shrink
    with its rows: reading its weights, writing their gradient), below the fewer rows no
    cheaper than in proportion and no dearer than there; with one, in proportion to it.
    A pipeline's microbatch or a 3-D plan's dp group runs rows that neither timing had.
    Priced at the whole batch's timing, the stages of a 2-stage pipeline of a small CNN
    came out 1.6x their measured compute; in proportion below the data-parallel rows, a
    4096-wide Linear on 4 microbatches of 8 rows 0.55x (measured here, 1 thread: 58.9 ms
    at 8 rows, 64.3 at 16, 80.5 at 32)."""
    points = {layer.measured_batch: layer.measured_s}
    if "whole" in layer.measured_shards and layer.shards_batch:
        points[layer.shards_batch] = layer.measured_shards["whole"]
    if rows in points:
        return points[rows]
    (lo, t_lo), (hi, t_hi) = min(points.items()), max(points.items())
    if lo == hi:
        return t_lo * rows / lo
    line = t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
    if rows < lo:
        return min(t_lo, max(t_lo * rows / lo, line))
    if rows > hi:
        return t_hi * rows / hi
    return line


def memory_contention(moved_bytes: float, ctx: CostContext) -> float:
    """How much slower streaming `moved_bytes` runs while every process on the machine
    streams as much: the measured memory slowdown once their data together spills the
    shared cache (DeviceSpec.cache_bytes), none while it fits."""
    cluster = ctx.cluster
    cache = cluster.device.cache_bytes
    if cache and moved_bytes * cluster.devices_per_node <= cache:
        return 1.0
    return cluster.memory_slowdown


def memory_s(moved_bytes: float, ctx: CostContext) -> float:
    """Seconds to stream `moved_bytes` through memory, all processes streaming at once."""
    bandwidth = ctx.cluster.device.memory_bandwidth_bytes_per_s
    return moved_bytes / bandwidth * memory_contention(moved_bytes, ctx)


def update_s(param_bytes: float, ctx: CostContext) -> float:
    """The optimizer's step is memory-bound: each of its ops reads and writes weights,
    gradients or state (OPTIMIZER_UPDATE_WORDS)."""
    return memory_s(param_bytes * OPTIMIZER_UPDATE_WORDS[ctx.optimizer], ctx)


@dataclass(frozen=True)
class Strategy:
    """Base: a way to run one layer over the group. Subclasses set name, takes and gives."""

    name: ClassVar[str] = ""
    takes: Layout = Layout.BATCH
    gives: Layout = Layout.BATCH
    model_parallel: ClassVar[bool] = False  # splits the weights (what explain() calls it)
    # FSDP2 shards its weights, gradients and optimizer state over the group (ZeRO-3)
    shards_weights: ClassVar[bool] = False

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        return True

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        raise NotImplementedError


@dataclass(frozen=True)
class DataParallel(Strategy):
    """Weights replicated, batch split by rows, gradients all-reduced after backward."""

    name: ClassVar[str] = "data_parallel"
    takes: Layout = Layout.BATCH
    gives: Layout = Layout.BATCH

    def applies(self, layer, ctx):
        return ctx.batch % ctx.ranks == 0 and _rowwise(layer, ctx.batch)

    def cost(self, layer, ctx):
        """Its compute on its rows, and no collective per microbatch: the gradient sync is
        once a step over the replicas of the shape, which planner.price charges
        (gradient_sync); the notes give it over this group, as explain and the
        calibration read it."""
        sync = gradient_sync(layer.param_bytes, ctx.ranks, ctx.link, ctx)
        memory = weights_memory(layer.param_bytes, ctx) + layer.activation_bytes / ctx.ranks
        return Cost(compute_s(layer, 1 / ctx.ranks, ctx), 0.0, memory,
                    update_s(layer.param_bytes, ctx),
                    {"gradient_bytes": layer.param_bytes,
                     "gradient_all_reduce_s": sync.all_reduce_s,
                     "bucket_copies_s": sync.copies_s, "communication_bytes": sync.sent_bytes})


@dataclass(frozen=True)
class GradientSync:
    """DDP's sync of one layer's gradients in a step: its share of the bucketed all-reduce,
    the copies into the flat bucket and back out, and the bytes it sends."""

    all_reduce_s: float
    copies_s: float
    sent_bytes: float


def gradient_sync(param_bytes: float, replicas: int, link, ctx: CostContext) -> GradientSync:
    """The one price of data parallelism's gradient sync: DDP's bucketed all-reduce of the
    layer's gradients (in the reduce dtype) over `replicas`, and its two copies, a read
    and a write each, into its flat buckets and back out."""
    if replicas <= 1 or not param_bytes:
        return GradientSync(0.0, 0.0, 0.0)
    return GradientSync(
        bucketed_all_reduce_s(ctx.precision.reduce_bytes(param_bytes), replicas, link),
        memory_s(2 * 2 * param_bytes, ctx),
        collective_bytes("all_reduce", param_bytes, replicas))


@dataclass(frozen=True)
class Replicate(Strategy):
    """Every device runs the whole layer on the whole batch: always correct, never fast."""

    name: ClassVar[str] = "replicate"
    takes: Layout = Layout.REPLICATE
    gives: Layout = Layout.REPLICATE

    def cost(self, layer, ctx):
        memory = weights_memory(layer.param_bytes, ctx) + layer.activation_bytes
        return Cost(compute_s(layer, 1.0, ctx), 0.0, memory, update_s(layer.param_bytes, ctx))


@dataclass(frozen=True)
class FeatureParallel(Strategy):
    """A parameter-free op applied to each feature (channel) on its own follows a
    feature-split input: each device works on its own features."""

    name: ClassVar[str] = "feature_parallel"
    takes: Layout = Layout.FEATURE
    gives: Layout = Layout.FEATURE

    def applies(self, layer, ctx):
        return _featurewise(layer) and _features(layer) % ctx.ranks == 0

    def cost(self, layer, ctx):
        return Cost(compute_s(layer, 1 / ctx.ranks, ctx, "feature"), 0.0,
                    layer.activation_bytes / ctx.ranks)


@dataclass(frozen=True)
class ColumnParallel(Strategy):
    """Split a Linear's output features (or a Conv2d's output channels) across the devices,
    Megatron's column split: takes the whole batch replicated, gives a feature-split output;
    the input gradient comes back partial, so the edge into it reduces it."""

    name: ClassVar[str] = "column_parallel"
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.REPLICATE_PARTIAL_GRAD
    gives: Layout = Layout.FEATURE

    def applies(self, layer, ctx):
        return _linear_out(layer) % ctx.ranks == 0 and layer.attrs.get("groups", 1) == 1

    def cost(self, layer, ctx):
        local = layer.param_bytes / ctx.ranks
        memory = weights_memory(local, ctx) + layer.activation_bytes / ctx.ranks
        return Cost(split_compute_s(layer, ctx, "out"), 0.0, memory, update_s(local, ctx))


@dataclass(frozen=True)
class ChannelParallel(ColumnParallel):
    """Output-channel split of a Conv2d: each device computes its channels of the whole batch."""

    name: ClassVar[str] = "channel_parallel"


@dataclass(frozen=True)
class RowParallel(Strategy):
    """Split a Linear's input features across the devices (Megatron's row split): each
    device multiplies its features, and the partial outputs are summed, by an all-reduce
    (gives the output replicated) or a reduce-scatter (gives it split by rows, or by
    tokens for sequence-parallel norms: strategies.sequence)."""

    name: ClassVar[str] = "row_parallel"
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.FEATURE
    gives: Layout = Layout.REPLICATE

    def applies(self, layer, ctx):
        ok = layer.attrs.get("in_features", 0) % ctx.ranks == 0
        return ok and (self.gives != Layout.BATCH or _rows_split(layer, ctx)) and (
            self.gives != Layout.SEQUENCE or sequence_splits(layer, ctx.batch, ctx.ranks))

    def cost(self, layer, ctx):
        n = layer.output.nbytes
        if self.gives in (Layout.BATCH, Layout.SEQUENCE):
            # forward reduce-scatter; backward gathers the row-split gradient
            comm = reduce_scatter_s(n, ctx.ranks, ctx.link) + all_gather_s(n, ctx.ranks, ctx.link)
            sent = (collective_bytes("reduce_scatter", n, ctx.ranks)
                    + collective_bytes("all_gather", n, ctx.ranks))
            kept = layer.activation_bytes / ctx.ranks
        else:
            comm = all_reduce_s(n, ctx.ranks, ctx.link)
            sent = collective_bytes("all_reduce", n, ctx.ranks)
            kept = layer.activation_bytes
        local = layer.param_bytes / ctx.ranks
        memory = weights_memory(local, ctx) + kept
        return Cost(split_compute_s(layer, ctx, "in"), comm, memory, update_s(local, ctx),
                    {"output_reduction_s": comm, "output_bytes": n, "communication_bytes": sent})


# --- which layers are which --------------------------------------------------------------

_POINTWISE_MODULES = (
    nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU,
    nn.Hardswish, nn.Mish, nn.Identity, nn.Dropout, nn.Dropout1d, nn.Dropout2d,
)
_CHANNEL_MODULES = (nn.MaxPool1d, nn.MaxPool2d, nn.AvgPool1d, nn.AvgPool2d,
                    nn.AdaptiveAvgPool1d, nn.AdaptiveAvgPool2d, nn.AdaptiveMaxPool2d)
_ROWWISE_MODULES = _POINTWISE_MODULES + _CHANNEL_MODULES + (
    nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.Flatten, nn.LayerNorm, nn.GroupNorm,
    nn.Embedding, nn.Softmax, nn.LogSoftmax,
)
# Not here: BatchNorm. In training it normalizes over the whole batch and updates its
# running statistics from it, so splitting rows changes the math. It runs replicated (the
# whole batch on every rank, the same statistics everywhere). torch's SyncBatchNorm would
# split it exactly, but it runs on GPUs only, and the executor is tested on CPU.
# unary ops only: a binary op may meet a whole (unsplit) tensor such as a bias
_POINTWISE_FUNCTIONS = {
    "relu", "relu_", "gelu", "silu", "tanh", "sigmoid", "dropout", "contiguous",
    "leaky_relu", "hardswish", "clone",
}
def _rowwise(layer: Layer, batch: int) -> bool:
    """Rows of the batch stay independent and in place (so splitting by rows is exact)."""
    if layer.module_type is None:
        return keeps_rows(layer, batch)
    known = issubclass(layer.module_type, _ROWWISE_MODULES) or _flagged(layer, _ROWWISE)
    return known and layer.output.has_rows(batch)


def _featurewise(layer: Layer) -> bool:
    """A parameter-free op that treats each feature (channel) on its own."""
    if layer.params:
        return False
    if layer.module_type is not None:
        return (issubclass(layer.module_type, _POINTWISE_MODULES + _CHANNEL_MODULES + (nn.Flatten,))
                or _flagged(layer, _FEATUREWISE))
    return layer.kind in _POINTWISE_FUNCTIONS | {"flatten"} or featurewise_binary(layer)


def _rows_split(layer: Layer, ctx: CostContext) -> bool:
    """The output's dim 0 holds the batch and splits evenly: a reduce-scatter may hand each
    rank its rows (of a tensor without the batch in dim 0 it would split something else)."""
    return layer.output.has_rows(ctx.batch) and ctx.batch % ctx.ranks == 0


def _features(layer: Layer) -> int:
    shape = layer.output.shape
    return shape[layer.output.feature_dim] if len(shape) > 1 else 0


def _linear_out(layer: Layer) -> int:
    return layer.attrs.get("out_features", layer.attrs.get("out_channels", 0))


# --- the registry ------------------------------------------------------------------------

_REGISTRY: dict[type | str, tuple[Strategy, ...]] = {}
_ROWWISE: set[type | str] = set()  # module types whose batch rows stay independent
_FEATUREWISE: set[type | str] = set()  # parameter-free, each feature on its own
_LEAVES: set[type | str] = set()  # traced as one layer (fx does not look inside)
_EVERY_LAYER: list[Strategy] = []  # offered to every layer, its `applies` deciding


def offer_everywhere(strategy: Strategy) -> None:
    """Offer `strategy` to every layer, module or op (strategies.sequence's)."""
    _EVERY_LAYER.append(strategy)


def register(module_type: type | str, *strategies: Strategy, rowwise: bool = False,
             featurewise: bool = False, leaf: bool = False) -> None:
    """Offer `strategies` for layers of `module_type` (and its subclasses), in addition to
    the data-parallel and replicated strategies every row-wise layer gets.

    `module_type` is a class, or its qualified name ("transformers.pytorch_utils.Conv1D")
    so that hyplan need not import the library that defines it. `rowwise`: its batch rows
    stay independent (it may be data-parallel). `featurewise`: parameter-free and each
    feature on its own (it may follow a feature-split input). `leaf`: trace it as one
    layer (attention blocks whose strategy shards the whole block). Each strategy's name
    must have an executor style (`executor.register_style`), e.g.::

        register(MyAttention, HeadParallel(), rowwise=True, leaf=True)
    """
    _REGISTRY[module_type] = _REGISTRY.get(module_type, ()) + tuple(strategies)
    for flag, group in ((rowwise, _ROWWISE), (featurewise, _FEATUREWISE), (leaf, _LEAVES)):
        if flag:
            group.add(module_type)


def matches(module_type: type, key: type | str) -> bool:
    """`module_type` is `key` (a class or a qualified class name) or a subclass of it."""
    if isinstance(key, type):
        return issubclass(module_type, key)
    return any(f"{t.__module__}.{t.__qualname__}" == key for t in module_type.__mro__)


def _flagged(layer: Layer, group: set) -> bool:
    return any(matches(layer.module_type, key) for key in group)


_UNIT_FINDERS: list = []  # model -> None, each registering the module types it recognises


def find_units(finder) -> None:
    """Have `finder(model)` register the module types of a model it recognises by their
    shape, not their class name, before `unit_types` lists them (strategies.experts: the
    experts of every mixture-of-experts family)."""
    _UNIT_FINDERS.append(finder)


def unit_types(model: nn.Module) -> tuple[type, ...]:
    """The module classes in `model` the registry knows (strategies, row-wise or leaf):
    torch.export's front end keeps each such module whole as one layer. Mixture-of-experts
    experts modules are found by their shape and registered first (`find_units`)."""
    for finder in _UNIT_FINDERS:
        finder(model)
    keys = set(_REGISTRY) | _ROWWISE | _FEATUREWISE | _LEAVES
    types = {type(m) for m in model.modules()}
    return tuple(t for t in types if any(matches(t, key) for key in keys))


def leaf_types(model: nn.Module) -> tuple[type, ...]:
    """The module classes in `model` registered with `leaf=True`, for the tracer."""
    types = {type(m) for m in model.modules()}
    return tuple(t for t in types if any(matches(t, key) for key in _LEAVES))


register(nn.Linear, ColumnParallel(), RowParallel(), RowParallel(gives=Layout.BATCH),
         RowParallel(gives=Layout.SEQUENCE))
register(nn.Conv2d, ChannelParallel())


def candidates(layer: Layer, ctx: CostContext) -> list[Strategy]:
    """The strategies that apply to `layer` on this group. On one device, just one: plain
    training (data-parallel over one rank), or replicate where rows are not independent."""
    if layer.is_input:  # the user hands each rank its rows, or the whole batch
        options: list[Strategy] = [DataParallel(), Replicate()]
    else:
        options = [DataParallel(), Replicate()]
        if layer.module_type is not None:
            for module_type, extra in _REGISTRY.items():
                if matches(layer.module_type, module_type) and _keeps_forward(
                        layer.module_type, module_type):
                    options.extend(extra)
        options.append(FeatureParallel())
        options.extend(_EVERY_LAYER)
    usable = [s for s in options
              if (_batch_ok(layer, ctx) if isinstance(s, DataParallel) else s.applies(layer, ctx))]
    if layer.params and layer.op != "call_module":
        # an op reading a bare parameter (a cls_token, a position table) holds it whole:
        # its gradient is then a per-rank partial (rows split) or complete (replicated)
        usable = [s for s in usable if type(s) in (DataParallel, Replicate)]
    if layer.op == "call_module" and not layer.inputs and layer.output.has_rows(ctx.batch):
        # traced with no input, it makes its rows from the arguments the model's code hands
        # it (BART's learned positions: an arange as long as its input_ids), which are each
        # rank's rows where they split: it runs on them. Planned replicated, its weight's
        # gradient was each rank's share, never summed; vocab-parallel, its style took
        # those rows for all of them
        usable = ([s for s in usable if s.gives == Layout.BATCH and not s.model_parallel]
                  or [s for s in usable if type(s) is Replicate])
    return usable[:1] if ctx.ranks == 1 else usable


def _keeps_forward(module_type: type, key: type | str) -> bool:
    """Does `module_type` run the forward of the class its strategies were registered for?
    A subclass with a forward of its own may build what the base layer reads from other
    arguments, and a parallel style converts only the first: OPT's learned positions (an
    Embedding) are called `(attention_mask, past, position_ids=...)` and embed the
    keyword, and vocab-parallel on them met a plain tensor beside its DTensor weight."""
    return not isinstance(key, type) or module_type.forward is key.forward


def _batch_ok(layer: Layer, ctx: CostContext) -> bool:
    if layer.is_input:
        return ctx.batch % ctx.ranks == 0 and layer.output.has_rows(ctx.batch)
    return DataParallel().applies(layer, ctx)
