"""`shard_batch`: this rank's part of a global batch, as the plan wants its inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from planner.handback import output_whole
from planner.plan import Plan


class RankBatch(tuple):
    """This rank's part of a global batch, already split as `shard_batch` splits it (what
    `executor.data.rank_batches` yields, so a rank never loads rows it does not use);
    `shard_batch` passes it through unchanged."""


def shard_batch(plan: Plan, batch: Sequence, rank: int | None = None) -> tuple:
    """Split a global batch `(inputs..., targets...)` for this rank (a `RankBatch` is
    already split and passes through).

    The first len(plan.inputs) entries are the model's inputs: each is split by rows where
    the plan says `batch`, and passed whole where it says `replicate` (the plan starts
    model-parallel). The rest (targets) are split by rows, as the model's outputs are, or
    passed whole where the rows do not split evenly over the devices (planner.handback).
    """
    if isinstance(batch, RankBatch):
        return tuple(batch)
    if not isinstance(batch, (tuple, list)):
        batch = (batch,)
    world = plan.num_devices
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    out = []
    for i, value in enumerate(batch):
        if not isinstance(value, torch.Tensor):
            out.append(value)
            continue
        if value.shape[:1] != (plan.global_batch,):
            raise ValueError(
                f"shard_batch: entry {i} has {value.shape[0] if value.dim() else 0} rows, the "
                f"plan was made for a global batch of {plan.global_batch}; pass the whole "
                f"global batch on every rank, or re-plan with this batch")
        if i < len(plan.inputs):
            whole = plan.inputs[i].layout == "replicate"
        else:  # a target: as the model's output is handed back (planner.handback)
            whole = output_whole(plan)
        out.append(value if whole else value.chunk(world)[rank])
    return tuple(out)
