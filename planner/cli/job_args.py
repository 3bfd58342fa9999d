"""What `hyplan export` and `hyplan compare --torchtitan/--megatron` read besides a plan:
the model at a given batch (a model file, an LLM preset or a config.json), and a user's
job (a torchtitan TOML file or a Megatron-LM argument string) as a JobConfig.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from planner.cli.model_args import build_model, forward_kwargs, load_factory
from planner.export import JobConfig, read_megatron, read_torchtitan


@dataclass(frozen=True)
class Built:
    """A model built for planning, and how to trace it."""

    model: object
    inputs: tuple
    kwargs: dict
    tracer: str  # "blocks" for an LLM (three blocks traced and repeated), else "auto"
    seq: int  # tokens per sequence; 0 for a model that is not a sequence model
    shape: object = None  # profiler.presets.LLMShape for an LLM, else None


def is_llm(spec: str) -> bool:
    """MODEL names an LLM preset or a Hugging Face config.json (not a Python model file)."""
    from profiler.presets import PRESETS, is_config_path

    return spec in PRESETS or is_config_path(spec)


def build_any(spec: str, batch: int, seq: int | None, cluster) -> Built:
    """MODEL at `batch` (and `seq` for an LLM): on meta, or on the CPU for CPU devices,
    where layers get timed."""
    if is_llm(spec):
        from profiler.presets import load_llm

        model, inputs, kwargs, shape, seq = load_llm(spec, batch, seq or None)
        return Built(model, tuple(inputs), kwargs, "blocks", seq, shape)
    factory = load_factory(spec)
    device = "cpu" if cluster.device.kind == "cpu" else "meta"
    model, inputs = build_model(factory, batch, device)
    ids = inputs[0] if inputs else None
    seq = ids.shape[1] if getattr(ids, "ndim", 0) == 2 and not ids.is_floating_point() else 0
    return Built(model, inputs, forward_kwargs(factory), "auto", seq)


def read_job(torchtitan: str | None, megatron: str | None, devices: int) -> tuple[JobConfig, str]:
    """(the user's job, a few words naming it) from --torchtitan FILE or --megatron ARGS."""
    if torchtitan and megatron:
        raise ValueError("--torchtitan and --megatron: give one job, not both")
    if torchtitan:
        path = Path(torchtitan)
        if not path.is_file():
            raise ValueError(f"--torchtitan: file {torchtitan!r} not found; pass the job's "
                             f"TOML file (torchtitan's --job.config_file)")
        return read_torchtitan(path.read_text(), devices=devices), f"torchtitan {path.name}"
    return read_megatron(megatron, devices), "Megatron-LM arguments"
