"""Parallel styles for the transformer strategies (strategies.transformer), on DTensor.

- `HeadParallelAttention`: Megatron's attention split. The q, k, v projections keep whole
  heads on each rank (a fused projection's weight is viewed as [3, width, ...] and split
  on the width, so each rank holds its heads' q, k and v); the output projection is split
  by input rows and its partial outputs are summed into the planned output layout. The
  module's own forward then runs on this rank's heads.
- `Conv1DColwise` / `Conv1DRowwise`: PyTorch's column and row styles for GPT-2's Conv1D,
  whose weight is a Linear's transposed.

Full parameters come back with `full_tensor()`; a fused projection's comes back viewed
[3, width, ...] and `.reshape(original shape)` restores it (see `full_parameters`).
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from executor.inputs import main_input


def _is_conv1d(module: nn.Module) -> bool:
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf")


def _shard(module: nn.Module, name: str, mesh: DeviceMesh, placement, shape=None) -> None:
    param = getattr(module, name)
    data = param.data if shape is None else param.data.reshape(shape)
    module.register_parameter(name, nn.Parameter(distribute_tensor(data, mesh, [placement]),
                                                 requires_grad=param.requires_grad))


class Conv1DColwise(ColwiseParallel):
    """ColwiseParallel for GPT-2's Conv1D: weight [in, out] split on dim 1, bias on dim 0."""

    def _apply(self, module, device_mesh):
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Replicate(),)

        def partition(name, mod, mesh):
            _shard(mod, "weight", mesh, Shard(1))
            _shard(mod, "bias", mesh, Shard(0))

        return distribute_module(
            module, device_mesh, partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


class Conv1DRowwise(RowwiseParallel):
    """RowwiseParallel for GPT-2's Conv1D: weight [in, out] split on dim 0, bias replicated."""

    def _apply(self, module, device_mesh):
        if not _is_conv1d(module):
            return super()._apply(module, device_mesh)
        self.desired_input_layouts = (Shard(-1),)

        def partition(name, mod, mesh):
            _shard(mod, "weight", mesh, Shard(0))
            _shard(mod, "bias", mesh, Replicate())

        return distribute_module(
            module, device_mesh, partition,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))


def _local(p):
    return p.to_local() if isinstance(p, DTensor) else p


class HeadParallelAttention(ParallelStyle):
    """Split an attention module's heads across the mesh (Megatron's attention split).

    Its hidden states arrive in `input_layout` and are made whole once (gradient returned
    partial); other tensor arguments split alike (a mask, rotary tables) are gathered
    whole; the output leaves in `output_layout` (Replicate: all-reduce, Shard(0) or, in
    sequence parallelism, Shard(1): reduce-scatter)::

        parallelize_module(model, mesh, {"h.0.attn": HeadParallelAttention(spec, Shard(0))})
    """

    def __init__(self, spec, input_layout=Replicate(), output_layout=Replicate()):
        super().__init__()
        self.spec, self.input_layout, self.output_layout = spec, input_layout, output_layout

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        spec, ranks = self.spec, mesh.size()
        if isinstance(spec.qkv, str):
            self._fused_qkv(module.get_submodule(spec.qkv), mesh)
        else:
            for name in spec.qkv:
                self._column(module.get_submodule(name), mesh)
        self._row(module.get_submodule(spec.out), mesh)
        for attr in spec.divide:
            setattr(module, attr, getattr(module, attr) // ranks)
        layout = self.input_layout

        def gather_inputs(mod, args, kwargs):
            where = main_input(args, kwargs)
            x = args[0] if where == 0 else kwargs[where]
            rest = args[1:] if where == 0 else args
            kwargs = {k: v for k, v in kwargs.items() if k != where}
            dim = layout.dim if isinstance(layout, Shard) and layout.dim in (0, 1) else None
            local = x.shape[dim] if dim is not None else None
            x = DTensor.from_local(x, mesh, [layout], run_check=False)
            x = x.redistribute(mesh, [Replicate()]).to_local(grad_placements=[Partial()])

            def whole(v):  # split alike (by rows, or by tokens in sequence parallelism)
                if (isinstance(v, torch.Tensor) and dim is not None and v.dim() > dim
                        and v.shape[dim] == local and local != x.shape[dim]):
                    return DTensor.from_local(v, mesh, [layout], run_check=False).full_tensor()
                if isinstance(v, tuple):
                    return tuple(whole(t) for t in v)
                return v

            kwargs = {k: whole(v) for k, v in kwargs.items()}
            if where == 0:
                return (x, *whole(rest)), kwargs
            return whole(rest), {**kwargs, where: x}

        module.register_forward_pre_hook(gather_inputs, with_kwargs=True)
        return module

    def _fused_qkv(self, proj: nn.Module, mesh):
        """One projection makes q, k, v: view its output dim as [3, width] and split width."""
        if _is_conv1d(proj):  # weight [in, 3w]
            n_in, n_out = proj.weight.shape
            _shard(proj, "weight", mesh, Shard(2), (n_in, 3, n_out // 3))
            _shard(proj, "bias", mesh, Shard(1), (3, n_out // 3))

            def forward(x):
                w, b = _local(proj.weight), _local(proj.bias)
                out = torch.addmm(b.reshape(-1), x.reshape(-1, x.shape[-1]), w.reshape(w.shape[0], -1))
                return out.view(*x.shape[:-1], -1)
        else:  # nn.Linear, weight [3w, in]
            n_out, n_in = proj.weight.shape
            _shard(proj, "weight", mesh, Shard(1), (3, n_out // 3, n_in))
            if proj.bias is not None:
                _shard(proj, "bias", mesh, Shard(1), (3, n_out // 3))

            def forward(x):
                b = None if proj.bias is None else _local(proj.bias).reshape(-1)
                return F.linear(x, _local(proj.weight).reshape(-1, n_in), b)
        proj.forward = forward

    def _column(self, proj: nn.Linear, mesh):
        _shard(proj, "weight", mesh, Shard(0))
        if proj.bias is not None:
            _shard(proj, "bias", mesh, Shard(0))
        proj.forward = lambda x: F.linear(x, _local(proj.weight), _local(proj.bias))

    def _row(self, proj: nn.Module, mesh):
        conv = _is_conv1d(proj)
        _shard(proj, "weight", mesh, Shard(0 if conv else 1))
        if proj.bias is not None:
            _shard(proj, "bias", mesh, Replicate())
        out_layout = self.output_layout

        def forward(x):
            w = _local(proj.weight)
            y = x @ w if conv else x @ w.t()
            y = DTensor.from_local(y, mesh, [Partial()], run_check=False)
            y = y.redistribute(mesh, [out_layout])
            if proj.bias is not None:
                y = y + proj.bias
            return y.to_local()
        proj.forward = forward


def full_parameters(module: nn.Module, like: dict[str, torch.Tensor] | None = None) -> dict:
    """{name: whole parameter} of a parallelized module, gathered from every rank; with
    `like` (a single-process model's parameters), in their shapes."""
    # DDP keeps the model as .module, a pipeline rank's StageModel its stage as .stage
    inner = getattr(module, "module", None) or getattr(module, "stage", None) or module
    out = {}
    for name, p in inner.named_parameters():
        full = (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
        key = name.replace("_checkpoint_wrapped_module.", "")
        if like is not None and key in like:
            full = full.reshape(like[key].shape)
        out[key] = full
    return out
