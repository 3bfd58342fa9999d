"""Transformer blocks tensor-parallel: attention split by heads, the MLP column-then-row and
the embedding split by vocabulary, on 2 gloo ranks, give the parameters of single-process
training after 3 steps."""

import sys
from pathlib import Path

import torch
import torch.nn.functional as F

import executor
import planner
from distributed import run_ranks
from models import assert_ranks_match

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

STEPS, ROWS, SEQ, VOCAB, LR = 3, 4, 8, 64, 0.05
SIZE = dict(layers=2, width=32, heads=4, seq=SEQ, vocab=VOCAB)


def _model():
    torch.manual_seed(0)
    return gpt.GPT(**{k: SIZE[k] for k in ("layers", "width", "heads", "seq", "vocab")})


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)
    return ids, torch.randint(0, VOCAB, (ROWS, SEQ), generator=g)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train(model, shard):
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        ids, targets = shard(_batch(step))
        loss = _loss(model(ids), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _train_planned(rank, world, plan_json):
    plan = planner.Plan.from_json(plan_json)
    model = _train(executor.parallelize(_model(), plan), lambda b: executor.shard_batch(plan, b))
    return executor.full_parameters(model, dict(_model().named_parameters()))


PIN = {"wte": "vocab_parallel", "h.0.attn": "head_parallel", "h.0.mlp.fc": "column_parallel",
       "h.0.mlp.act": "feature_parallel", "h.0.mlp.proj": "row_parallel",
       "h.1.attn": "head_parallel", "h.1.mlp.fc": "column_parallel",
       "h.1.mlp.act": "feature_parallel", "h.1.mlp.proj": "row_parallel",
       "lm_head": "column_parallel"}


def test_gpt_tensor_parallel_matches_single_process():
    plan = planner.optimize(_model(), "2xcpu", example_inputs=(_batch(0)[0],), pin=PIN,
                            measure=False)
    got = {l.name: l.strategy for l in plan.layers}
    assert {k: got[k] for k in PIN} == PIN
    results = run_ranks(_train_planned, 2, plan.to_json())
    expected = {k: v.detach() for k, v in _train(_model(), lambda b: b).named_parameters()}
    assert_ranks_match(results, expected)


# --- Hugging Face GPT-2: torch.export front end, executor by module path ------------------

HF_PIN = {"transformer.wte": "vocab_parallel", "transformer.h.0.attn": "head_parallel",
          "transformer.h.0.mlp.c_fc": "column_parallel",
          "transformer.h.0.mlp.act": "feature_parallel",
          "transformer.h.0.mlp.c_proj": "row_parallel", "transformer.h.1.attn": "head_parallel",
          "transformer.h.1.mlp.c_fc": "column_parallel",
          "transformer.h.1.mlp.act": "feature_parallel",
          "transformer.h.1.mlp.c_proj": "row_parallel", "lm_head": "column_parallel"}


def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    return GPT2LMHeadModel(config)


def _train_hf(model, shard):
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        ids, targets = shard(_batch(step))
        loss = _loss(model(ids, use_cache=False).logits, targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _train_hf_planned(rank, world, plan_json):
    plan = planner.Plan.from_json(plan_json)
    model = executor.parallelize(_gpt2(), plan)
    model = _train_hf(model, lambda b: executor.shard_batch(plan, b))
    return executor.full_parameters(model, dict(_gpt2().named_parameters()))


def test_hf_gpt2_traced_by_export_tensor_parallel_matches_single_process():
    import pytest

    pytest.importorskip("transformers")
    model = _gpt2()
    plan = planner.optimize(model, "2xcpu", example_inputs=(_batch(0)[0],),
                            example_kwargs={"use_cache": False}, pin=HF_PIN, measure=False)
    assert plan.tracer == "export"  # fx cannot trace transformers 5.x
    got = {l.name: l.strategy for l in plan.layers}
    assert {k: got[k] for k in HF_PIN} == HF_PIN
    assert plan.predicted.step_time_s < 100  # no layout change the executor cannot make
    results = run_ranks(_train_hf_planned, 2, plan.to_json())
    expected = {k: v.detach() for k, v in _train_hf(_gpt2(), lambda b: b).named_parameters()}
    assert_ranks_match(results, expected)
