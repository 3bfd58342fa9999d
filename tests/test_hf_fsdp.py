"""FSDP over the dp group and tensor parallelism over the tp group inside pipelines of
Hugging Face decoders (torch.export graphs): the 3-D search offers "<strategy>+fsdp" for a
layer that is one module of the model (planner.dp_shard) and, with tp inside a node, the
module executor's tensor-parallel strategies; executor.hf_stages runs them as DTensor
styles over the tp sub-mesh, then FSDP2 `fully_shard` over the dp sub-mesh (a 2-D mesh
beside tp), and after 3 SGD steps every parameter equals the single-process run's."""

import time

import pytest
import torch
from torch.distributed.tensor import DTensor

import executor
from distributed import run_ranks
from planner.plan import Plan
from planner.plan3d import plan_3d
from planner.search import CostCache, Shape, build
from test_hf_pipeline import LR, MODELS, STEPS, _profiled
from zoo import reference

# Linear layers, a whole attention module (four weights) and the head
PIN = {"model.layers.0.mlp.gate_proj": "data_parallel+fsdp",
       "model.layers.1.self_attn": "data_parallel+fsdp",
       "model.layers.3.mlp.down_proj": "data_parallel+fsdp",
       "lm_head": "data_parallel+fsdp",
       "model.layers.2.mlp.up_proj": "data_parallel"}
# 1F1B with blocks checkpointed as well (planner.pipeline.block_recompute): the solve, given room,
# checkpoints none; the test lists a subset (RECOMPUTED) to run exactly those
FOUR_RANKS = {"1f1b_recompute": Shape(2, 2, 1, 2, "1F1B", recompute=True),
              "interleaved": Shape(2, 2, 1, 2, "Interleaved1F1B", 2)}
RECOMPUTED = ["model.layers.0", "model.layers.3"]
# Megatron's split of every block (heads, then the MLP's column and row halves), the
# embedding by vocabulary and the head by columns; one row per microbatch, whole on both
# tp ranks (planner.search.tp_whole_rows)
TP = {"model.embed_tokens": "vocab_parallel", "lm_head": "column_parallel",
      **{f"model.layers.{i}.{path}": style for i in range(4) for path, style in (
          ("self_attn", "head_parallel"), ("mlp.gate_proj", "column_parallel"),
          ("mlp.up_proj", "column_parallel"), ("mlp.down_proj", "row_parallel"))}}
# 2-D FSDP x TP: some of them sharded over dp as well
TP_FSDP = {**TP, "model.layers.0.mlp.gate_proj": "column_parallel+fsdp",
           "model.layers.1.self_attn": "head_parallel+fsdp", "lm_head": "column_parallel+fsdp"}
TENSOR_PARALLEL = {"pp2_tp2": (Shape(2, 1, 2, 4, "1F1B"), TP),
                   "dp2_tp2_fsdp": (Shape(1, 2, 2, 2, "1F1B"), TP_FSDP)}


def _plan(shape: Shape, pin: dict) -> Plan:
    graph, cluster = _profiled("llama4", shape.pp * shape.dp * shape.tp)
    return plan_3d(graph, cluster, "sgd", cluster.device.memory_bytes, time.perf_counter(),
                   only=[shape], pin=pin)


def _train(rank, world, plans):
    """Per plan JSON: this rank's whole parameters (FSDP shards gathered), losses, the
    parameters FSDP or DTensor own, how many of its modules run checkpointed, and the
    width of what its MLPs' activations computed."""
    out = []
    for plan_json in plans:
        plan = Plan.from_json(plan_json)
        entry = MODELS["llama4"]
        model = executor.parallelize(entry.make(), plan)
        widths = set()
        for chunk in model.chunks:
            for name, m in chunk.named_modules():
                if name.endswith("mlp.act_fn"):
                    m.register_forward_hook(lambda m, a, y: widths.add(y.shape[-1]))
        opt = torch.optim.SGD(list(model.parameters()) or [{"params": []}], lr=LR,
                              foreach=False)
        losses = [executor.train_step(model, plan, entry.batch(step), entry.loss, opt)
                  for step in range(STEPS)]
        params = {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                  for k, p in model.stage.named_parameters()}
        owned = sorted(k for k, p in model.stage.named_parameters() if isinstance(p, DTensor))
        checkpointed = sum(getattr(m.forward, "__name__", "") == "recomputed"
                           for chunk in model.chunks for m in chunk.modules())
        out.append((params, losses, owned, checkpointed, widths))
    return out


def _assert_equal_to_one_process(results) -> None:
    expected = reference(MODELS["llama4"], STEPS)
    seen = set()
    for rank, (params, losses, *_) in enumerate(results):
        assert losses == pytest.approx(results[0][1], rel=1e-6), f"rank {rank}"
        for key, value in params.items():
            seen.add(key)
            torch.testing.assert_close(value, expected[key], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected)


def _sharded(plan: Plan) -> set[str]:
    return {l.name for l in plan.layers if l.dp_shard}


def test_export_layers_that_are_whole_modules_get_the_sharded_option():
    graph, cluster = _profiled("llama4", 4)
    built = build(CostCache(graph, cluster, "sgd"), 2, 2, 1, 2)
    names = {l.name: l.strategies for l in built.problem.layers}
    for layer in ("model.layers.0.mlp.gate_proj", "model.layers.1.self_attn", "lm_head",
                  "model.embed_tokens", "model.norm"):
        assert any(n.endswith("+fsdp") for n in names[layer]), layer
    weightless = [l.name for l in graph.layers if l.param_bytes == 0]
    assert weightless and not any(n.endswith("+fsdp") for w in weightless for n in names[w])


def test_decoder_pipelines_with_fsdp_and_tp_4_ranks_equal_single_process():
    plans = {key: _plan(shape, PIN) for key, shape in FOUR_RANKS.items()}
    assert not plans["1f1b_recompute"].recompute_blocks  # memory is free: no extra forward
    plans["1f1b_recompute"] = plans["1f1b_recompute"].model_copy(
        update={"recompute_blocks": RECOMPUTED})
    for plan in plans.values():
        assert plan.tracer == "export" and plan.pipeline is not None
        assert _sharded(plan) == {k for k, v in PIN.items() if v.endswith("+fsdp")}
    assert plans["interleaved"].pipeline.chunks == 2
    assert plans["1f1b_recompute"].recompute_blocks and not plans["interleaved"].recompute_blocks
    tp_plans = {key: _plan(shape, pin) for key, (shape, pin) in TENSOR_PARALLEL.items()}
    for key, plan in tp_plans.items():
        pin = TENSOR_PARALLEL[key][1]
        assert plan.mesh.shape == [TENSOR_PARALLEL[key][0].pp, TENSOR_PARALLEL[key][0].dp, 2]
        assert {l.name: l.strategy for l in plan.layers if l.name in pin} == {
            k: v.removesuffix("+fsdp") for k, v in pin.items()}
        assert _sharded(plan) == {k for k, v in pin.items() if v.endswith("+fsdp")}
        # torchtitan's MLP: the SiLU and the product on each rank's feature shard
        act = {l.node for l in plan.layers if l.name.endswith("mlp.act_fn")}
        between = [l.strategy for l in plan.layers if l.node in act or act & set(l.inputs)]
        assert between == ["feature_parallel"] * 8, between
    per_rank = run_ranks(_train, 4, [p.to_json() for p in [*plans.values(), *tp_plans.values()]])
    for i, key in enumerate(tp_plans, start=len(plans)):
        results = [runs[i] for runs in per_rank]
        _assert_equal_to_one_process(results)
        # every tensor-parallel weight is a DTensor on its stage's ranks
        owned = set().union(*(set(r[2]) for r in results))
        assert {"model.layers.3.mlp.down_proj.weight", "lm_head.weight",
                "model.embed_tokens.weight"} <= owned, (key, owned)
        # ... and the activations ran on local shards: half the 64 features each
        assert set().union(*(r[4] for r in results)) == {32}, key
    for i, key in enumerate(plans):
        results = [runs[i] for runs in per_rank]
        _assert_equal_to_one_process(results)
        # FSDP owns exactly the pinned modules' weights, on the ranks of their stage
        owned = set().union(*(set(r[2]) for r in results))
        assert owned and all(any(o.startswith(m + ".") for m in _sharded(plans[key]))
                             for o in owned), (key, owned)
        assert "model.layers.2.mlp.up_proj.weight" not in owned
    # the checkpointed plan's ranks run the listed blocks of their stage checkpointed, the
    # others plainly: 4 ranks, pp2 x dp2, block recompute beside FSDP, equal to one process
    stages = plans["1f1b_recompute"].pipeline.stages
    blocks = [sum(m in RECOMPUTED for m in stage.modules) for stage in stages]
    assert blocks == [1, 1]
    stage_of = {r: k for k, stage in enumerate(stages) for r in stage.ranks}
    assert [runs[0][3] for runs in per_rank] == [blocks[stage_of[r]] for r in range(4)]


def test_fsdp_without_a_pipeline_2_ranks_equals_single_process():
    pin = {"model.layers.0.mlp.gate_proj": "data_parallel+fsdp",
           "model.layers.2.self_attn": "data_parallel+fsdp", "lm_head": "data_parallel+fsdp"}
    plan = _plan(Shape(1, 2, 1, 2, "1F1B"), pin)
    assert plan.pipeline is None and _sharded(plan) == set(pin)
    per_rank = run_ranks(_train, 2, [plan.to_json()])
    results = [runs[0] for runs in per_rank]
    _assert_equal_to_one_process(results)
    assert {o.rsplit(".", 1)[0] for o in results[0][2]} >= {"lm_head"}
