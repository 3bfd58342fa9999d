"""`train_step`: one training step under any plan, returning the global mean loss.

A pipelined plan cannot keep the user's loop unchanged (the schedule owns forward and
backward), so every plan kind trains through this one call:

    model = executor.parallelize(model, plan)           # this rank's module or stage
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in loader:                                 # (inputs..., targets...), global
        loss = executor.train_step(model, plan, batch, loss_fn, opt)

`batch` is the whole global batch on every rank: its first len(plan.inputs) entries are the
model's inputs, the rest the targets; `loss_fn(output, *targets)` is a mean over rows.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from executor.batch import shard_batch
from planner.plan import Plan


def train_step(model: torch.nn.Module, plan: Plan, batch: Sequence, loss_fn: Callable,
               optimizer: torch.optim.Optimizer) -> float:
    """Forward, backward, gradient sync and optimizer step over the global `batch`; the
    loss returned is the mean over all its rows, the same on every rank."""
    if not isinstance(batch, (tuple, list)):
        raise ValueError("batch: pass a tuple (inputs..., targets...) of the global batch")
    optimizer.zero_grad()
    if plan.is_mesh_3d:
        loss = _step_3d(model, plan, batch, loss_fn)
    else:
        loss = _step_1d(model, plan, batch, loss_fn)
    optimizer.step()
    return loss


def _step_1d(model, plan: Plan, batch, loss_fn) -> float:
    local = shard_batch(plan, batch)
    n = len(plan.inputs)
    loss = loss_fn(model(*local[:n]), *local[n:])
    loss.backward()
    value = loss.detach().clone()
    dist.all_reduce(value)
    return value.item() / dist.get_world_size()


def _microbatches(plan: Plan, value: torch.Tensor, dp_rank: int, tp_rank: int,
                  split_tp: bool) -> torch.Tensor:
    """This rank's rows of every microbatch, in microbatch order: the dp replica's rows cut
    into microbatches, each cut by tp rank when the layout splits rows over tp."""
    from executor.pipeline import microbatch_rows

    if value.shape[:1] != (plan.global_batch,):
        raise ValueError(f"batch: an entry has {value.shape[0] if value.dim() else 0} rows, "
                         f"the plan was made for a global batch of {plan.global_batch}")
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    mine = value.chunk(dp)[dp_rank]
    parts = mine.split(microbatch_rows(plan))
    if split_tp:
        parts = [p.chunk(tp)[tp_rank] for p in parts]
    return torch.cat(parts)


def _step_3d(model, plan: Plan, batch, loss_fn) -> float:
    n = len(plan.inputs)
    dp_rank, tp_rank = model.dp_rank, model.tp_rank
    inputs = [_microbatches(plan, x.to(model.device), dp_rank, tp_rank,
                            split_tp=plan.inputs[i].layout == "batch")
              for i, x in enumerate(batch[:n])]
    targets = [_microbatches(plan, y.to(model.device), dp_rank, tp_rank, split_tp=True)
               for y in batch[n:]]
    m = plan.microbatches
    losses: list[torch.Tensor] = []
    if model.pp == 1:
        chunks_in = [x.chunk(m) for x in inputs]
        chunks_t = [y.chunk(m) for y in targets]
        for j in range(m):
            loss = loss_fn(model(*(c[j] for c in chunks_in)), *(c[j] for c in chunks_t))
            (loss / m).backward()
            losses.append(loss.detach())
    else:
        schedule = getattr(model, "_schedule", None)
        if schedule is None:
            from executor.pipeline import MULTI_STAGE, SCHEDULE_CLASSES

            def pipeline_loss(output, target):
                return loss_fn(output, target)

            name = plan.pipeline.schedule
            stages = model._pipeline_stages
            schedule = SCHEDULE_CLASSES[name](
                stages if name in MULTI_STAGE else stages[0], n_microbatches=m,
                loss_fn=pipeline_loss)
            model._schedule = schedule
        if len(targets) > 1:
            raise ValueError("batch: a pipelined plan takes one target tensor")
        kwargs = {"target": targets[0], "losses": losses} if model.has_last else {}
        schedule.step(*(inputs if model.has_first else ()), **kwargs)
    model.sync_gradients()

    total = torch.zeros((), device=model.device)
    if model.is_last:
        total += torch.stack(losses).mean()
    dist.all_reduce(total)
    return total.item() / (plan.mesh.size("dp") * plan.mesh.size("tp"))
