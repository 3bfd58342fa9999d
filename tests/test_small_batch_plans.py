"""Batches too small to split by rows: fewer rows per microbatch than the tp group (3-D), or
a global batch that does not split over the devices (1-D). The planner still offers such
plans (one sequence per replica with tp is an LLM's usual case); the model's output is
then handed back whole over the group (planner.handback), the sink's gather is priced, and
every such plan runs on gloo ranks to the single-process parameters after 3 SGD steps."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import executor
import planner
from distributed import run_ranks
from planner.handback import output_layout, output_whole
from planner.plan3d import optimize_3d
from planner.search import Shape
from random_plans import random_plans
from strategies.layouts import Layout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

STEPS, VOCAB, SEQ, LR = 3, 64, 8, 0.05
# the practitioners' tensor-parallel GPT: heads and MLP split, logits split by vocab
MEGATRON = {"h.0.attn": "head_parallel", "h.0.mlp.fc": "column_parallel",
            "h.0.mlp.proj": "row_parallel", "lm_head": "column_parallel"}
SEQUENCE = {"h.0.ln_2": "sequence_parallel", "ln_f": "sequence_parallel"}  # norms on tokens


def _model():
    torch.manual_seed(0)
    return gpt.GPT(layers=1, width=32, heads=4, seq=SEQ, vocab=VOCAB)


def _batch(step: int, rows: int):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SEQ + 1), generator=g)
    return ids[:, :SEQ], ids[:, 1:]


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _full(model) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    inner = model.stage if hasattr(model, "stage") else getattr(model, "module", model)
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in inner.named_parameters()}


def _train_plans(rank, world, plans_json, rows):
    """Each plan from the same initial weights: (parameters, losses) after STEPS steps."""
    out = []
    for plan_json in plans_json:
        plan = planner.Plan.from_json(plan_json)
        model = executor.parallelize(_model(), plan)
        opt = torch.optim.SGD(list(model.parameters()) or [{"params": []}], lr=LR, foreach=False)
        losses = [executor.train_step(model, plan, _batch(step, rows), _loss, opt)
                  for step in range(STEPS)]
        out.append((_full(model), losses))
    return out


def _train_single(rows):
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        ids, targets = _batch(step, rows)
        loss = _loss(model(ids), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def _assert_all_equal_single(plans, world, rows):
    """Every plan runs on `world` gloo ranks and ends where one process does."""
    results = run_ranks(_train_plans, world, [p.to_json() for p in plans], rows)
    expected, expected_losses = _train_single(rows)
    for k, plan in enumerate(plans):
        seen = set()  # a pipeline stage holds its own layers' parameters
        for rank, per_rank in enumerate(results):
            params, losses = per_rank[k]
            assert losses == pytest.approx(expected_losses, rel=1e-5), f"plan {k}, rank {rank}"
            seen |= params.keys()
            for key, value in params.items():
                torch.testing.assert_close(value.reshape(expected[key].shape), expected[key],
                                           rtol=1e-5, atol=1e-6,
                                           msg=lambda m: f"plan {k}, rank {rank}, {key}: {m}")
        assert seen == expected.keys(), f"plan {k}"


def _optimize(world, rows, mesh, pin=None, shape=None):
    example = (_batch(0, rows)[0],)
    if shape is not None:
        return optimize_3d(_model(), f"{world}xcpu", example, measure=False, only=[shape],
                           pin=pin, optimizer="sgd")
    return planner.optimize(_model(), f"{world}xcpu", example, measure=False, mesh=mesh,
                            pin=pin, optimizer="sgd")


def test_rule_hands_back_rows_only_where_they_split_evenly():
    assert output_layout(4, 2) == Layout.BATCH
    assert output_layout(1, 2) == Layout.REPLICATE  # a rank without rows has no mean
    assert output_layout(3, 2) == Layout.REPLICATE  # uneven shares weigh means wrongly
    plan = _optimize(2, 1, "3d", shape=Shape(1, 1, 2, 1, "1F1B"))
    assert output_whole(plan) and [i.layout for i in plan.inputs] == ["replicate"]
    assert ("Output: handed back whole to every rank, the targets passed whole (a "
            "microbatch of 1 per replica does not split evenly over tp 2") in plan.explain()
    assert "a batch of 3 does not split evenly over 2 devices" in _optimize(2, 3, "1d").explain()
    assert "Output:" not in _optimize(2, 2, "1d").explain()


def test_gathering_the_vocab_split_logits_is_priced():
    """One sequence over tp 2 with vocab-split logits: the sink's edge all-gathers them."""
    from planner.search import CostCache, build

    model = _model()
    plan = _optimize(2, 1, "3d", pin=MEGATRON, shape=Shape(1, 1, 2, 1, "1F1B"))
    assert plan.layer("lm_head").output_layout == "feature"
    from planner.profiled import profiled_graph

    graph, cluster = profiled_graph(model, "2xcpu", (_batch(0, 1)[0],), measure=False)
    built = build(CostCache(graph, cluster, "sgd"), 1, 1, 2, 1)
    sink = len(built.problem.layers) - 1
    head = next(i for i, l in enumerate(graph.layers) if l.name == "lm_head")
    edge = next(e for e in built.problem.edges if e.dst == sink and e.src == head)
    split = [s.gives for s in built.strategies[head]].index(Layout.FEATURE)
    whole = [s.gives for s in built.strategies[head]].index(Layout.REPLICATE)
    assert edge.cost_s[split][0] > 0 and edge.cost_s[whole][0] == 0


def test_4_ranks_one_row_per_replica_equals_single_process():
    """2 rows on 4 ranks, the Megatron split with its vocab-split logits gathered whole:
    3-D dp 2 x tp 2 (1 row per replica), 2 pipeline stages of tp 2 (1 row per
    microbatch), and 1-D over all 4."""
    plans = [_optimize(4, 2, "3d", pin=MEGATRON, shape=Shape(1, 2, 2, 1, "1F1B")),
             _optimize(4, 2, "3d", pin=MEGATRON, shape=Shape(2, 1, 2, 2, "GPipe")),
             _optimize(4, 2, "1d", pin=MEGATRON)]
    assert all(output_whole(p) and p.layer("lm_head").output_layout == "feature"
               for p in plans)
    _assert_all_equal_single(plans, 4, 2)


@pytest.mark.parametrize("world,rows", [(2, 1), (2, 3)])
def test_every_offered_plan_runs(world, rows):
    """Property: over small batches that do not split over the devices, the optimizer's
    plans (1-D, 3-D, and 3-D over every unpipelined shape it may pick), the Megatron split
    (1-D and tp 2, with and without its norms on tokens) and random plans it could have offered (tests/random_plans) all run on
    gloo ranks and equal one process."""
    from planner.search import shapes

    example = (_batch(0, rows)[0],)
    tp = Shape(1, 1, world, 1, "1F1B")
    megatron = [_optimize(world, rows, mesh, pin=pin, shape=shape)
                for pin in (MEGATRON, {**MEGATRON, **SEQUENCE})
                for mesh, shape in (("1d", None), ("3d", tp))]
    assert all(output_whole(p) and p.layer("lm_head").output_layout == "feature"
               for p in megatron)
    plans = [_optimize(world, rows, "1d"), _optimize(world, rows, "3d"), *megatron]
    plans += [_optimize(world, rows, "3d", shape=s) for s in shapes(world, rows)
              if s.pp == 1]  # pipelines: tests/test_pipeline_*
    plans += random_plans(_model(), f"{world}xcpu", example, count=3, seed=rows)
    assert all(output_whole(p) for p in plans if not p.is_mesh_3d)
    _assert_all_equal_single(plans, world, rows)


def _run_zoo(rank, world, jobs, rows):
    import test_zoo
    import zoo

    zoo.ROWS = rows  # the zoo's batches read it per call
    return test_zoo.run_plans(rank, world, jobs)


def test_hugging_face_decoder_one_sequence_on_2_ranks(monkeypatch):
    """torch.export graphs (the module executor): one sequence of Llama and of GPT-2 (tied
    embeddings) on 2 devices, the optimizer's plan and a vocab-split head's."""
    import test_zoo
    import zoo

    monkeypatch.setattr(zoo, "ROWS", 1)
    jobs = [(name, "optimum", test_zoo.make_plan(name, "optimum").to_json())
            for name in ("llama", "gpt2")]
    entry = zoo.ZOO["llama"]
    split = planner.optimize(entry.make(), "2xcpu", example_inputs=entry.batch(0)[:1],
                             optimizer="sgd", measure=False, pin={"lm_head": "column_parallel"})
    assert output_whole(split) and split.layer("lm_head").output_layout == "feature"
    jobs.append(("llama", "split head", split.to_json()))
    test_zoo.assert_runs_match(jobs, run_ranks(_run_zoo, 2, jobs, 1))
