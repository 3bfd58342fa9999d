"""Well-known LLM shapes, and any Hugging Face causal-LM config.json, built on the meta device.

`hyplan plan llama3-8b --devices 8xH100 --seq 8192 --batch 16` plans a model nobody has
to write: the preset is a transformers config with the published sizes (written here, with
its source; nothing is downloaded) and the model is built under `torch.device("meta")`, so
a 405 B model costs no memory. `hyplan plan path/to/config.json` does the same for any
causal-LM config. `LLMShape` keeps the sizes model-FLOPs utilisation needs.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from profiler.sparse_routing import route_sparsely

# Each entry: the transformers config class and the values of the published config.
PRESETS: dict[str, tuple[str, dict]] = {
    # meta-llama/Meta-Llama-3-8B config.json (Llama 3.1 8B has the same sizes)
    "llama3-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    # meta-llama/Llama-3.1-8B config.json: Llama 3's sizes, 128K positions by RoPE scaling
    "llama3.1-8b": ("LlamaConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})),
    # meta-llama/Meta-Llama-3-70B config.json
    "llama3-70b": ("LlamaConfig", dict(
        hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=8192, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    # meta-llama/Llama-3.1-405B config.json
    "llama3-405b": ("LlamaConfig", dict(
        hidden_size=16384, intermediate_size=53248, num_hidden_layers=126,
        num_attention_heads=128, num_key_value_heads=8, vocab_size=128256,
        max_position_embeddings=131072, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    # mistralai/Mixtral-8x7B-v0.1 config.json: 8 experts, 2 per token
    "mixtral-8x7b": ("MixtralConfig", dict(
        hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=32768,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # mistralai/Mixtral-8x22B-v0.1 config.json: 8 experts, 2 per token (141 B, 39 B active)
    "mixtral-8x22b": ("MixtralConfig", dict(
        hidden_size=6144, intermediate_size=16384, num_hidden_layers=56,
        num_attention_heads=48, num_key_value_heads=8, vocab_size=32000,
        num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=65536,
        rope_theta=1e6, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # deepseek-ai/DeepSeek-V3 config.json (671 B, 37 B active): 256 routed experts of 2048
    # and one shared, 8 per token from 4 of 8 groups, the first 3 layers dense, latent
    # attention (kv rank 512, q rank 1536); its multi-token-prediction layer
    # (num_nextn_predict_layers 1) is not part of transformers' model
    "deepseek-v3": ("DeepseekV3Config", dict(
        hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128,
        vocab_size=129280, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
        n_group=8, topk_group=4, first_k_dense_replace=3, routed_scaling_factor=2.5,
        norm_topk_prob=True, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
        rope_theta=10000.0, rope_scaling={"type": "yarn", "factor": 40,
                                          "original_max_position_embeddings": 4096,
                                          "beta_fast": 32, "beta_slow": 1, "mscale": 1.0,
                                          "mscale_all_dim": 1.0},
        rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # Qwen/Qwen3-235B-A22B config.json (235 B, 22 B active): 128 experts of 1536, 8 per token
    "qwen3-235b-a22b": ("Qwen3MoeConfig", dict(
        hidden_size=4096, intermediate_size=12288, moe_intermediate_size=1536,
        num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
        vocab_size=151936, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
        decoder_sparse_step=1, mlp_only_layers=[], max_position_embeddings=40960,
        rope_theta=1e6, rms_norm_eps=1e-6, tie_word_embeddings=False)),
    # meta-llama/Llama-4-Scout-17B-16E config.json, its text_config (109 B with the vision
    # encoder, 17 B active): 16 experts and a shared one, 1 per token, chunked attention
    "llama4-scout": ("Llama4TextConfig", dict(
        hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128,
        vocab_size=202048, num_local_experts=16, num_experts_per_tok=1,
        interleave_moe_layer_step=1, attention_chunk_size=8192, use_qk_norm=True,
        max_position_embeddings=10485760, rope_theta=500000.0, rms_norm_eps=1e-5,
        tie_word_embeddings=False)),
    # openai/gpt-oss-120b config.json (117 B, 5.1 B active): 128 experts, 4 per token,
    # sliding (128) and full attention alternating, attention sinks
    "gpt-oss-120b": ("GptOssConfig", dict(
        hidden_size=2880, intermediate_size=2880, num_hidden_layers=36,
        num_attention_heads=64, num_key_value_heads=8, head_dim=64, vocab_size=201088,
        num_local_experts=128, num_experts_per_tok=4, sliding_window=128,
        layer_types=["sliding_attention", "full_attention"] * 18,
        max_position_embeddings=131072, rope_theta=150000.0,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
        swiglu_limit=7.0, rms_norm_eps=1e-5, tie_word_embeddings=False)),
    # Brown et al. 2020, "Language Models are Few-Shot Learners", table 2.1: 96 layers,
    # d_model 12288, 96 heads of 128, context 2048, GPT-2's 50257-token vocabulary. GPT-3
    # alternates dense and locally banded sparse attention; this preset is dense throughout.
    "gpt3-175b": ("GPT2Config", dict(
        n_layer=96, n_embd=12288, n_head=96, n_positions=2048, vocab_size=50257,
        tie_word_embeddings=True)),
}


# what each mixture-of-experts family calls its routed experts' count
EXPERT_COUNTS = ("num_local_experts", "num_experts", "n_routed_experts")


@dataclass(frozen=True)
class LLMShape:
    """The sizes model-FLOPs utilisation needs, read from a built model."""

    name: str
    layers: int
    hidden: int  # width of the residual stream
    attention_width: int  # query heads x head dim (what attention's matmuls span)
    params: int
    embedding_params: int  # the input embedding table (a lookup, no FLOPs)
    active_params: int  # per token: a mixture of experts runs only its chosen experts

    def flops_per_token(self, seq: int) -> float:
        """Training FLOPs per token, PaLM's and torchtitan's definition (Chowdhery et al.
        2022, appendix B; torchtitan `get_num_flop_per_token`): 6 per non-embedding
        parameter (forward 2, backward 4) plus attention's two matmuls, 12 x layers x
        attention width x sequence (causal masking not subtracted, as both do)."""
        return 6 * (self.active_params - self.embedding_params) \
            + 12 * self.layers * self.attention_width * seq


def preset_names() -> list[str]:
    return sorted(PRESETS)


def is_config_path(spec: str) -> bool:
    return spec.lower().endswith(".json")


def preset_config(name: str):
    """The transformers config of a preset, by name."""
    import transformers

    if name not in PRESETS:
        raise ValueError(f"model: unknown preset {name!r}; known: {', '.join(preset_names())}, "
                         f"or a path to a Hugging Face config.json")
    cls, values = PRESETS[name]
    return getattr(transformers, cls)(**values)


def file_config(path: str | Path):
    """The transformers config in a causal-LM config.json (its "model_type" says which)."""
    from transformers import AutoConfig

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"model: config file {str(path)!r} not found; pass a Hugging Face "
                         f"config.json or a preset ({', '.join(preset_names())})")
    try:
        values = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"model: {str(path)!r} is not JSON ({error}); pass a Hugging Face "
                         f"config.json") from None
    model_type = values.pop("model_type", None) if isinstance(values, dict) else None
    if not model_type:
        raise ValueError(f"model: {str(path)!r} has no \"model_type\"; a Hugging Face "
                         f"config.json names its architecture there (e.g. \"llama\")")
    try:
        return AutoConfig.for_model(model_type, **values)
    except ValueError as error:
        raise ValueError(f"model: {str(path)!r}: {error}") from None


def build_llm(config, batch: int, seq: int, dtype: torch.dtype = torch.float32):
    """(model, example_inputs, example_kwargs) of a causal LM on the meta device: nothing
    is allocated, whatever its size. `dtype`: the parameters' dtype as built. A
    dense-routed mixture of experts (Llama 4's) is given its sparse forward, the same
    function (profiler.sparse_routing)."""
    from transformers import AutoModelForCausalLM

    if batch < 1 or seq < 1:
        raise ValueError(f"batch and seq must be positive, got batch={batch}, seq={seq}")
    limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", None)
    if limit is not None and seq > limit:
        raise ValueError(f"--seq: {seq} is longer than this model's {limit} positions; "
                         f"pass --seq {limit} or less")
    config.use_cache = False
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    except ValueError as error:
        raise ValueError(f"model: {type(config).__name__} is not a causal LM transformers "
                         f"can build ({error})") from None
    # Llama 4's MoE each token through its own experts, not all of them (profiler.sparse_routing)
    route_sparsely(model)
    ids = torch.zeros(batch, seq, dtype=torch.long, device="meta")
    return model, (ids,), {"use_cache": False}


def llm_shape(model: nn.Module, config, name: str) -> LLMShape:
    """The sizes of a built causal LM that its FLOPs per token depend on."""
    get = lambda *keys: next(getattr(config, k) for k in keys if getattr(config, k, None))  # noqa: E731
    layers = get("num_hidden_layers", "n_layer")
    hidden = get("hidden_size", "n_embd")
    heads = get("num_attention_heads", "n_head")
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    experts = next((getattr(config, k) for k in EXPERT_COUNTS if getattr(config, k, None)), 0)
    active = params
    if experts:  # only num_experts_per_tok of the experts' weights run per token
        expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n
                            or n.endswith(".experts") or ".experts" in n)
        active = params - expert_params + expert_params * config.num_experts_per_tok // experts
    return LLMShape(name=name, layers=layers, hidden=hidden, attention_width=heads * head_dim,
                    params=params, embedding_params=embedding, active_params=active)


def load_llm(spec: str, batch: int, seq: int | None, dtype: torch.dtype = torch.float32):
    """(model, inputs, kwargs, LLMShape, seq) for a preset name or a config.json path; `seq`
    defaults to the model's own context length, capped at 8192."""
    config = file_config(spec) if is_config_path(spec) else preset_config(spec)
    if seq is None:
        limit = getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions", 2048)
        seq = min(limit, 8192)
    model, inputs, kwargs = build_llm(config, batch, seq, dtype)
    name = Path(spec).parent.name or Path(spec).stem if is_config_path(spec) else spec
    return model, inputs, kwargs, llm_shape(model, config, name), seq
