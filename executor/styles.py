"""How each planned strategy is applied to a module, and the layout changes between layers.

Linear layers use PyTorch's own parallel styles (`ColwiseParallel`, `RowwiseParallel`, through
executor.transformer_styles, whose subclasses also take GPT-2's Conv1D), told
the layout their input arrives in so that DTensor issues the collective the plan costed
(an all-gather forward and reduce-scatter backward for a row-split input, say). A Conv2d
split by output channels has no PyTorch style; `ChannelParallelConv2d` is ours, built on
DTensor placements the same way.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, RowwiseParallel

from strategies.layouts import Layout, Placement


def feature_dim(shape) -> int:
    """The dim a feature-split layout splits (see profiler.graph.TensorMeta.feature_dim)."""
    return 1 if len(shape) == 4 else len(shape) - 1


def placement(p: Placement, shape) -> Shard | Replicate | Partial:
    """A layout's placement as a DTensor placement, for a tensor of this (global) shape."""
    if p == Placement.SHARD_BATCH:
        return Shard(0)
    if p == Placement.SHARD_FEATURE:
        return Shard(feature_dim(shape))
    if p == Placement.SHARD_SEQUENCE:
        return Shard(1)
    return Replicate() if p == Placement.REPLICATE else Partial()


class Reshard(nn.Module):
    """Turn an activation from the producer's layout into the consumer's, forward and
    backward, with DTensor's redistribute (the collectives `strategies.layouts` prices)."""

    def __init__(self, mesh: DeviceMesh, src: Layout, dst: Layout, shape):
        super().__init__()
        self.mesh = mesh
        self.src, self.dst = placement(src.forward, shape), placement(dst.forward, shape)
        self.dst_grad = placement(dst.grad, shape)
        self.shape, self.stride = torch.Size(shape), _contiguous_stride(shape)
        self.label = f"{src.value} -> {dst.value}"

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d = DTensor.from_local(x, self.mesh, [self.src], run_check=False,
                               shape=self.shape, stride=self.stride)
        # a view made inside an autograd Function, which autograd forbids writing in place:
        # the executors copy it where a later op does (executor.view_outputs.own_output)
        return d.redistribute(self.mesh, [self.dst]).to_local(grad_placements=[self.dst_grad])

    def extra_repr(self) -> str:
        return self.label


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(list(shape)):
        stride.append(acc)
        acc *= size
    return tuple(reversed(stride))


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


class MeanOverRanks(nn.Module):
    """Identity forward; backward scales the gradient by 1/ranks.

    Every rank's loss is a mean over its own rows, and the global loss is the mean of those
    (as under DDP). Scaling the output gradient once here makes every gradient reduction
    downstream a plain sum, for data- and model-parallel weights alike.
    """

    def __init__(self, ranks: int):
        super().__init__()
        self.scale = 1.0 / ranks

    def forward(self, x):
        return _ScaleGrad.apply(x, self.scale) if torch.is_grad_enabled() else x


class ChannelParallelConv2d(ParallelStyle):
    """Split a Conv2d's output channels across the mesh: weight and bias Shard(0), input
    replicated (arriving in `input_layout`, its gradient returned partial), output split by
    channel (Shard(1)), as a plain local tensor.

        parallelize_module(model, mesh, {"features.3": ChannelParallelConv2d(Shard(0))})
    """

    def __init__(self, input_layout=Replicate(), output_layout=Shard(1)):
        super().__init__()
        self.input_layout, self.output_layout = input_layout, output_layout

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Conv2d) or module.groups != 1:
            raise ValueError(f"channel_parallel applies to a Conv2d with groups=1, got {module}")
        for name, param in list(module.named_parameters(recurse=False)):
            dparam = nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)]),
                                  requires_grad=param.requires_grad)
            module.register_parameter(name, dparam)
        layout, out_layout = self.input_layout, self.output_layout

        def forward(x: torch.Tensor) -> torch.Tensor:
            full = DTensor.from_local(x, mesh, [layout], run_check=False)
            local = full.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])
            bias = module.bias.to_local() if module.bias is not None else None
            y = module._conv_forward(local, module.weight.to_local(), bias)
            if out_layout == Shard(1):
                return y
            # handed on in another layout (to code outside modules, which cannot change it)
            y = DTensor.from_local(y, mesh, [Shard(1)], run_check=False)
            return y.redistribute(mesh, [out_layout]).to_local()

        module.forward = forward
        return module


_STYLES: dict = {}


def register_style(strategy: str, factory) -> None:
    """Say how a strategy of your own is applied: `factory(module, input_placement,
    output_placement)` returns a torch ParallelStyle for that module, e.g.::

        register_style("my_split", lambda m, i, o: MyStyle(input_layouts=i, output_layouts=o))
    """
    _STYLES[strategy] = factory


def tensor_parallel_style(strategy: str, output_layout: Layout, input_placement,
                          output_shape, module: nn.Module | None = None) -> ParallelStyle:
    """The parallel style for a model-parallel layer, its input arriving in `input_placement`."""
    from executor.transformer_styles import Conv1DColwise, Conv1DRowwise, HeadParallelAttention
    from strategies.transformer import attention_spec

    out = placement(output_layout.forward, output_shape)
    if strategy in _STYLES:
        return _STYLES[strategy](module, input_placement, out)
    base = strategy.split(":")[0]
    if base in _STYLES:  # a strategy whose name carries options: "expert_parallel:ep2"
        return _STYLES[base](module, input_placement, out, strategy)
    if strategy == "column_parallel":
        return Conv1DColwise(input_layouts=input_placement, output_layouts=out)
    if strategy == "row_parallel":
        return Conv1DRowwise(input_layouts=input_placement, output_layouts=out)
    if strategy == "channel_parallel":
        return ChannelParallelConv2d(input_placement, out)
    if strategy == "vocab_parallel":
        return RowwiseParallel(input_layouts=input_placement, output_layouts=out)
    if strategy == "head_parallel":
        spec = attention_spec(module)
        if spec is None:
            raise ValueError(f"head_parallel: {type(module).__name__} is not registered; call "
                             f"strategies.register_attention({type(module).__name__}, ...)")
        return HeadParallelAttention(spec, input_placement, out)
    raise ValueError(f"no tensor-parallel style for strategy {strategy!r}; register one with "
                     f"executor.register_style")


def summed_params(plan) -> set[str]:
    """Parameters whose layers split the activation, so that each rank's gradient is a
    partial sum to add up over the group: data-parallel layers (rows) and sequence-parallel
    ones (tokens). The latter run as plain modules on their tokens, as Megatron-SP does:
    torch's SequenceParallel style would leave their gradients Partial DTensors, summed
    each time the optimizer reads them (AdamW: 3 all-reduces per weight per step, outside
    DDP's buckets)."""
    return ((params_of(plan, "data_parallel") | params_of(plan, "sequence_parallel"))
            - dead_params(plan))


def dead_params(plan) -> set[str]:
    """Parameters no gradient reaches: read only by layers from which no path leads to the
    model's outputs (SqueezeBERT's pooler under its masked-LM head: computed, never used).
    DDP waits for a gradient of every parameter it syncs, and its second step raised
    "Expected to have finished reduction in the prior iteration". Where an output is not
    a layer of the plan (it cannot tell), none."""
    live = set(plan.outputs)
    if not live or live - {l.node for l in plan.layers} - {i.name for i in plan.inputs}:
        return set()
    for layer in reversed(plan.layers):
        if layer.node in live:
            live.update(layer.inputs)
    used = {name for layer in plan.layers if layer.node in live for name in layer.params}
    return {name for layer in plan.layers for name in layer.params} - used


def sum_gradients_hook(state, bucket):
    """DDP communication hook: sum gradients across ranks (MeanOverRanks already divided)."""
    import torch.distributed as dist

    work = dist.all_reduce(bucket.buffer(), group=state, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def params_of(plan, strategy: str) -> set[str]:
    """Names of the parameters read by the plan's layers that run `strategy`: a layer's
    own module's and bare ones alike. Layers sharing a parameter run one strategy (the
    planner ties them), so each parameter lands in one set."""
    return {name for layer in plan.layers if layer.strategy == strategy for name in layer.params}


def broadcast_replicated(module: nn.Module, names: set[str]) -> None:
    """Replicated layers compute identically everywhere: start them from rank 0's weights."""
    import torch.distributed as dist

    for name, param in module.named_parameters():
        if name in names:
            dist.broadcast(param.data, src=0)


def data_parallel_over(module: nn.Module, synced: set[str]) -> nn.Module:
    """DDP over the parameters named in `synced` only (the data-parallel layers'), their
    gradients summed; the rest (model-parallel, sharded, replicated) and every buffer are
    left to their own strategies. Returns `module` itself when nothing is data-parallel or
    the group is one rank."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    if not synced or dist.get_world_size() == 1:
        # one rank sums nothing: DDP would only add its hooks and bucket copies
        return module
    # every name a parameter goes by: DDP checks each module's own name for it, so a tied
    # weight left whole (replicated) must be ignored under its alias too (lm_head.weight
    # beside transformer.wte.weight), or DDP all-reduces its complete gradient
    kept = {id(p) for name, p in module.named_parameters() if name in synced}
    ignored = [name for name, p in module.named_parameters(remove_duplicate=False)
               if id(p) not in kept]
    ignored += [name for name, _ in module.named_buffers()]
    # DDP names a parameter of the root module ".name" when it builds its buckets
    # (f"{module_name}.{param_name}" with module_name ""): ignore both spellings, or a
    # bare parameter of the root (a position table) is all-reduced though it is whole
    ignored += [f".{name}" for name in ignored if "." not in name]
    DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, ignored)
    ddp = DistributedDataParallel(module, device_ids=None)
    ddp.register_comm_hook(None, sum_gradients_hook)
    return ddp
