"""Mixture-of-experts pricing (issue #38): what a routed experts layer and Llama 4's MoE
block are priced at is what the executor runs, and the all-to-all that expert parallelism
issues is priced by a fit of `all_to_all_single` itself.

- routed experts (transformers 5.x `grouped_mm` forward) count their grouped matmuls'
  FLOPs, each (token, expert) pair through one expert (profiler.expert_flops): they were
  counted at 0;
- Llama 4's MoE runs each token through its top-k experts (profiler.sparse_routing), the
  same function as transformers' dense-routed forward, and is priced so: the block's
  FLOPs those of the router, the shared expert and k experts a token, its parameters the
  config's count (they were right; its FLOPs and activations were 16x);
- the CPU calibration times `all_to_all_single` on gloo (profiler.calibrate), and the
  fit prices an all-to-all near a measured one.
"""

from __future__ import annotations

import copy

import pytest
import torch
import transformers

from profiler.sparse_routing import route_sparsely

# a Scout-shaped text config, small: 4 experts of 32 and a shared one, 1 per token
SCOUT_SMALL = dict(hidden_size=64, intermediate_size=32, intermediate_size_mlp=128,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=16, vocab_size=256, num_local_experts=4, num_experts_per_tok=1,
                   interleave_moe_layer_step=1, attention_chunk_size=64, use_qk_norm=True,
                   tie_word_embeddings=False)


def _scout_config(**changes):
    import transformers  # not at import: the ranks of the all-to-all test import this file

    return transformers.Llama4TextConfig(**{**SCOUT_SMALL, **changes})


@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_sparse_routing_is_transformers_dense_forward(top_k):
    """Outputs, router logits and every gradient equal to transformers' dense-routed
    block (float32, to rounding)."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(0)
    dense = Llama4TextMoe(_scout_config(num_experts_per_tok=top_k))
    for p in dense.parameters():
        torch.nn.init.normal_(p, std=0.1)
    sparse = copy.deepcopy(dense)
    assert route_sparsely(sparse) == 1 and route_sparsely(sparse) == 0  # idempotent
    x = torch.randn(2, 24, 64)
    x1, x2 = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    (y1, logits1), (y2, logits2) = dense(x1), sparse(x2)
    torch.testing.assert_close(y2, y1, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(logits2, logits1)
    weight = torch.randn_like(y1)
    (y1 * weight).sum().backward()
    (y2 * weight).sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad, rtol=1e-5, atol=1e-6)
    for (name, p), q in zip(dense.named_parameters(), sparse.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-6, msg=name)


def _traced(config, batch=2, seq=16):
    from planner.profiled import trace_model
    from profiler.presets import build_llm

    model, inputs, kwargs = build_llm(config, batch, seq)
    return model, trace_model(model, inputs, kwargs, (), "export")


def test_scout_shaped_moe_block_is_priced_at_its_routed_experts_and_its_parameters():
    """The block's FLOPs: router, shared expert and top-1 of 4 experts per token (not all
    4); its parameters (and the model's, per device over N shards) the config's count."""
    config = _scout_config()
    model, graph = _traced(config)
    tokens, hidden, inner = 2 * 16, 64, 32
    blocks = [l for l in graph.layers if l.kind == "Llama4TextMoe"]
    assert len(blocks) == 2
    per_expert = 3 * hidden * inner  # gate, up, down
    shared = 3 * hidden * 32  # Llama4TextMLP at intermediate_size
    expected = 2 * tokens * (hidden * 4 + shared + 1 * per_expert)  # router + shared + k=1
    for block in blocks:
        module = model.get_submodule(block.name)
        count = sum(p.numel() for p in module.parameters())
        assert block.param_count == count
        assert block.param_bytes == count * 4
        assert block.fwd_flops == pytest.approx(expected, rel=0.05), block.fwd_flops
    # every parameter once: total x bytes / shards is what N FSDP shards hold each
    total = sum(p.numel() for p in model.parameters())
    assert sum(l.param_count for l in graph.layers) == total
    for shards in (1, 8, 32):
        per_device = sum(l.param_bytes for l in graph.layers) / shards
        assert per_device == pytest.approx(total * 4 / shards, rel=0.02)


def test_scout_preset_block_is_not_priced_dense():
    """The Llama 4 Scout preset's MoE block on the meta device: parameters 16 experts of
    3 x 5120 x 8192 and a shared one (2.14 B, fp32 8.6 GB); FLOPs a token's one expert,
    the shared one and the router (not 16 experts: 1.4e14 at 32,768 tokens before)."""
    from profiler.presets import preset_config

    config = preset_config("llama4-scout")
    config.num_hidden_layers = 1  # one block is enough: the rest are alike
    model, graph = _traced(config, batch=1, seq=256)
    block = next(l for l in graph.layers if l.kind == "Llama4TextMoe")
    hidden, inner, experts = 5120, 8192, 16
    params = experts * 3 * hidden * inner + 3 * hidden * inner + hidden * experts
    assert block.param_count == params and block.param_bytes == params * 4
    tokens = 256
    sparse = 2 * tokens * (3 * hidden * inner * 2 + hidden * experts)  # 1 routed + shared
    assert block.fwd_flops == pytest.approx(sparse, rel=0.05)


def test_routed_experts_count_their_grouped_matmuls():
    """A transformers 5.x routed experts layer (Mixtral's, grouped_mm forward): 2 FLOPs
    per weight per (token, expert) pair, forward; it was 0."""
    config = transformers.MixtralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, num_local_experts=4, num_experts_per_tok=2)
    _, graph = _traced(config)
    experts = next(l for l in graph.layers if l.kind == "MixtralExperts")
    pairs = 2 * 16 * 2
    assert experts.fwd_flops == 2 * pairs * 3 * 64 * 128
    assert experts.bwd_flops == 2 * experts.fwd_flops


# --- the all-to-all calibration ---------------------------------------------------------------

FIT_SIZES = (16 << 10, 256 << 10, 4 << 20)
CHECK_BYTES = 1 << 20
ROUNDS = 12
# a priced all-to-all within this factor of the measured one: the 2-core machine is shared
# with other processes, and a small gloo call's wall swings 2x from spell to spell
FACTOR = 3.0


def _all_to_all_spans(rank: int, world: int) -> dict:
    import torch.distributed as dist

    from profiler.calibrate import _collective_call, _interleaved_spans

    device = torch.device("cpu")
    # the call is all_to_all_single itself, each rank's n/P sent in P splits
    calls = {n: (_collective_call("all_to_all", n, rank, world, device), False)
             for n in FIT_SIZES + (CHECK_BYTES,)}
    spans = _interleaved_spans(calls, device, ROUNDS)
    dist.barrier()
    return {"spans": [("all_to_all", n, spans[n]) for n in FIT_SIZES + (CHECK_BYTES,)]}


def test_all_to_all_calibration_measures_all_to_all_single_and_prices_near_it():
    """2 gloo ranks time `all_to_all_single` (as `hyplan calibrate` does) at three sizes;
    the fit is positive and its price grows with the bytes; a 1 MB all-to-all, not among
    the fitted sizes, priced within FACTOR of its measured time."""
    from distributed import run_ranks

    from profiler.calibrate import MEASURED, collective_samples
    from strategies.calibrated import fit_collective
    from strategies.collectives import collective_time_s
    from strategies.devices import LinkSpec

    assert "all_to_all" in MEASURED
    per_rank = run_ranks(_all_to_all_spans, 2)
    samples = collective_samples(per_rank, 2)
    assert {s.collective for s in samples} == {"all_to_all"}
    fit = fit_collective([s for s in samples if s.nbytes in FIT_SIZES])
    alpha, beta = fit.alpha_beta(CHECK_BYTES)
    assert alpha > 0 and beta > 0
    link = LinkSpec(name="gloo", bandwidth_bytes_per_s=1e9, latency_s=1e-4, source="test",
                    collectives={"all_to_all": fit})
    prices = [collective_time_s("all_to_all", n, 2, link) for n in (1 << 10, 1 << 16, 1 << 20,
                                                                   1 << 24, 1 << 27)]
    assert all(b > a for a, b in zip(prices, prices[1:])), prices
    measured = next(s.seconds for s in samples if s.nbytes == CHECK_BYTES)
    priced = collective_time_s("all_to_all", CHECK_BYTES, 2, link)
    assert measured / FACTOR <= priced <= measured * FACTOR, (priced, measured, fit)


def test_cpu_link_prices_all_to_all_by_its_own_fit_not_the_all_gathers():
    """A calibrated link's all-to-all is priced by its own fit (not the all-gather's
    copy): two links differing only there price it differently, and the all-gather alike."""
    from strategies.collectives import all_gather_s, all_to_all_s
    from strategies.devices import CollectiveFit, LinkSpec

    gather = CollectiveFit(latency_s=8.6e-4, bandwidth_bytes_per_s=6.0e8)
    own = CollectiveFit(latency_s=5e-4, bandwidth_bytes_per_s=1.2e9)
    links = [LinkSpec(name="gloo", bandwidth_bytes_per_s=1e9, latency_s=1e-4, source="test",
                      collectives={"all_gather": gather, "all_to_all": a2a})
             for a2a in (gather, own)]
    n = 8 << 20
    assert all_gather_s(n, 2, links[0]) == all_gather_s(n, 2, links[1])
    assert all_to_all_s(n, 2, links[1]) == pytest.approx(5e-4 + n / 4 / 1.2e9)
    assert all_to_all_s(n, 2, links[1]) < all_to_all_s(n, 2, links[0])


# --- Llama 4 in a pipeline (profiler.blocks finds its blocks under `model`) -----------------

def _pipeline_parameters(rank: int, world: int, plan_json: str) -> dict:
    from moe_zoo import MOE_ZOO
    from zoo import train

    import executor
    import planner

    entry = MOE_ZOO["llama4"]
    plan = planner.Plan.from_json(plan_json)
    model = entry.make()
    route_sparsely(model)
    model = executor.parallelize(model, plan)
    model = train(model, entry, lambda m, b, loss, opt, kw: executor.train_step(
        m, plan, b, loss, opt, forward_kwargs=kw))
    return executor.full_parameters(model, dict(entry.make().named_parameters()))


def plan_sparse_llama4():
    """The pipeline baseline of the sparse-routed Llama4ForCausalLM on 2 ranks, for
    `_pipeline_parameters` to run. Run in tests/test_zoo.py's launch of 2 ranks beside
    the zoo's jobs (a rank's start costs seconds of this machine), and checked
    there: test_moe_pricing_sparse_routed_llama4_plans_a_pipeline_and_trains_like_one_process
    calls `assert_sparse_llama4_trains_like_one_process`."""
    from moe_zoo import MOE_ZOO

    import planner

    entry = MOE_ZOO["llama4"]
    model = entry.make()
    route_sparsely(model)
    inputs, kwargs = entry.example()
    return planner.baseline(model, "2xcpu", "pipeline", example_inputs=inputs,
                            example_kwargs=kwargs, optimizer="sgd", measure=False)


def assert_sparse_llama4_trains_like_one_process(plan, results: list) -> None:
    """Llama4ForCausalLM's blocks are found (its base_model_prefix names no child): the
    pipeline baseline of the sparse-routed model plans on 2 ranks and every parameter after
    3 SGD steps (`results`: each rank's `_pipeline_parameters` of `plan`) equals one
    process's (tests/test_experts.py's tolerances; that file runs the dense-routed model's
    pipeline with its other plan kinds)."""
    from moe_zoo import MOE_ZOO
    from zoo import reference_once

    assert plan.pipeline is not None and len(plan.pipeline.stages) == 2
    expected = reference_once(MOE_ZOO["llama4"])
    seen: set[str] = set()
    for rank, got in enumerate(results):
        assert not isinstance(got, str), f"rank {rank}: {got}"
        seen |= set(got)
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected)
