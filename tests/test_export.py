"""Exported jobs load in the frameworks' own config code: torchtitan's ConfigManager reads
the TOML (torchtitan 0.2.2, --no-deps; its package __init__ imports triton kernels, so the
config subpackage is imported under a bare package module), megatron-core's
TransformerConfig validates the Megatron values."""

import importlib.util
import sys
import types
from dataclasses import replace

import pytest

from planner.export import JobConfig, read_megatron, read_torchtitan
from planner.export.megatron import arguments, config_fields
from planner.export.torchtitan import sections, toml_text

JOBS = [JobConfig(global_batch=16, seq_len=8192, dp_shard=8, recompute="full", sequence_parallel=False),
        JobConfig(global_batch=256, seq_len=8192, dp_shard=32, tp=8, sequence_parallel=True,
                  recompute="full", num_layers=80),
        JobConfig(global_batch=256, seq_len=8192, dp_shard=8, tp=8, pp=8, chunks=2,
                  schedule="Interleaved1F1B", microbatches=32, num_layers=128,
                  recompute="full", sequence_parallel=True)]


def _torchtitan_config():
    if "torchtitan" not in sys.modules:
        spec = importlib.util.find_spec("torchtitan")
        if spec is None:
            pytest.skip("torchtitan not installed (pip install --no-deps torchtitan==0.2.2 tyro)")
        pkg = types.ModuleType("torchtitan")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["torchtitan"] = pkg
    from torchtitan.config import ConfigManager
    return ConfigManager


@pytest.mark.parametrize("job", JOBS)
def test_torchtitan_reads_the_exported_toml(job, tmp_path):
    ConfigManager = _torchtitan_config()
    path = tmp_path / "job.toml"
    path.write_text(toml_text(sections(job)))
    parsed = ConfigManager().parse_args(["--job.config_file", str(path)])
    assert parsed.parallelism.data_parallel_shard_degree == job.dp_shard
    assert parsed.parallelism.tensor_parallel_degree == job.tp
    assert parsed.parallelism.pipeline_parallel_degree == job.pp
    assert parsed.training.global_batch_size == job.global_batch
    # a torchtitan job names its model by flavor, not by block count: that comes from the model
    back = read_torchtitan(path.read_text(), devices=job.devices)
    assert replace(back, num_layers=job.num_layers) == job


@pytest.mark.parametrize("job", JOBS)
def test_megatron_core_accepts_the_exported_values(job):
    pytest.importorskip("megatron.core")
    import torch
    from megatron.core.transformer import TransformerConfig
    fields = config_fields(job)
    fields.setdefault("num_layers", 8 * job.pp)
    TransformerConfig(hidden_size=64, num_attention_heads=8, params_dtype=torch.bfloat16,
                      pipeline_dtype=torch.bfloat16, **fields)
    back = read_megatron(arguments(job), job.devices)
    assert (back.tp, back.pp, back.dp, back.chunks, back.microbatches) == (
        job.tp, job.pp, job.dp, job.chunks, job.microbatches)
