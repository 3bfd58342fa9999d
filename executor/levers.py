"""Apply the plan's memory levers to the modules that carry them, with PyTorch's own engine.

- `fsdp` layers: FSDP2 `fully_shard` on the layer's module over the whole mesh, one FSDP
  unit per layer (parameters, gradients and optimizer state sharded; all-gather before
  forward and backward, reduce-scatter of gradients). The executor's output-gradient
  scaling (MeanOverRanks) already divides by the world size, so FSDP2 sums
  (`set_gradient_divide_factor(1.0)`), as the DDP hook does for data-parallel layers.
  Under a mixed precision, FSDP2's MixedPrecisionPolicy: gathered in the compute dtype,
  gradients reduced in fp32 (executor.precision).
- recomputed layers: the module's forward runs under `torch.utils.checkpoint`
  (non-reentrant), so it keeps its input and recomputes its activations in backward.
  The forward is replaced on the instance, so parameter names stay as they were.
"""

from __future__ import annotations

from collections.abc import Iterable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint

from executor.precision import fsdp_policy
from strategies.precision import Precision


def checkpoint_module(module: nn.Module) -> None:
    """Run `module`'s forward under activation checkpointing from now on."""
    forward = module.forward

    def recomputed(*args, **kwargs):
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    module.forward = recomputed


def apply_levers(root: nn.Module, targets: Iterable[tuple[str, str, bool]],
                 mesh: DeviceMesh, precision: Precision | None = None) -> set[str]:
    """`targets`: (module path, strategy, recompute) per layer. Checkpoints the recomputed
    modules, fully_shards the fsdp ones (in `precision`, default fp32); returns the
    qualified names of the parameters FSDP now owns (data parallelism must leave them
    alone)."""
    owned: set[str] = set()
    policy = fsdp_policy(precision) if precision is not None else None
    extra = {"mp_policy": policy} if policy is not None else {}
    for path, strategy, recompute in targets:
        module = root.get_submodule(path)
        if recompute:
            checkpoint_module(module)
        if strategy == "fsdp":
            owned |= {f"{path}.{name}" for name, _ in module.named_parameters()}
            fully_shard(module, mesh=mesh, reshard_after_forward=True, **extra)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return owned
