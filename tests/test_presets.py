"""LLM presets and config.json models: built on the meta device (nothing allocated), their
published sizes, planned from the command line with tokens/s and MFU, and the tokens/s and
MFU arithmetic on a case worked by hand."""

import json
import math

import pytest

from planner.cli import main
from planner.report.throughput import llm_throughput
from profiler.presets import PRESETS, LLMShape, load_llm

# published parameter counts (model cards / papers), in billions
PUBLISHED_B = {"llama3-8b": 8.03, "llama3.1-8b": 8.03, "llama3-70b": 70.6,
               "llama3-405b": 405.9, "mixtral-8x7b": 46.7, "gpt3-175b": 174.6, "mixtral-8x22b": 141,
               "deepseek-v3": 671, "qwen3-235b-a22b": 235, "gpt-oss-120b": 116.8,
               # Meta's 109 B counts the vision encoder a text-only causal LM leaves out
               "llama4-scout": 107.8}
# the mixtures of experts' published active parameters per token, in billions; gpt-oss's
# 5.1 leaves out its 0.58 B embedding table, which active_params counts
ACTIVE_B = {"mixtral-8x22b": 39, "deepseek-v3": 37, "qwen3-235b-a22b": 22, "llama4-scout": 17,
            "gpt-oss-120b": 5.13 + 0.58}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_builds_on_meta_with_its_published_size(name):
    model, inputs, kwargs, shape, seq = load_llm(name, 2, 128)
    assert {p.device.type for p in model.parameters()} == {"meta"}  # none on CPU
    assert {b.device.type for b in model.buffers()} <= {"meta"}
    assert inputs[0].shape == (2, 128) and inputs[0].device.type == "meta"
    assert kwargs == {"use_cache": False} and seq == 128
    assert math.isclose(shape.params / 1e9, PUBLISHED_B[name], rel_tol=0.01)


@pytest.mark.parametrize("name", sorted(ACTIVE_B))
def test_mixture_of_experts_preset_counts_its_active_parameters(name):
    *_, shape, _ = load_llm(name, 1, 16)
    assert math.isclose(shape.active_params / 1e9, ACTIVE_B[name], rel_tol=0.02)


def test_mixtral_counts_two_of_eight_experts_per_token():
    *_, shape, _ = load_llm("mixtral-8x7b", 1, 16)
    assert math.isclose(shape.active_params / 1e9, 12.9, rel_tol=0.01)  # Mistral's figure


def test_tokens_and_mfu_by_hand():
    # 2 layers, width 1024, 10 M non-embedding parameters, sequence 1000:
    # 6 * 10e6 + 12 * 2 * 1024 * 1000 = 84.576e6 FLOPs per token
    shape = LLMShape("toy", layers=2, hidden=1024, attention_width=1024,
                     params=12_000_000, embedding_params=2_000_000, active_params=12_000_000)
    assert shape.flops_per_token(1000) == 84_576_000
    # 8 sequences of 1000 tokens in 0.5 s on 4 devices of 1e12 FLOP/s peak
    t = llm_throughput(0.5, 8, 1000, 4, shape, 1e12)
    assert t.tokens_per_s == 16_000 and t.tokens_per_s_per_device == 4_000
    assert math.isclose(t.mfu, 4_000 * 84_576_000 / 1e12)


def llama_config_file(tmp_path, max_position_embeddings: int):
    """A tiny Llama's config.json, as `hyplan plan` takes one; its path."""
    config = {"model_type": "llama", "hidden_size": 256, "intermediate_size": 512,
              "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
              "vocab_size": 1024, "max_position_embeddings": max_position_embeddings}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    return path


def test_plan_from_a_config_json(tmp_path, capsys):
    path = llama_config_file(tmp_path, 256)
    assert main(["plan", str(path), "--devices", "4xH100", "--seq", "128", "--batch", "8"]) == 0
    out = capsys.readouterr().out
    assert "tokens/s per device" in out and "MFU" in out and "bfloat16" in out


def test_config_json_without_model_type_names_the_fix(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"hidden_size": 256}))
    assert main(["plan", str(path), "--devices", "4xH100", "--batch", "8"]) == 2
    assert "model_type" in capsys.readouterr().err


def test_seq_longer_than_the_model_names_the_limit(capsys):
    assert main(["plan", "gpt3-175b", "--devices", "8xH100", "--seq", "4096",
                 "--batch", "8"]) == 2
    assert "2048" in capsys.readouterr().err
