"""`shard_batch`: this rank's part of a global batch, as the plan wants its inputs."""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from executor.context_parallel import shard_for_plan
from planner.handback import output_whole
from planner.plan import Plan


class RankBatch(tuple):
    """This rank's part of a global batch, already split as `shard_batch` splits it (what
    `executor.data.rank_batches` yields, so a rank never loads rows it does not use);
    `shard_batch` passes it through unchanged."""


def shard_batch(plan: Plan, batch: Sequence, rank: int | None = None) -> tuple:
    """Split a global batch `(inputs..., targets...)` for this rank (a `RankBatch` is
    already split and passes through).

    The first len(plan.positional_inputs) entries are the model's inputs: each is split by
    rows where the plan says `batch`, and passed whole where it says `replicate` (the plan
    starts model-parallel). The rest (targets) are split by rows, as the model's outputs
    are, or passed whole where the rows do not split evenly over the devices
    (planner.handback). Keyword inputs: `shard_keywords`. Under a context-parallel plan
    every entry is (rows, seq, ...): its replica's rows and this rank's chunks of every
    sequence (executor.context_parallel.shard_for_plan; targets as shift_labels(ids)).
    """
    if isinstance(batch, RankBatch):
        return tuple(batch)
    if not isinstance(batch, (tuple, list)):
        batch = (batch,)
    world = plan.num_devices
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    if plan.context_parallel is not None:
        return tuple(shard_for_plan(plan, value, rank) for value in batch)
    inputs = plan.positional_inputs
    out = []
    for i, value in enumerate(batch):
        if i < len(inputs):
            whole = inputs[i].layout == "replicate"
        else:  # a target: as the model's output is handed back (planner.handback)
            whole = output_whole(plan)
        out.append(_rows_of(plan, value, whole, rank, f"entry {i}"))
    return tuple(out)


def shard_keywords(plan: Plan, kwargs: dict, rank: int | None = None) -> dict:
    """This rank's part of the keyword inputs of a forward: one the plan traced as an input
    (`InputPlan.keyword`, a padding mask `attention_mask=`) split by rows where its layout
    says `batch`; any other (`use_cache=False`) passed as it is."""
    if rank is None:
        rank = dist.get_rank() if dist.is_initialized() else 0
    layouts = {i.name: i.layout for i in plan.inputs if i.keyword}
    return {k: _rows_of(plan, v, layouts[k] == "replicate", rank, f"keyword {k!r}")
            if k in layouts else v for k, v in kwargs.items()}


def _rows_of(plan: Plan, value, whole: bool, rank: int, what: str):
    if not isinstance(value, torch.Tensor):
        return value
    if value.shape[:1] != (plan.global_batch,):
        raise ValueError(
            f"shard_batch: {what} has {value.shape[0] if value.dim() else 0} rows, the "
            f"plan was made for a global batch of {plan.global_batch}; pass the whole "
            f"global batch on every rank, or re-plan with this batch")
    return value if whole else value.chunk(plan.num_devices)[rank]
