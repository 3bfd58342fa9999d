"""`train_step`: one optimizer step of a planned model on a global batch, for every rank."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from executor.batch import shard_batch
from planner.plan import Plan


def train_step(model: nn.Module, plan: Plan, batch: Sequence, loss_fn: Callable,
               optimizer: torch.optim.Optimizer) -> float:
    """Forward, backward and update on `batch` (the global batch `(inputs..., targets...)`,
    or this rank's part of it as `shard_batch` returns), under `plan`. Returns the loss
    averaged over the whole global batch, the same number on every rank.

    Each rank's loss is a mean over its own rows, and every rank holds as many rows, so the
    global mean is the mean of the ranks' losses (the gradients already are: see
    executor.styles.MeanOverRanks).
    """
    parts = shard_batch(plan, batch)
    n = len(plan.inputs)
    loss = loss_fn(model(*parts[:n]), *parts[n:])
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    optimizer.step()
    value = loss.detach().clone()
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(value)
        value /= dist.get_world_size()
    return float(value)
