"""Tracing three blocks and repeating the third gives the graph torch.export gives of the
whole model: same layers in the same order, same names and fx node names, FLOPs,
parameters (tied ones too), edges, shapes and outputs."""

import warnings

import pytest
import torch

from profiler.export_trace import export_trace
from profiler.repeat_blocks import block_list, trace_repeated
from strategies.catalog import unit_types

_SMALL = dict(vocab_size=128, max_position_embeddings=64, use_cache=False)
_DECODER = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4,
                num_key_value_heads=2, **_SMALL)
CONFIGS = {
    "llama": ("LlamaConfig", _DECODER),
    "gpt2": ("GPT2Config", dict(n_embd=64, n_head=4, vocab_size=128, n_positions=64,
                                bos_token_id=0, eos_token_id=0, use_cache=False)),  # tied
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2, **_DECODER)),
}


def _model(kind: str, blocks: int, **extra):
    import transformers

    cls, values = CONFIGS[kind]
    config = getattr(transformers, cls)(num_hidden_layers=blocks, **values, **extra)
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def _traces(model):
    ids = torch.zeros(2, 16, dtype=torch.long, device="meta")
    args, kwargs, units = (ids,), {"use_cache": False}, unit_types(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        repeated = trace_repeated(model, args, kwargs, units)
    fell_back = [str(w.message) for w in caught if "tracing all blocks" in str(w.message)]
    return export_trace(model, args, kwargs, units), repeated, fell_back


@pytest.mark.parametrize("kind", sorted(CONFIGS))
def test_six_blocks_repeated_from_three_equal_the_direct_trace(kind):
    model = _model(kind, 6)
    blocks = block_list(model)[1]
    direct, repeated, fell_back = _traces(model)
    assert not fell_back  # the repeat path ran, not the whole trace
    assert block_list(model)[1] is blocks and len(blocks) == 6  # the model is put back
    assert model.config.num_hidden_layers == 6
    assert [l.name for l in repeated.layers] == [l.name for l in direct.layers]
    assert any(".5." in l.name for l in repeated.layers)  # the last block is there
    for mine, theirs in zip(repeated.layers, direct.layers, strict=True):
        assert mine == theirs  # node, inputs (edges), shapes, FLOPs, params, attrs
    assert repeated.outputs == direct.outputs
    assert repeated.tied_groups() == direct.tied_groups()
    assert repeated.fingerprint == direct.fingerprint
    # where a pipeline may cut (profiler.blocks) and each layer's module, for every block
    assert repeated.blocks == direct.blocks and repeated.no_blocks_why == direct.no_blocks_why
    assert repeated.scopes == direct.scopes
    assert repeated == direct
    assert sum(l.param_count for l in repeated.layers) == sum(p.numel() for p in model.parameters())


def test_blocks_told_apart_by_the_config_are_traced_whole():
    # Qwen2 with sliding-window attention in some layers: alike weights, different forwards
    import transformers

    config = transformers.Qwen2Config(
        num_hidden_layers=4, use_sliding_window=True, sliding_window=8,
        layer_types=["full_attention", "sliding_attention"] * 2, **_DECODER)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    assert block_list(model) is None
    assert block_list(_model("llama", 4))[0] == "model.layers"


def test_optimize_plans_the_same_from_repeated_blocks():
    import planner

    model = _model("llama", 5)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    plans = [planner.optimize(model, "2x4xH100", example_inputs=(ids,),
                              example_kwargs={"use_cache": False}, tracer=tracer)
             for tracer in ("export", "blocks")]
    whole, repeated = (p.model_dump(exclude={"solver"}) for p in plans)
    assert repeated == whole  # every layer's strategy, the prediction, the fingerprint
