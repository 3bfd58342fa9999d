"""Checkpoints through torch.distributed.checkpoint (DCP): sharded, resharded on load, and
never half-written.

Layout of a checkpoint directory:

    step_00000040/          a complete checkpoint: DCP's files, and hyplan.json written last
    .partial-step_00000050/ one being written (or one a crash interrupted): never loaded

Every rank writes its shards into the `.partial-` folder; when DCP has written its
metadata, rank 0 adds `hyplan.json` (step, the plan it was saved under) and renames the
folder to `step_...` in one atomic step. A crash at any point leaves at worst a `.partial-`
folder, which the next save replaces. `get_state_dict`/`set_state_dict` name parameters by
their place in the user's model, whether a module is wrapped by DDP, holds DTensor shards
or is one pipeline stage (whose ranks save and load only that stage's names; DCP's
metadata merges every rank's into the whole model's), so a checkpoint saved under one
plan loads under another, on any device count (the directory must be visible to every
node, e.g. a shared file system).

Loading unpickles nothing that could run code: tensors are read with `weights_only=True`,
the few plain values (learning rates) too, and DCP's metadata file with an unpickler that
admits only DCP's own metadata classes.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_state_dict,
                                                     set_state_dict)
from torch.distributed.checkpoint._traverse import set_element

from planner.plan import Plan

MARKER = "hyplan.json"
# Optimizer state keyed by parameter name, hyperparameters too ("param_groups.fc.weight.lr"):
# pipeline stages hold different parameters in their group 0, which keyed by group index
# would collide in DCP's merged metadata (torchtitan saves pipelined runs this way too).
# The marker says so; checkpoints from before have no "optim_keys" and are read by index.
_BY_NAME = StateDictOptions(flatten_optimizer_state_dict=True)
_BY_INDEX = StateDictOptions()
_STEP = re.compile(r"^step_(\d+)$")


class CheckpointError(ValueError):
    """A checkpoint directory that cannot be resumed from (another model, unreadable)."""


def step_dir(directory: str | Path, step: int) -> Path:
    return Path(directory) / f"step_{step:08d}"


def complete_checkpoints(directory: str | Path) -> list[tuple[int, Path]]:
    """(step, folder) of every complete checkpoint in `directory`, oldest first."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = _STEP.match(path.name)
        if match and (path / MARKER).is_file() and (path / ".metadata").is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_checkpoint(directory: str | Path) -> tuple[int, Path] | None:
    """The newest complete checkpoint, or None."""
    found = complete_checkpoints(directory)
    return found[-1] if found else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def save(directory: str | Path, step: int, model: nn.Module,
         optimizer: torch.optim.Optimizer, plan: Plan, keep: int = 2,
         before_complete: Callable[[], None] | None = None) -> Path:
    """Save model and optimizer after `step` steps; call on every rank. Keeps the newest
    `keep` complete checkpoints. `before_complete` runs between the shards and the marker
    (fault tests kill a rank there)."""
    directory, final = Path(directory), step_dir(directory, step)
    partial = directory / f".partial-{final.name}"
    if _rank() == 0:
        directory.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(partial, ignore_errors=True)  # left by a crash: never completed
    _barrier()
    dcp.save(_state(model, optimizer, _BY_NAME), checkpoint_id=partial)
    if before_complete is not None:
        before_complete()
    if _rank() == 0:  # dcp.save returns on every rank only after its metadata is written
        _write_synced(partial / MARKER, json.dumps({
            "step": step, "model": plan.model, "fingerprint": plan.fingerprint,
            "devices": plan.cluster.describe(), "global_batch": plan.global_batch,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "optim_keys": "name"}, indent=2))
        if final.exists():  # the same step saved before, by a run that was resumed earlier
            shutil.rmtree(final)
        os.replace(partial, final)
        _fsync_dir(directory)
        for _, old in complete_checkpoints(directory)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    _barrier()
    return final


def _write_synced(path: Path, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def read_marker(path: str | Path) -> dict:
    try:
        return json.loads((Path(path) / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint: cannot read {Path(path) / MARKER} ({error}); "
                              f"delete that folder to resume from an older one") from None


def check_marker(path: str | Path, plan: Plan) -> dict:
    """The checkpoint's marker, refused (CheckpointError) unless it was saved for the model
    `plan` was made for: the one fingerprint check of a checkpoint, made by `load` on every
    rank and by `hyplan train` before any process starts."""
    marker = read_marker(path)
    if marker.get("fingerprint") != plan.fingerprint:
        raise CheckpointError(
            f"checkpoint: {path} was saved for a {marker.get('model')} with fingerprint "
            f"{marker.get('fingerprint')}, the plan is for {plan.model} ({plan.fingerprint}); "
            f"pass an empty or new directory as --checkpoint-dir")
    return marker


def load(path: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer,
         plan: Plan) -> int:
    """Load a complete checkpoint into this rank's model and optimizer, resharding to the
    current plan; returns the step it was saved after. Call on every rank."""
    marker = check_marker(path, plan)
    options = _BY_NAME if marker.get("optim_keys") == "name" else _BY_INDEX
    state = _state(model, optimizer, options)
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner())
    if state:
        set_state_dict(_named(model), optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=options)
    return int(marker["step"])


def _named(model: nn.Module) -> nn.Module:
    """The module whose parameter names are the user's: a pipeline stage's graph module
    (named as in the whole model), else the model (get_state_dict sees through DDP)."""
    from executor.pipeline import StageModel

    return model.stage if isinstance(model, StageModel) else model


def _state(model: nn.Module, optimizer: torch.optim.Optimizer,
           options: StateDictOptions) -> dict:
    """This rank's part of a checkpoint: {} on a rank holding no state (a stage of
    parameter-free layers), which still takes part in DCP's collective save and load."""
    module = _named(model)
    if not module.state_dict():
        return {}
    model_state, optim_state = get_state_dict(module, optimizer, options=options)
    return {"model": model_state, "optim": optim_state}


class _SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's planner, but plain values are read with `weights_only=True` as tensors are."""

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


class _MetadataUnpickler(pickle.Unpickler):
    """Admits DCP's metadata dataclasses, torch.Size, dtypes and layouts, paths, and
    nothing else (pickle would otherwise call whatever the file names)."""

    def find_class(self, module: str, name: str):
        if module.startswith("torch.distributed.checkpoint."):
            return super().find_class(module, name)
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                               (torch.dtype, torch.memory_format,
                                                                torch.layout))):
            return getattr(torch, name)
        if (module, name) in {("collections", "OrderedDict"), ("builtins", "set"),
                              ("builtins", "frozenset"), ("torch.serialization", "_get_layout"),
                              ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
                              ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath")}:
            return super().find_class(module, name)
        raise CheckpointError(f"checkpoint: metadata refers to {module}.{name}, which a "
                              f"checkpoint has no reason to hold; refusing to load it")


class _SafeReader(FileSystemReader):
    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = _MetadataUnpickler(f).load()
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


def load_model(path: str | Path, model: nn.Module) -> int:
    """Load only the weights of a complete checkpoint into a plain (unparallelized) model,
    e.g. for evaluation in one process; returns the step it was saved after."""
    marker = read_marker(path)
    state = {"model": model.state_dict()}
    dcp.load(state, storage_reader=_SafeReader(path), planner=_SafeLoadPlanner(),
             no_dist=not dist.is_initialized())
    model.load_state_dict(state["model"])
    return int(marker["step"])
