"""Attention of a model built on meta is priced as a device runs it (profiler.meta_attention):
its saved bytes are the fused kernel's (q, k, v, output, a row statistic), not the math
path's score matrix that meta tensors take."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from planner.profiled import profiled_graph
from profiler.meta_attention import efficient_attention

BATCH, SEQ, HIDDEN, HEADS = 2, 512, 64, 4


def _attention_layers(device: str):
    config = transformers.LlamaConfig(hidden_size=HIDDEN, intermediate_size=256,
                                      num_hidden_layers=2, num_attention_heads=HEADS,
                                      num_key_value_heads=2, vocab_size=512)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (BATCH, SEQ), device=device)
    graph, _ = profiled_graph(model, "2xH100", (ids,), {"use_cache": False}, tracer="blocks")
    return [l for l in graph.layers if l.name.endswith("self_attn")]


def test_a_meta_built_llamas_attention_keeps_no_score_matrix():
    """Each attention layer of a meta-built Llama keeps about four outputs' worth (q, k and v
    with its heads repeated, the output; the causal mask's bias once, on the first), far
    below the BATCH x HEADS x SEQ² scores the math path saved."""
    layers = _attention_layers("meta")
    out = layers[0].output
    scores = BATCH * HEADS * SEQ * SEQ * out.nbytes // (BATCH * SEQ * HIDDEN)
    for layer in layers:
        assert layer.activation_bytes < scores / 2, (layer.name, layer.activation_bytes, scores)
    last = layers[-1]
    assert 3.5 * last.output.nbytes <= last.activation_bytes <= 4.5 * last.output.nbytes


def test_efficient_attention_gives_sdpas_output_and_gradient_shapes_on_meta():
    """The stand-in returns what scaled_dot_product_attention returns (shape, dtype) for
    grouped-query heads and a boolean mask, and backward reaches q, k and v."""
    q = torch.empty(2, 4, 64, 16, device="meta", requires_grad=True)
    k = torch.empty(2, 2, 64, 16, device="meta", requires_grad=True)
    v = torch.empty(2, 2, 64, 16, device="meta", requires_grad=True)
    mask = torch.ones(64, 64, dtype=torch.bool, device="meta").expand(2, 1, 64, 64)
    expected = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                                enable_gqa=True)
    out = efficient_attention(q, k, v, mask, enable_gqa=True)
    assert out.shape == expected.shape and out.dtype == expected.dtype
    gq, gk, gv = torch.autograd.grad(out.sum(), (q, k, v))
    assert gq.shape == q.shape and gk.shape == k.shape and gv.shape == v.shape
