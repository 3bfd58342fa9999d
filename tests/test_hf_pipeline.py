"""Pipelines of Hugging Face decoder-only causal LMs (traced by torch.export): the 3-D
search cuts them only between transformer blocks, and the stages built from the model's
own modules (executor.hf_stages), run by torch.distributed.pipelining, train exactly as one
process does: after 3 SGD steps every parameter equals the single-process run's."""

import functools
import time
from dataclasses import replace

import numpy as np
import pytest
import torch

import executor
from distributed import run_ranks
import planner
from planner.block_cuts import AFTER, BEFORE, block_units, carries_weights, why_no_blocks
from planner.profiled import profiled_graph
from planner.plan import Plan
from planner.plan3d import plan_3d
from planner.search import CostCache, Shape, build, group_link, search, units
from profiler.graph import Layer, ModelGraph, TensorMeta
from strategies.catalog import update_s, weights_memory
from strategies.collectives import all_reduce_s, send_recv_s
from zoo import (
    ZOO, ZooModel, _DECODER, _hf, _seeded, _tokens, canonical_names, reference_once,
    token_loss,
)

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
# ZOO's GPT-2 ties its head to the token embedding: both ends of a pipeline hold a copy
MODELS = {m.name: m for m in (LLAMA4, GPT2_UNTIED, ZOO["llama"], ZOO["gpt2"])}


@functools.lru_cache(maxsize=None)
def _model(name: str):
    """One instance of each model, so that its trace is made once for every world size
    (planner.profiled keeps traces per instance; a Llama of four blocks is ~6 s here)."""
    return MODELS[name].make()


@functools.lru_cache(maxsize=None)
def _profiled(name: str, world: int):
    """(graph, cluster) of a model on `world` CPU devices, traced once per test session."""
    entry = MODELS[name]
    return profiled_graph(_model(name), f"{world}xcpu", entry.batch(0)[:entry.inputs],
                          {"use_cache": False}, measure=False)


def _plan(name: str, shape: Shape) -> Plan:
    graph, cluster = _profiled(name, shape.pp * shape.dp * shape.tp)
    return plan_3d(graph, cluster, "sgd", cluster.device.memory_bytes, time.perf_counter(),
                   only=[shape])


def _train_planned(rank, world, jobs):
    """Each job (model name, plan JSON): this rank's parameters and losses after STEPS."""
    out = []
    for name, plan_json in jobs:
        plan = Plan.from_json(plan_json)
        entry = MODELS[name]
        model = executor.parallelize(entry.make(), plan)
        opt = torch.optim.SGD(list(model.parameters()) or [{"params": []}], lr=LR,
                              foreach=False)
        losses = [executor.train_step(model, plan, entry.batch(step), entry.loss, opt)
                  for step in range(STEPS)]
        out.append(({k: p.detach().clone() for k, p in model.stage.named_parameters()},
                    losses))
    return out


def _assert_equal_to_one_process(name: str, plan: Plan, results: list) -> None:
    expected = reference_once(MODELS[name], STEPS)  # read-only, shared by its plans
    canonical = canonical_names(MODELS[name])
    if plan.mesh.size("pp") > 1:  # each rank holds its stage's parameters only
        assert all(len(params) < len(expected) for params, _ in results)
    seen = set()
    for rank, (params, losses) in enumerate(results):
        assert losses == pytest.approx(results[0][1], rel=1e-6), f"rank {rank}"
        for key, value in params.items():
            key = canonical[key]
            seen.add(key)
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected)  # every parameter lives on some stage


TWO_RANKS = {"llama_1f1b": ("llama4", Shape(2, 1, 1, 2, "1F1B")),
             # GPT-2 adds a learned position table before its blocks: the second stage
             # must not add it again (executor.hf_stages.PositionZeros)
             "gpt2_gpipe": ("gpt2_untied", Shape(2, 1, 1, 4, "GPipe")),
             # the tied embedding on stage 0 and head on stage 1: Megatron's embedding group
             "gpt2_tied_1f1b": ("gpt2", Shape(2, 1, 1, 2, "1F1B")),
             # zero bubble: GPT-2's stages hand back a view, which the schedule detaches in
             # place; the V puts the embedding and the head on rank 0, one weight there
             "gpt2_tied_zbv": ("gpt2", Shape(2, 1, 1, 4, "ZBVZeroBubble", 2)),
             # two blocks in four stages: one of the embeddings alone, one of the head alone
             "llama_interleaved": ("llama", Shape(2, 1, 1, 4, "Interleaved1F1B", 2)),
             # DualPipeV (what the search picks for Llama 7B and GPT-2 XL on 8 ranks): a V
             # whose ranks overlap one microbatch's forward with another's backward
             "llama_dualpipev": ("llama4", Shape(2, 1, 1, 4, "DualPipeV", 2)),
             # no pipeline: data parallel with 2 microbatches accumulated, one stage
             "llama_accumulated": ("llama", Shape(1, 2, 1, 2, "1F1B"))}


@pytest.fixture(scope="module")
def two_rank_runs():
    """Every 2-rank plan made here, then run in one launch (starting ranks is the slow part)."""
    plans = {key: _plan(name, shape) for key, (name, shape) in TWO_RANKS.items()}
    jobs = [(TWO_RANKS[key][0], plan.to_json()) for key, plan in plans.items()]
    per_rank = run_ranks(_train_planned, 2, jobs)
    return {key: (plans[key], [runs[i] for runs in per_rank]) for i, key in enumerate(plans)}


def _check(runs, key: str) -> Plan:
    name, shape = TWO_RANKS[key]
    plan, results = runs[key]
    assert plan.tracer == "export" and plan.mesh.shape == [shape.pp, shape.dp, shape.tp]
    _assert_equal_to_one_process(name, plan, results)
    return plan


def test_llama_two_stages_equal_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "llama_1f1b")
    first, last = plan.pipeline.stages
    assert first.modules[:2] == ["model.embed_tokens", "model.rotary_emb"]
    assert last.modules[-2:] == ["model.norm", "lm_head"]
    blocks = [m for s in plan.pipeline.stages for m in s.modules if ".layers." in m]
    assert blocks == [f"model.layers.{i}" for i in range(4)]


def test_gpt2_two_stages_gpipe_equal_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "gpt2_gpipe")
    assert plan.pipeline.stages[0].modules[:2] == ["transformer.wte", "transformer.wpe"]
    assert plan.pipeline.stages[-1].modules[-1] == "lm_head"


def test_gpt2_tied_embedding_and_head_on_two_stages_equal_single_process(two_rank_runs):
    """Each end holds the tied weight; their gradients summed over the embedding group keep
    both copies equal to the one process's single weight."""
    plan = _check(two_rank_runs, "gpt2_tied_1f1b")
    first, last = plan.pipeline.stages
    assert first.modules[0] == "transformer.wte" and last.modules[-1] == "lm_head"
    (embedding, _), (head, _) = two_rank_runs["gpt2_tied_1f1b"][1]
    assert "lm_head.weight" not in embedding and "transformer.wte.weight" not in head
    torch.testing.assert_close(embedding["transformer.wte.weight"], head["lm_head.weight"],
                               rtol=0, atol=0)
    assert not torch.equal(embedding["transformer.wte.weight"],
                           ZOO["gpt2"].make().transformer.wte.weight)  # it trained


def test_gpt2_tied_zero_bubble_v_equals_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "gpt2_tied_zbv")
    assert [s.pipeline_rank for s in plan.pipeline.stages] == [0, 1, 1, 0]


def test_llama_dualpipev_equals_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "llama_dualpipev")
    assert plan.pipeline.schedule == "DualPipeV"
    assert [s.pipeline_rank for s in plan.pipeline.stages] == [0, 1, 1, 0]


def test_llama_two_chunks_per_rank_equal_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "llama_interleaved")
    assert [s.pipeline_rank for s in plan.pipeline.stages] == [0, 1, 0, 1]
    assert [s.modules for s in plan.pipeline.stages] == [
        ["model.embed_tokens", "model.rotary_emb"], ["model.layers.0"], ["model.layers.1"],
        ["model.norm", "lm_head"]]


def test_llama_one_stage_with_accumulated_microbatches_equals_single_process(two_rank_runs):
    plan = _check(two_rank_runs, "llama_accumulated")
    assert plan.pipeline is None and plan.microbatches == 2


def test_llama_pipeline_times_data_parallel_4_ranks_equals_single_process():
    plan = _plan("llama4", Shape(2, 2, 1, 2, "1F1B"))
    per_rank = run_ranks(_train_planned, 4, [("llama4", plan.to_json())])
    _assert_equal_to_one_process("llama4", plan, [runs[0] for runs in per_rank])


# --- planning: cuts between blocks only -------------------------------------------------


def test_units_of_a_decoder_are_its_blocks_with_the_embeddings_and_the_head_around_them():
    graph, _ = _profiled("llama4", 2)
    assert list(dict.fromkeys(units(graph))) == (
        [BEFORE] + [f"model.layers.{i}" for i in range(4)] + [AFTER])


@pytest.mark.parametrize("shape", [Shape(2, 1, 1, 2, "1F1B"), Shape(4, 1, 1, 4, "1F1B"),
                                   Shape(2, 1, 1, 4, "Interleaved1F1B", 2),
                                   Shape(3, 1, 1, 4, "GPipe")])
def test_search_cuts_a_decoder_only_between_blocks(shape):
    graph, _ = _profiled("llama4", shape.pp)
    plan = _plan("llama4", shape)
    unit = dict(zip((l.name for l in graph.layers), units(graph)))
    stage_of_unit: dict[str, set] = {}
    for layer in plan.layers:
        stage_of_unit.setdefault(unit[layer.name], set()).add(layer.stage)
    assert all(len(stages) == 1 for stages in stage_of_unit.values()), stage_of_unit
    stages = plan.pipeline.stages
    assert stages[0].modules[0] == "model.embed_tokens" and stages[-1].modules[-1] == "lm_head"
    listed = [m for s in stages for m in s.modules]
    assert listed == ["model.embed_tokens", "model.rotary_emb",
                      *(f"model.layers.{i}" for i in range(4)), "model.norm", "lm_head"]


def test_a_cut_sends_the_hidden_state_alone_and_tp_holds_whole_rows_inside_a_node():
    """Positions, mask and rotary tables are recomputed by each stage: a cut between blocks
    costs the hidden state forward and its gradient back, nothing more. Tensor parallelism
    is offered where each microbatch's rows stay whole on every tp rank, with the module
    executor's strategies and no layout change it cannot make."""
    graph, cluster = _profiled("llama4", 4)
    rows = graph.batch_size // 2
    problem = build(CostCache(graph, cluster, "sgd"), 2, 1, 1, rows).problem
    hidden_bytes = rows * 8 * 32 * 4  # rows x sequence x width, fp32
    expected = 2 * send_recv_s(hidden_bytes, group_link(cluster, 2))
    for u in range(2, len(problem.units) - 1):  # cuts between two blocks
        assert problem.cut_s[u] == pytest.approx(expected, rel=1e-9), problem.units[u]
    result = search(graph, cluster, "sgd", None, max_microbatches=4, time_limit_s=20)
    assert result.best is not None and any(c.shape.pp > 1 for c in result.candidates)
    # tensor-parallel shapes (a cp shape is one group of all devices split by sequence)
    tp = [c.shape for c in result.candidates if c.shape.tp > 1 and c.shape.cp == 1]
    assert tp and all(s.rows(graph.batch_size) % s.tp for s in tp)
    assert not any(c.outcome == "infeasible" and "layout" in c.note for c in result.candidates)
    with_tp = build(CostCache(graph, cluster, "sgd"), 2, 1, 2, 1).problem
    names = {l.name: l.strategies for l in with_tp.layers}
    assert "head_parallel" in names["model.layers.0.self_attn"]
    assert "row_parallel" in names["model.layers.3.mlp.down_proj"]
    assert all(np.isfinite(e.cost_s).all() for e in with_tp.edges)


def test_auto_mesh_on_a_model_without_decoder_blocks_says_why_in_one_line():
    entry = ZOO["bert"]
    inputs, model = entry.batch(0)[:entry.inputs], entry.make()  # traced once for both
    plan = planner.optimize(model, "2xcpu", inputs, optimizer="sgd", measure=False,
                            mesh="auto")
    assert plan.pipeline is None and "not held by its base model" in plan.mesh_choice
    with pytest.raises(ValueError, match="transformer blocks") as error:
        planner.optimize(model, "2xcpu", inputs, optimizer="sgd", measure=False,
                         mesh="3d")
    assert "\n" not in str(error.value)


def _decoder_graph(op_before_blocks: str) -> ModelGraph:
    """Token ids -> embedding -> `op` -> two blocks of one Linear each -> head."""
    meta = TensorMeta((4, 8, 32), "float32", 4 * 8 * 32 * 4)

    def layer(name, node, kind, inputs, params=(), op="call_module"):
        return Layer(name=name, node=node, op=op, kind=kind, inputs=inputs, output=meta,
                     params=params)

    layers = (layer("input_ids", "input_ids", "input", (), op="placeholder"),
              layer("model.embed_tokens", "embedding", "Embedding", ("input_ids",),
                    ("model.embed_tokens.weight",)),
              layer(op_before_blocks, op_before_blocks, op_before_blocks, ("embedding",),
                    op="call_function"),
              layer("model.layers.0.mlp", "linear", "Linear", (op_before_blocks,),
                    ("model.layers.0.mlp.weight",)),
              layer("model.layers.1.mlp", "linear_1", "Linear", ("linear",),
                    ("model.layers.1.mlp.weight",)),
              layer("lm_head", "linear_2", "Linear", ("linear_1",), ("lm_head.weight",)))
    scopes = {"embedding": "model.embed_tokens", op_before_blocks: "model",
              "linear": "model.layers.0.mlp", "linear_1": "model.layers.1.mlp",
              "linear_2": "lm_head"}
    return ModelGraph("Decoder", layers, ("linear_2",), 4, "f", tracer="export",
                      blocks=("model.layers.0", "model.layers.1"), scopes=scopes)


def test_a_decoder_that_changes_the_hidden_state_before_its_blocks_is_not_cut():
    """A later stage resumes the model's forward from `inputs_embeds`: an added table or
    dropout there is undone on that stage (executor.hf_stages), a product is not."""
    assert why_no_blocks(_decoder_graph("add")) == ""
    assert block_units(_decoder_graph("add")) == [BEFORE] * 3 + [
        "model.layers.0", "model.layers.1", AFTER]
    why = why_no_blocks(_decoder_graph("mul"))
    assert "runs mul (mul) on the hidden state before its first block" in why
    assert block_units(_decoder_graph("mul")) is None


def test_a_tied_embedding_and_head_may_be_cut_apart_with_the_copy_priced_on_the_last_stage():
    """GPT-2's head reads the token embedding's weight: a pipeline puts the two on the
    first and last stage, and the last stage pays for its copy, memory and the gradient
    all-reduce with the first stage's once per step; a weight a block shares keeps the
    model uncut."""
    graph, cluster = _profiled("gpt2", 2)
    assert graph.tied_groups() and why_no_blocks(graph) == ""
    cache = CostCache(graph, cluster, "sgd")
    rows = graph.batch_size // 2
    alone, cut = (build(cache, pp, 1, 1, rows).problem for pp in (1, 2))
    embedding = next(l for l in graph.layers if l.name == "transformer.wte")
    head = next(i for i, l in enumerate(graph.layers) if l.name == "lm_head")
    assert graph.layers[head].params == embedding.params
    ctx = cache.layer(graph.layers[head], 1, rows).ctx
    copy_bytes = embedding.param_bytes
    assert alone.layers[head].weight_bytes[0] == 0  # one stage: the weight counted once
    assert cut.layers[head].weight_bytes[0] == weights_memory(copy_bytes, ctx)
    assert cut.layers[head].step_s[0] - alone.layers[head].step_s[0] == pytest.approx(
        all_reduce_s(copy_bytes, 2, group_link(cluster, 2)) + update_s(copy_bytes, ctx))
    # a V-shaped schedule puts both ends on one rank: one weight there, no copy
    v = build(cache, 2, 1, 1, rows, ends_together=True).problem
    assert v.layers[head].weight_bytes[0] == 0
    assert v.layers[head].step_s[0] == alone.layers[head].step_s[0]
    entry = ZOO["gpt2"]
    plan = planner.optimize(entry.make(), "2xcpu", entry.batch(0)[:entry.inputs],
                            optimizer="sgd", measure=False, mesh="3d")
    offered = [c for c in plan.search.best_per_shape if c.pp == 2]
    assert offered and all(c.outcome != "infeasible" for c in offered)
    tied_in_a_block = _decoder_graph("add")
    head_layer = tied_in_a_block.layers[-1]
    tied_in_a_block = replace(tied_in_a_block, layers=(
        *tied_in_a_block.layers[:-1], replace(head_layer, params=("model.layers.0.mlp.weight",))))
    assert "share a parameter inside its blocks" in why_no_blocks(tied_in_a_block)


def test_each_later_stage_pays_for_the_positions_and_mask_it_recomputes():
    """executor.hf_stages has every stage rerun the model's forward up to its blocks from
    the sequence length (positions, causal mask, rotary tables): the stage problem charges
    each stage after the first those layers' time per microbatch, the layers ahead of the
    blocks whose values depend on no weight, and nothing where the model is not cut."""
    graph, cluster = _profiled("llama4", 2)
    rows = graph.batch_size // 2
    cache = CostCache(graph, cluster, "sgd")
    problem = build(cache, 2, 1, 1, rows).problem
    unit = dict(zip((l.node for l in graph.layers), units(graph)))
    weighted = carries_weights(graph)
    replayed = [i for i, l in enumerate(graph.layers)
                if unit[l.node] == BEFORE and not l.is_input and l.node not in weighted]
    names = {graph.layers[i].name for i in replayed}
    # the position ids and the causal mask's ops (and_2: its last), not the embedding
    assert {"arange", "cumsum", "and_2"} <= names and "model.embed_tokens" not in names
    assert problem.replay_s == pytest.approx(
        sum(float(problem.layers[i].microbatch_s.min()) for i in replayed))
    assert problem.replay_s > 0
    assert build(cache, 1, 2, 1, rows).problem.replay_s == 0.0


def test_the_timeline_draws_a_stages_replay_and_split_backward_as_its_compute():
    """A later stage's compute is its layers' longer by the split backward (a zero-bubble
    schedule) plus the prologue it reruns: the plan keeps it per stage, and the timeline
    draws it as compute, not as communication."""
    from planner.report.plot import timeline_from_plan

    graph, cluster = _profiled("llama4", 2)
    graph = replace(graph, split_backward=1.25)  # as profiler.whole_step measures it
    shape = Shape(2, 1, 1, 4, "ZBVZeroBubble", 2)
    plan = plan_3d(graph, cluster, "sgd", cluster.device.memory_bytes, time.perf_counter(),
                   only=[shape])
    replay = build(CostCache(graph, cluster, "sgd"), 2, 1, 1, shape.rows(graph.batch_size),
                   ends_together=True).problem.replay_s
    assert replay > 0
    t = timeline_from_plan(plan)
    m = plan.pipeline.microbatches
    for st in plan.pipeline.stages:
        layers = sum(l.compute_s for l in plan.layers if l.stage == st.index) / m
        expected = min(1.25 * layers + (replay if st.index else 0.0), st.microbatch_s)
        assert st.compute_s == pytest.approx(expected, rel=1e-9)
        assert t.forward_s[st.index] + t.backward_s[st.index] == pytest.approx(st.compute_s)
        assert Plan.from_json(plan.to_json()).pipeline.stages[st.index] == st
