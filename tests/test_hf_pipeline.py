"""Pipelines of Hugging Face decoder-only causal LMs (traced by torch.export): the 3-D
search cuts them only between transformer blocks, and the stages built from the model's
own modules (executor.hf_stages), run by torch.distributed.pipelining, train exactly as one
process does: after 3 SGD steps every parameter equals the single-process run's."""

import pytest
import torch

import executor
from distributed import run_ranks
from planner.block_cuts import AFTER, BEFORE, block_units
from planner.optimize import trace_model
from planner.plan import Plan
from planner.plan3d import optimize_3d
from planner.search import Shape
from zoo import ZOO, ZooModel, _DECODER, _hf, _seeded, _tokens, reference, token_loss

STEPS, LR = 3, 0.05
# four blocks, so that two stages may cut anywhere between them
LLAMA4 = ZooModel("llama4", _seeded(_hf("LlamaConfig", "LlamaForCausalLM",
                                        **{**_DECODER, "num_hidden_layers": 4})),
                  _tokens, token_loss)
# GPT-2 with its own head (a tied head would hold one weight in two stages)
GPT2_UNTIED = ZooModel("gpt2_untied", _seeded(_hf(
    "GPT2Config", "GPT2LMHeadModel", n_layer=2, n_embd=32, n_head=4, vocab_size=64,
    n_positions=16, bos_token_id=0, eos_token_id=0, tie_word_embeddings=False)),
    _tokens, token_loss)
MODELS = {m.name: m for m in (LLAMA4, GPT2_UNTIED, ZOO["llama"])}


def _plan(entry: ZooModel, shape: Shape) -> Plan:
    example = entry.batch(0)[:entry.inputs]
    world = shape.pp * shape.dp * shape.tp
    return optimize_3d(entry.make(), f"{world}xcpu", example, {"use_cache": False},
                       measure=False, optimizer="sgd", only=[shape])


def _train_planned(rank, world, plan_json, name):
    plan = Plan.from_json(plan_json)
    entry = MODELS[name]
    model = executor.parallelize(entry.make(), plan)
    opt = torch.optim.SGD(list(model.parameters()) or [{"params": []}], lr=LR, foreach=False)
    losses = [executor.train_step(model, plan, entry.batch(step), entry.loss, opt)
              for step in range(STEPS)]
    return {k: p.detach().clone() for k, p in model.stage.named_parameters()}, losses


def _check(name: str, shape: Shape) -> Plan:
    entry = MODELS[name]
    plan = _plan(entry, shape)
    assert plan.tracer == "export" and plan.mesh.shape == [shape.pp, shape.dp, shape.tp]
    results = run_ranks(_train_planned, shape.pp * shape.dp * shape.tp, plan.to_json(), name)
    expected = reference(entry, STEPS)
    seen = set()
    if shape.pp > 1:  # each rank holds its stage's parameters only
        assert all(len(params) < len(expected) for params, _ in results)
    for rank, (params, losses) in enumerate(results):
        assert losses == pytest.approx(results[0][1], rel=1e-6), f"rank {rank}"
        for key, value in params.items():
            seen.add(key)
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected)  # every parameter lives on some stage
    return plan


def test_llama_two_stages_equal_single_process():
    plan = _check("llama4", Shape(2, 1, 1, 2, "1F1B"))
    first, last = plan.pipeline.stages
    assert first.modules[:2] == ["model.embed_tokens", "model.rotary_emb"]
    assert last.modules[-2:] == ["model.norm", "lm_head"]
    blocks = [m for s in plan.pipeline.stages for m in s.modules if ".layers." in m]
    assert blocks == [f"model.layers.{i}" for i in range(4)]


def test_gpt2_two_stages_gpipe_equal_single_process():
    """GPT-2 adds a learned position table before its blocks: the second stage must not
    add it again (executor.hf_stages.PositionZeros)."""
    plan = _check("gpt2_untied", Shape(2, 1, 1, 4, "GPipe"))
    assert plan.pipeline.stages[0].modules[:2] == ["transformer.wte", "transformer.wpe"]
    assert plan.pipeline.stages[-1].modules[-1] == "lm_head"


def test_llama_two_chunks_per_rank_equal_single_process():
    plan = _check("llama4", Shape(2, 1, 1, 4, "Interleaved1F1B", 2))
    assert [s.pipeline_rank for s in plan.pipeline.stages] == [0, 1, 0, 1]


def test_llama_pipeline_times_data_parallel_4_ranks_equals_single_process():
    _check("llama4", Shape(2, 2, 1, 2, "1F1B"))
