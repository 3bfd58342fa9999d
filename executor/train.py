"""`train`: the training loop under a plan, with sharded data, DCP checkpoints and resume.

Run it on every rank of a job that torchrun started (`hyplan train` does that), under a
1-D plan or a pipelined one (each stage's ranks save their own parameters; DCP merges them
into one checkpoint of the whole model, which any other plan can load). A run
restarted after a fault, or started again under another plan or device count, picks up
from the newest complete checkpoint and, because step `s` always trains on the same rows
(executor.data), ends with the parameters an uninterrupted run would have.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import Dataset

from executor import checkpoint
from executor.data import rank_batches
from executor.parallelize import parallelize
from executor.pipeline import StageModel
from executor.step import train_step
from planner.plan import Plan

if TYPE_CHECKING:
    from executor.monitor import Drift


@dataclass
class TrainResult:
    """What a run did: the parallel model and optimizer as they ended, where it started
    (0, or the step of the checkpoint it resumed from) and the global loss per step."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    start_step: int
    losses: dict[int, float] = field(default_factory=dict)
    resumed_from: Path | None = None
    drift: "Drift | None" = None  # the first steps timed against the plan (rank 0's view)


def make_optimizer(name: str, params: Iterable, lr: float) -> torch.optim.Optimizer:
    """The optimizer the plan budgeted memory for. foreach=False: a model mixes DTensor
    and plain parameters, which the fused multi-tensor paths do not group. A rank with no
    parameters (a pipeline stage of parameter-free layers) gets one empty parameter group:
    torch refuses an empty parameter list, and such a rank has nothing to step."""
    params = list(params) or [{"params": []}]
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=False)
    if name == "sgd_momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=False)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=False)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    raise ValueError(f"optimizer: {name!r} is not one of adam, adamw, sgd, sgd_momentum")


def train(model: nn.Module, plan: Plan, dataset: Dataset, loss_fn: Callable, *, steps: int,
          lr: float = 1e-3, checkpoint_dir: str | Path | None = None,
          checkpoint_every: int = 0, keep: int = 2, seed: int = 0, log_every: int = 1,
          leaf_modules=(), forward_kwargs: dict | None = None,
          report: Callable[[str], None] | None = None,
          monitor: bool = True, drift_threshold: float = 0.15,
          on_drift: Callable[["Drift"], list[str]] | None = None) -> TrainResult:
    """Train `model` (the same initial weights on every rank) under `plan` until `steps`
    global steps are done, resuming from the newest complete checkpoint in
    `checkpoint_dir`. Saves every `checkpoint_every` steps and after the last one.

    The loop is closed by default (`monitor`): the first steps are timed per layer
    (executor.StepMonitor) and, where the measured step is off the prediction by more than
    `drift_threshold`, rank 0 reports the drift by term and what `on_drift(drift)` adds
    (`hyplan train`: the re-planned plan's predicted gain). `forward_kwargs`: keyword
    arguments of every forward (those the plan was traced with)."""
    if steps < 0:
        raise ValueError(f"steps: must be at least 0, got {steps}")
    rank = dist.get_rank()
    model = parallelize(model, plan, leaf_modules=leaf_modules)
    optimizer = make_optimizer(plan.optimizer, model.parameters(), lr)
    device = _device_of(model)

    start, resumed_from = 0, None
    found = checkpoint.latest_checkpoint(checkpoint_dir) if checkpoint_dir else None
    if found:
        start = checkpoint.load(found[1], model, optimizer, plan)
        resumed_from = found[1]
    result = TrainResult(model, optimizer, start, resumed_from=resumed_from)
    progress = _Progress(plan, start, steps, log_every, report if rank == 0 else None)
    if resumed_from is not None:
        progress.say(f"resumed from {resumed_from} (step {start})")
    watch = _monitor(model, plan, optimizer, steps - start) if monitor else None

    for step, batch in enumerate(rank_batches(dataset, plan, rank, start, steps, seed), start):
        batch = type(batch)(t.to(device) if isinstance(t, torch.Tensor) else t for t in batch)
        _fault("step", step, model)
        began = time.perf_counter()
        if watch is not None and not watch.done:
            with watch.step():
                result.losses[step] = train_step(model, plan, batch, loss_fn, optimizer,
                                                 forward_kwargs=forward_kwargs)
            if watch.done:
                result.drift = watch.drift()
                _report_drift(result.drift, drift_threshold, progress, on_drift, rank)
        else:
            result.losses[step] = train_step(model, plan, batch, loss_fn, optimizer,
                                                 forward_kwargs=forward_kwargs)
        progress.update(step, result.losses[step], time.perf_counter() - began)
        done = step + 1
        if checkpoint_dir and ((checkpoint_every and done % checkpoint_every == 0)
                               or done == steps):
            path = checkpoint.save(checkpoint_dir, done, model, optimizer, plan, keep,
                                   before_complete=lambda: _fault("checkpoint", step, model))
            progress.say(f"checkpoint {path}")
    progress.close()
    return result


def _monitor(model, plan: Plan, optimizer, steps: int):
    """A StepMonitor over the first steps of a run of `steps` steps: 2 warm-up steps and 5
    timed where there are 7, fewer where the run is shorter, none under 4 (one step's time
    varies by -30%..+60% on 2 CPU processes: a run resumed 2 steps before its end had its
    drift, and a re-plan, judged on one step)."""
    from executor.monitor import StepMonitor

    if steps < 4:
        return None
    skip = 2 if steps >= 7 else 1
    return StepMonitor(model, plan, steps=min(5, steps - skip), skip=skip, optimizer=optimizer)


def _report_drift(drift, threshold: float, progress, on_drift, rank: int) -> None:
    """Rank 0: when the step strays past `threshold`, the drift by term and what
    `on_drift` adds; within it, one line saying so."""
    if rank != 0:
        return
    if not drift.strays(threshold):
        progress.say(f"hyplan: measured step {drift.step_s * 1e3:.1f} ms is within "
                     f"{threshold:.0%} of the predicted {drift.predicted_s * 1e3:.1f} ms "
                     f"({drift.ratio:.2f}x)")
        return
    progress.say(drift.message())
    for line in (on_drift(drift) if on_drift else []):
        progress.say(line)


def _device_of(model: nn.Module) -> torch.device:
    """Where this rank's part runs: a pipeline stage says so (it may hold no parameters)."""
    if isinstance(model, StageModel):
        return model.device
    return next(model.parameters()).device


class _Progress:
    """Rank 0's report: step, loss, throughput, time per step against the plan's."""

    def __init__(self, plan: Plan, start: int, steps: int, every: int, report):
        self.plan, self.steps, self.every, self.report = plan, steps, max(1, every), report
        self.times: list[float] = []
        self.bar = None
        if report is None:
            return
        from rich.console import Console

        self.console = Console(stderr=False)
        if report is print and self.console.is_terminal:
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[line]}"), console=self.console)
            self.task = self.bar.add_task("train", total=steps, completed=start, line="")
            self.bar.start()

    def say(self, text: str) -> None:
        if self.report is None:
            return
        if self.bar is not None:
            self.bar.console.print(text)
        else:
            self.report(text)

    def update(self, step: int, loss: float, seconds: float) -> None:
        if self.report is None:
            return
        self.times.append(seconds)
        predicted = self.plan.predicted.step_time_s
        line = (f"step {step + 1}/{self.steps}  loss {loss:.4f}  "
                f"{self.plan.global_batch / seconds:,.0f} samples/s  "
                f"{seconds * 1e3:.1f} ms/step")
        if predicted > 0:
            line += f" (predicted {predicted * 1e3:.1f} ms, x{seconds / predicted:.2f})"
        if self.bar is not None:
            self.bar.update(self.task, completed=step + 1, line=line)
        elif (step + 1) % self.every == 0 or step + 1 == self.steps:
            self.report(line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
        if self.report is not None and self.times:
            steady = sorted(self.times[1:] or self.times)[len(self.times[1:] or self.times) // 2]
            self.say(f"done: {len(self.times)} steps, median {steady * 1e3:.1f} ms/step, "
                     f"predicted {self.plan.predicted.step_time_s * 1e3:.1f} ms")


def _fault(where: str, step: int, model: nn.Module) -> None:
    """For fault tests: HYPLAN_FAULT="RANK:STEP:WHERE" kills this process with SIGKILL on
    rank RANK at step STEP (0-based), in the first attempt of a torchrun job only; several,
    comma-separated, are the faults of the first attempts in turn (the second in the first
    restart, and so on). WHERE is `step` (during the backward pass, while the other ranks
    are in a collective) or `checkpoint` (after DCP wrote the step's shards, before the
    checkpoint is complete)."""
    faults = [f for f in os.environ.get("HYPLAN_FAULT", "").split(",") if f]
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if attempt >= len(faults):
        return
    rank, at, kind = faults[attempt].split(":")
    if int(rank) != dist.get_rank() or int(at) != step or kind != where:
        return

    def kill(*_):
        # said first: torchrun logs only the failure it saw first, and the killed rank's
        # peer, failing in the collective, is often seen first (its exit code, not -9)
        print(f"HYPLAN_FAULT: SIGKILL rank {rank} at step {step} ({where})", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)

    if where == "step":
        param = next(p for p in model.parameters() if p.requires_grad)
        param.register_hook(kill)
    else:
        kill()
