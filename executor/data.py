"""Training data under a plan: which rows each step uses, and which of them each rank loads.

Step `s` always uses the same rows of the dataset (a seeded shuffle per epoch), whatever
the plan, the device count or how often the run was restarted: that is what makes a
resumed run, or one under another plan, equal an uninterrupted one. Each rank loads only
the rows its part of the batch needs (its contiguous share, as `shard_batch` splits; all
of them where the plan starts model-parallel on a replicated input).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, Sampler, default_collate

from executor.batch import RankBatch, shard_batch
from planner.plan import Plan


class SyntheticDataset(Dataset):
    """Random rows shaped like a model's example inputs and its output, the same for a
    given index on every rank and every run. For trying a plan without data: floats are
    standard normal, integers (token ids, class labels) uniform below `high`."""

    def __init__(self, rows: Sequence[torch.Tensor], highs: Sequence[int | None],
                 size: int, seed: int = 0):
        self.rows = [r.detach().cpu() for r in rows]
        self.highs = list(highs)
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[torch.Tensor, ...]:
        if not 0 <= index < self.size:
            raise IndexError(index)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        out = []
        for row, high in zip(self.rows, self.highs):
            if row.is_floating_point():
                out.append(torch.randn(row.shape, generator=g, dtype=row.dtype))
            else:
                out.append(torch.randint(0, high or 2, row.shape, generator=g, dtype=row.dtype))
        return tuple(out)


def synthetic_dataset(model: nn.Module, example_inputs: Sequence[torch.Tensor],
                      loss_fn: Callable, size: int, seed: int = 0, *,
                      forward_kwargs: dict | None = None) -> SyntheticDataset:
    """Rows like `example_inputs`, and targets the loss takes for the model's output.

    An integer input read by an `nn.Embedding` (token ids) is drawn below its
    `num_embeddings`, any other below the example's maximum + 1. The target is, in order of
    trial on one row: class indices over dim 1 for CrossEntropyLoss and NLLLoss; a tensor
    shaped like the output (its logits, for a Hugging Face ModelOutput); class indices over
    the output's last dim (a next-token loss over logits (batch, seq, vocab))."""
    one = [x[:1] for x in example_inputs]
    vocab: dict[int, int] = {}  # an input's storage -> rows of the Embedding that reads it

    def note_vocab(module, args):  # by storage: the model may read a view of the input
        if args and isinstance(args[0], torch.Tensor):
            vocab.setdefault(args[0].untyped_storage().data_ptr(), module.num_embeddings)

    hooks = [m.register_forward_pre_hook(note_vocab) for m in model.modules()
             if isinstance(m, nn.Embedding)]
    try:
        with torch.no_grad():
            out = model(*one, **(forward_kwargs or {}))
    finally:
        for hook in hooks:
            hook.remove()
    highs: list[int | None] = [
        None if x.is_floating_point()
        else vocab.get(r.untyped_storage().data_ptr(), int(x.max()) + 1)
        for x, r in zip(example_inputs, one)]
    inputs = [x[0] for x in example_inputs]
    target, high = _target_like(_logits(out), out, loss_fn)
    return SyntheticDataset(inputs + [target], highs + [high], size, seed)


def _logits(out):
    """The tensor a loss reads from a model's output: itself, a ModelOutput's `logits`, or
    the first tensor of a mapping or tuple."""
    if isinstance(out, torch.Tensor):
        return out
    logits = getattr(out, "logits", None)
    if isinstance(logits, torch.Tensor):
        return logits
    values = out.values() if isinstance(out, Mapping) else out
    found = next((v for v in values if isinstance(v, torch.Tensor)), None)
    if found is None:
        raise ValueError(f"synthetic data: the model returned {type(out).__name__} with no "
                         f"tensor to shape targets on; define dataset() in the model file")
    return found


def _target_like(logits: torch.Tensor, out, loss_fn: Callable) -> tuple[torch.Tensor, int | None]:
    """(one row's target template, its integer bound or None): see synthetic_dataset."""
    if isinstance(loss_fn, (nn.CrossEntropyLoss, nn.NLLLoss)):
        shape = logits.shape[2:] if logits.dim() > 2 else ()
        return torch.zeros(shape, dtype=torch.long), logits.shape[1]
    candidates = [(torch.zeros(logits.shape[1:], dtype=logits.dtype), None),
                  (torch.zeros(logits.shape[1:-1], dtype=torch.long), logits.shape[-1])]
    for target, high in candidates:
        try:
            with torch.no_grad():
                loss = loss_fn(out, target[None].expand(1, *target.shape))
        except (RuntimeError, ValueError, IndexError, TypeError):
            continue
        if isinstance(loss, torch.Tensor) and loss.numel() == 1:
            return target, high
    raise ValueError(f"synthetic data: {type(loss_fn).__name__} takes neither a target shaped "
                     f"like the output {tuple(logits.shape)} nor class indices over its last "
                     f"dim; define dataset() in the model file, returning (inputs..., target) rows")


def step_indices(size: int, global_batch: int, step: int, seed: int = 0) -> torch.Tensor:
    """The dataset rows global step `step` trains on: a seeded permutation per epoch, cut
    into global batches (a last partial batch of an epoch is dropped)."""
    per_epoch = size // global_batch
    if per_epoch == 0:
        raise ValueError(f"dataset: {size} rows cannot fill one global batch of "
                         f"{global_batch}; use a larger dataset or a smaller batch")
    epoch, within = divmod(step, per_epoch)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(seed + epoch))
    return order[within * global_batch:(within + 1) * global_batch]


class StepSampler(Sampler[list[int]]):
    """For steps start..stop-1, the dataset rows of each step that this rank loads."""

    def __init__(self, size: int, global_batch: int, rows: slice, start: int, stop: int,
                 seed: int = 0):
        self.size, self.global_batch, self.rows = size, global_batch, rows
        self.start, self.stop, self.seed = start, stop, seed

    def __len__(self) -> int:
        return max(0, self.stop - self.start)

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(self.start, self.stop):
            yield step_indices(self.size, self.global_batch, step, self.seed)[self.rows].tolist()


def rank_rows(plan: Plan, rank: int) -> slice:
    """The rows of a global batch this rank loads: its share, or all of them when some
    input is replicated (the plan starts model-parallel) or the plan is pipelined
    (executor.train_step cuts each rank's microbatches from the global batch)."""
    if plan.is_mesh_3d or any(i.layout == "replicate" for i in plan.inputs):
        return slice(None)
    share = torch.arange(plan.global_batch).chunk(plan.num_devices)[rank]
    return slice(int(share[0]), int(share[-1]) + 1)


def rank_batches(dataset: Dataset, plan: Plan, rank: int, start: int, stop: int,
                 seed: int = 0) -> Iterator[tuple]:
    """This rank's part of the global batch of each step start..stop-1 (a RankBatch), or
    for a pipelined plan the whole global batch (a tuple), as executor.train_step takes it."""
    rows = rank_rows(plan, rank)
    loader = DataLoader(dataset, batch_sampler=StepSampler(len(dataset), plan.global_batch,
                                                           rows, start, stop, seed))
    for batch in loader:
        batch = tuple(batch) if isinstance(batch, (tuple, list)) else (batch,)
        if plan.is_mesh_3d:
            yield batch
            continue
        if rows == slice(None):
            batch = shard_batch(plan, batch, rank)
        yield RankBatch(batch)


def global_batch(dataset: Dataset, plan_batch: int, step: int, seed: int = 0) -> tuple:
    """The whole global batch of step `step` (for single-process reference runs)."""
    idx = step_indices(len(dataset), plan_batch, step, seed)
    return tuple(default_collate([dataset[int(i)] for i in idx]))
