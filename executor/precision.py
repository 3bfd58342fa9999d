"""Run a plan in its precision (strategies.precision says what each tensor is kept and sent in).

- The forward runs under `torch.autocast(dtype)`: matmuls and convolutions in bf16 (or
  fp16) on fp32 master weights, whose gradients come back fp32. The module's floating
  outputs leave in fp32, so the user's loss is computed in fp32 (a bf16 cross-entropy over
  a large vocabulary loses the small differences training follows). A pipeline stage that
  is not the last hands its outputs on in the compute dtype instead: those are the bytes
  the plan priced for the send, and the explicit cast also tells the pipeline's shape
  inference (which runs on meta tensors, where CPU or CUDA autocast does not act) what
  arrives.
- FSDP2 layers get `MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32)`: weights
  all-gathered in the compute dtype, gradients reduce-scattered in fp32.
- DDP (executor.styles.sum_gradients_hook) reduces the gradients autocast leaves on the
  fp32 weights as they are: fp32, the plan's reduce dtype. DTensor's tensor-parallel
  reductions run in the activation's dtype, as priced.

The forward is replaced on the instance (as executor.levers does for recomputation), so
parameter names, state dicts and checkpoints are unchanged.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils import _pytree as pytree

from strategies.precision import Precision


def torch_dtype(name: str) -> torch.dtype:
    return getattr(torch, name)


def run_in_precision(module: nn.Module, precision: Precision, device_type: str,
                     last: bool = True) -> nn.Module:
    """From now on `module`'s forward runs under autocast at `precision`; its floating
    outputs leave in fp32 (`last`: they meet the loss) or else in the compute dtype."""
    if not precision.mixed:
        return module
    dtype = torch_dtype(precision.compute_dtype)
    if not torch.amp.is_autocast_available(device_type):
        raise ValueError(f"precision: {precision.name} needs torch.autocast on "
                         f"{device_type!r}, which this torch does not have; plan with "
                         f"precision='fp32'")
    out_dtype = torch.float32 if last else dtype
    forward = module.forward

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(out_dtype) if t.is_floating_point() else t

    def autocast_forward(*args, **kwargs):
        with torch.autocast(device_type, dtype=dtype):
            output = forward(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, cast, output)

    module.forward = autocast_forward
    return module


def fsdp_policy(precision: Precision):
    """FSDP2's MixedPrecisionPolicy for `precision` (None in fp32: FSDP's own default)."""
    if not precision.mixed:
        return None
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=torch_dtype(precision.compute_dtype),
                                reduce_dtype=torch_dtype(precision.reduce_dtype))



class LossScaler:
    """fp16-mixed's dynamic loss scaling, as `torch.amp.GradScaler` does it and with its
    constants (start at 2^16, halve on an overflow and skip the step, double after 2000
    clean steps), agreed over all ranks: torch 2.13's GradScaler and ShardedGradScaler stop
    on a model that mixes DTensor and plain gradients ("got mixed torch.Tensor and
    DTensor"), so this one unscales each gradient's local shard and finds overflows with
    one all-reduce, so that every rank skips the same steps."""

    def __init__(self, init_scale: float = 2.0**16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000):
        self.scale_value = init_scale
        self.growth_factor, self.backoff_factor = growth_factor, backoff_factor
        self.growth_interval = growth_interval
        self._clean_steps = 0

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale the gradients and step, unless some rank's overflowed; then update the
        scale. Returns whether the optimizer stepped."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        grads = [p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                 for group in optimizer.param_groups for p in group["params"]
                 if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        inverse = torch.full((), 1.0 / self.scale_value, dtype=torch.float32, device=device)
        overflow = torch.zeros((), dtype=torch.float32, device=device)
        for g in grads:
            overflow = torch.maximum(overflow, (~torch.isfinite(g)).any().float())
            g.mul_(inverse)
        if dist.is_initialized():
            dist.all_reduce(overflow, op=dist.ReduceOp.MAX)
        if overflow.item():
            self.scale_value *= self.backoff_factor
            self._clean_steps = 0
            return False
        optimizer.step()
        self._clean_steps += 1
        if self._clean_steps == self.growth_interval:
            self.scale_value *= self.growth_factor
            self._clean_steps = 0
        return True
