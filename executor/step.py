"""`train_step`: one training step under any plan, returning the global mean loss.

A pipelined plan cannot keep the user's loop unchanged (the schedule owns forward and
backward), so every plan kind trains through this one call:

    model = executor.parallelize(model, plan)           # this rank's module or stage
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for batch in loader:                                 # (inputs..., targets...), global
        loss = executor.train_step(model, plan, batch, loss_fn, opt)

`batch` is the whole global batch on every rank: its first len(plan.positional_inputs)
entries are the model's inputs, the rest the targets; `loss_fn(output, *targets)` is a
mean over rows. Keyword inputs the plan was traced with (`attention_mask=`) go in
`forward_kwargs`, whole: each rank takes its rows of them as of the positional ones.

The parallelized model already runs its forward in the plan's precision (autocast, fp32
outputs: executor.precision), so the loss is fp32. Under fp16-mixed the step also scales
the loss: fp16's 5-bit exponent flushes small gradients to zero without it. The scaler
(executor.precision.LossScaler: GradScaler's rule, agreed across ranks so that every rank
skips the same steps) is kept per optimizer across steps.

The ranks of a pipeline stage of parameter-free layers hold no parameters, and torch's
optimizers refuse an empty list: give them `list(model.parameters()) or [{"params": []}]`
(as executor.train does).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from executor.batch import shard_batch, shard_keywords
from executor.precision import LossScaler
from planner.handback import output_whole
from planner.plan import Plan


def train_step(model: torch.nn.Module, plan: Plan, batch: Sequence, loss_fn: Callable,
               optimizer: torch.optim.Optimizer, *, forward_kwargs: dict | None = None) -> float:
    """Forward, backward, gradient sync and optimizer step over the global `batch`; the
    loss returned is the mean over all its rows, the same on every rank. `forward_kwargs`:
    keyword arguments of every forward, as the plan was traced with (`use_cache=False`,
    or a whole batch's `attention_mask`, split by rows here: executor.batch.shard_keywords)."""
    if not isinstance(batch, (tuple, list)):
        raise ValueError("batch: pass a tuple (inputs..., targets...) of the global batch")
    if plan.context_parallel is not None:  # a loss over split sequences needs their counts
        raise ValueError("train_step: a context-parallel plan's loss is a sum over each "
                         "rank's tokens (executor.context_parallel.token_loss); write the "
                         "step as that module's docstring shows: shard_batch(plan, (ids, "
                         "shift_labels(ids))), token_loss(model(ids).logits, labels)")
    scaler = loss_scaler(optimizer, plan)
    optimizer.zero_grad()
    if plan.is_mesh_3d:
        # an fx stage is a graph of tensors; a decoder's stages pass use_cache=False
        # themselves (executor.hf_stages) and take nothing else
        if forward_kwargs and not (plan.tracer == "export"
                                   and forward_kwargs == {"use_cache": False}):
            raise ValueError(f"forward_kwargs: a pipelined plan takes none, got "
                             f"{sorted(forward_kwargs)}; plan with mesh='1d'")
        loss = _step_3d(model, plan, batch, loss_fn, scaler)
    else:
        loss = _step_1d(model, plan, batch, loss_fn, scaler, forward_kwargs or {})
    if scaler is None:
        optimizer.step()
    else:
        scaler.step(optimizer)  # skipped, on every rank, where a gradient overflowed
    return loss


_SCALERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def loss_scaler(optimizer: torch.optim.Optimizer, plan: Plan):
    """The loss scaler `optimizer` trains with under the plan's precision: None unless it
    scales the loss (fp16-mixed); one per optimizer, kept across steps."""
    if not plan.training_precision.loss_scaling:
        return None
    scaler = _SCALERS.get(optimizer)
    if scaler is None:
        scaler = _SCALERS[optimizer] = LossScaler()
    return scaler


def _scaled(loss: torch.Tensor, scaler) -> torch.Tensor:
    return loss if scaler is None else scaler.scale(loss)


def _step_1d(model, plan: Plan, batch, loss_fn, scaler=None, forward_kwargs=None) -> float:
    local = shard_batch(plan, batch)
    n = len(plan.positional_inputs)
    loss = loss_fn(model(*local[:n], **shard_keywords(plan, forward_kwargs or {})),
                   *local[n:])
    _scaled(loss, scaler).backward()
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


def _step_3d(model, plan: Plan, batch, loss_fn, scaler=None) -> float:
    positional = plan.positional_inputs
    n = len(positional)
    dp_rank, tp_rank = model.dp_rank, model.tp_rank
    inputs = [_microbatches(plan, x.to(model.device), dp_rank, tp_rank,
                            split_tp=positional[i].layout == "batch")
              for i, x in enumerate(batch[:n])]
    whole = output_whole(plan)  # the output and targets, whole over tp (planner.handback)
    targets = [_microbatches(plan, y.to(model.device), dp_rank, tp_rank, split_tp=not whole)
               for y in batch[n:]]
    m = plan.microbatches
    losses: list[torch.Tensor] = []
    if model.schedule is None:  # one pipeline rank
        chunks_in = [x.chunk(m) for x in inputs]
        chunks_t = [y.chunk(m) for y in targets]
        for j in range(m):
            loss = loss_fn(model(*(c[j] for c in chunks_in)), *(c[j] for c in chunks_t))
            _scaled(loss / m, scaler).backward()
            losses.append(loss.detach())
    else:
        losses = model.run_schedule(inputs, targets, loss_fn, scaler)
    model.sync_gradients()

    total = torch.zeros((), device=model.device)
    if model.is_last:
        total += torch.stack(losses).mean()
        if scaler is not None and model.pp > 1:  # the schedule kept the scaled losses
            total /= scaler.scale_value
    dist.all_reduce(total)
    return total.item() / (plan.mesh.size("dp") * plan.mesh.size("tp"))
