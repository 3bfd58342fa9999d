"""Mixture-of-experts models no one here wrote: tiny Hugging Face configs of every family
transformers 5.x ships (random init, nothing downloaded), for tests/test_experts.py.

Each covers what the family adds: top-k routing to 4 experts (Mixtral), Qwen3-MoE's
normalized top-k and per-head norms, DeepSeek-V3's shared experts, grouped routing
(`n_group`/`topk_group`: a group mask scattered into the scores) and latent attention
that writes its rotary part into a slice of q, gpt-oss's biased experts with a clamped
gate, transposed weights and sinks in sliding-window attention, and Llama 4's dense
routing (every token through every expert, scaled by its sigmoid score) beside a shared
expert, with chunked attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from strategies import ExpertParallel, register
from zoo import _DECODER, VOCAB, ZOO, ZooModel, _hf, _seeded, _tokens, token_loss


class StackedExperts(nn.Module):
    """A user's own experts block, as transformers writes them: weights stacked per expert,
    called with the tokens (any leading dims), their top-k experts and weights, looping
    over the experts."""

    def __init__(self, experts: int = 4, hidden: int = 16, inner: int = 32, top_k: int = 2):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.up = nn.Parameter(torch.randn(experts, inner, hidden) * 0.1)
        self.down = nn.Parameter(torch.randn(experts, hidden, inner) * 0.1)

    def forward(self, x, top_k_index, top_k_weights):
        tokens = x.reshape(-1, x.shape[-1])
        index = top_k_index.reshape(-1, top_k_index.shape[-1])
        weights = top_k_weights.reshape(-1, top_k_weights.shape[-1])
        out = torch.zeros_like(tokens)
        for e in range(self.num_experts):
            token, slot = torch.where(index == e)
            y = F.linear(F.gelu(F.linear(tokens[token], self.up[e])), self.down[e])
            out = out.index_add(0, token, y * weights[token, slot, None])
        return out.view_as(x)


class FxMoE(nn.Module):
    """A token model torch.fx traces, its experts block kept whole (registered as a leaf)
    and its router's top-k and softmax between modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, 16)
        self.router = nn.Linear(16, 4)
        self.experts = StackedExperts()
        self.head = nn.Linear(16, VOCAB)

    def forward(self, ids):
        h = self.embed(ids)
        weights, index = torch.topk(self.router(h), 2, dim=-1)
        return self.head(h + self.experts(h, index, torch.softmax(weights, dim=-1)))


register(StackedExperts, ExpertParallel(), rowwise=True, leaf=True)

MOE_ZOO = {m.name: m for m in [
    # tests/zoo.py's own entry: its plans of the zoo's kinds are these (tests/test_zoo.py
    # plans and runs them once, for both files' checks)
    ZOO["mixtral"],
    ZooModel("qwen3_moe", _seeded(_hf("Qwen3MoeConfig", "Qwen3MoeForCausalLM", num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=32,
                                      head_dim=8, **_DECODER)),
             _tokens, token_loss),
    ZooModel("deepseek_v3", _seeded(_hf(
        "DeepseekV3Config", "DeepseekV3ForCausalLM", n_routed_experts=4, num_experts_per_tok=2,
        n_shared_experts=1, moe_intermediate_size=32, first_k_dense_replace=1, n_group=2,
        topk_group=1, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=4,
        qk_nope_head_dim=4, v_head_dim=8,
        **{**_DECODER, "num_key_value_heads": 4})),
             _tokens, token_loss),
    ZooModel("gpt_oss", _seeded(_hf("GptOssConfig", "GptOssForCausalLM", num_local_experts=4,
                                    num_experts_per_tok=2, head_dim=8, sliding_window=4,
                                    layer_types=["sliding_attention", "full_attention"],
                                    **_DECODER)),
             _tokens, token_loss),
    ZooModel("llama4", _seeded(_hf("Llama4TextConfig", "Llama4ForCausalLM", num_local_experts=4,
                                   num_experts_per_tok=1, head_dim=8, intermediate_size_mlp=64,
                                   attention_chunk_size=4, **_DECODER)),
             _tokens, token_loss),
    ZooModel("fx_moe", _seeded(FxMoE), _tokens, token_loss),
]}
# the families whose experts are called with top-k indices, which expert parallelism splits
ROUTED = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss", "fx_moe")
