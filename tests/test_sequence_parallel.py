"""Sequence parallelism (strategies.sequence): priced as Megatron-SP says (the reduce-scatter
and all-gather send what the all-reduce sent; norms keep 1/P of their activation), chosen by
the solver where memory is tight or it pays, and run: a GPT planned with its norms and
residual adds split by tokens trains to the single-process parameters on 2 gloo ranks, and
as 2 pipeline stages of 2 tensor-parallel ranks each on 4."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import executor
import planner
from distributed import run_ranks
from models import assert_ranks_match
from planner.choices import layer_choices
from planner.ilp import solve
from profiler.trace import trace
from strategies import parse_devices
from strategies.catalog import CostContext, RowParallel, candidates
from strategies.collectives import collective_bytes
from strategies.edges import reshard_bytes, reshard_s
from strategies.layouts import Layout, edge_collectives
from strategies.sequence import SequenceParallel

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
import gpt  # noqa: E402

STEPS, VOCAB, LR = 3, 64, 0.05
SIZE = dict(layers=2, width=32, heads=4, seq=8, vocab=VOCAB)


def _model():
    torch.manual_seed(0)
    return gpt.GPT(**SIZE)


def _graph(rows: int = 2, seq: int = 8, width: int = 32):
    model = gpt.GPT(layers=1, width=width, heads=4, seq=seq, vocab=VOCAB)
    return trace(model, (torch.randint(0, VOCAB, (rows, seq)),),
                 leaf_modules=(gpt.CausalSelfAttention,))


def _layer(graph, name):
    return next(l for l in graph.layers if l.name == name)


def _ctx(ranks: int, rows: int) -> CostContext:
    return CostContext(cluster=parse_devices(f"{ranks}xA100-80GB"), ranks=ranks, batch=rows)


# --- pricing ---------------------------------------------------------------------------


def test_reduce_scatter_and_all_gather_send_the_all_reduces_bytes():
    """Row-parallel into tokens, then the edge into the next column split: forward a
    reduce-scatter and an all-gather, backward the same; plain TP all-reduces twice."""
    graph, ctx = _graph(), _ctx(4, 2)
    proj = _layer(graph, "h.0.mlp.proj")
    n = proj.output.nbytes
    sp = RowParallel(gives=Layout.SEQUENCE).cost(proj, ctx)
    tp = RowParallel(gives=Layout.REPLICATE).cost(proj, ctx)
    sp_sent = sp.notes["communication_bytes"] + reshard_bytes(
        Layout.SEQUENCE, Layout.REPLICATE_PARTIAL_GRAD, n, 4)
    tp_sent = tp.notes["communication_bytes"] + reshard_bytes(
        Layout.REPLICATE, Layout.REPLICATE_PARTIAL_GRAD, n, 4)
    assert sp_sent == pytest.approx(tp_sent) == pytest.approx(2 * collective_bytes("all_reduce", n, 4))
    assert edge_collectives(Layout.SEQUENCE, Layout.REPLICATE_PARTIAL_GRAD) == (
        "all_gather", "reduce_scatter")
    assert edge_collectives(Layout.SEQUENCE, Layout.SEQUENCE) == (None, None)
    # and a row-parallel output feeding a norm on its tokens changes no layout on the way
    assert reshard_s(Layout.SEQUENCE, Layout.SEQUENCE, n, 4, ctx.link) == 0.0


def test_norm_on_its_tokens_keeps_a_quarter_of_the_activation_on_four_ranks():
    graph, ctx = _graph(rows=1), _ctx(4, 1)  # one sequence: no rows to split
    norm = _layer(graph, "h.0.ln_2")
    names = [s.name for s in candidates(norm, ctx)]
    assert "sequence_parallel" in names and "data_parallel" not in names
    sp = SequenceParallel().cost(norm, ctx)
    whole = next(s for s in candidates(norm, ctx) if s.name == "replicate").cost(norm, ctx)
    weights = whole.memory_bytes - norm.activation_bytes
    assert sp.memory_bytes - weights == pytest.approx(norm.activation_bytes / 4)


def test_offered_only_where_the_sequence_splits():
    ctx = _ctx(4, 2)
    odd = _graph(seq=6)  # 6 tokens do not split 4 ways
    assert not SequenceParallel().applies(_layer(odd, "h.0.ln_2"), ctx)
    assert not RowParallel(gives=Layout.SEQUENCE).applies(_layer(odd, "h.0.mlp.proj"), ctx)
    graph = _graph()
    assert SequenceParallel().applies(_layer(graph, "h.0.ln_2"), ctx)
    # the residual add of two [batch, seq, hidden] tensors follows; the first add broadcasts
    # a [seq, hidden] position table, which would need a split of its own
    adds = [l for l in graph.layers if l.kind == "add"]
    assert [SequenceParallel().applies(l, ctx) for l in adds] == [False, True, True]
    assert not SequenceParallel().applies(_layer(graph, "h.0.mlp.fc"), ctx)  # a Linear


class _RMSNorm(torch.nn.Module):
    """An RMSNorm in plain ops, as Llama writes it: fx would trace into it."""

    def __init__(self, width):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(width))

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class _Block(torch.nn.Module):
    def __init__(self, width=16):
        super().__init__()
        self.fc, self.drop = torch.nn.Linear(width, width), torch.nn.Dropout(0.0)
        self.rms, self.ln = _RMSNorm(width), torch.nn.LayerNorm((8, width))

    def forward(self, x):
        return self.ln(self.rms(self.drop(self.fc(x))))


def test_offered_to_dropout_and_norms_over_the_hidden_dim():
    """Dropout and a registered RMSNorm (kept whole as one layer) may run on their tokens;
    a LayerNorm over (seq, hidden) mixes tokens and may not."""
    from strategies import register_sequencewise
    from strategies.catalog import leaf_types

    model, x = _Block(), torch.randn(2, 8, 16)
    register_sequencewise(_RMSNorm)
    graph = trace(model, (x,), leaf_modules=leaf_types(model))
    offered = {l.name: SequenceParallel().applies(l, _ctx(2, 2)) for l in graph.layers}
    assert offered == {"x": False, "fc": False, "drop": True, "rms": True, "ln": False}


def test_not_offered_where_code_reads_the_sizes():
    """Attention traced op by op reads `batch, seq, _ = x.shape` of the norm's output."""
    model = gpt.GPT(layers=1, width=32, heads=4, seq=8, vocab=VOCAB)
    graph = trace(model, (torch.randint(0, VOCAB, (2, 8)),))
    assert not SequenceParallel().applies(_layer(graph, "h.0.ln_1"), _ctx(2, 2))
    assert SequenceParallel().applies(_layer(graph, "h.0.ln_2"), _ctx(2, 2))


# --- the solver --------------------------------------------------------------------------


def _one_sequence_gpt(layers: int, width: int, seq: int):
    """A GPT on meta fed one sequence per step: a tensor-parallel group has no rows to split."""
    with torch.device("meta"):
        model = gpt.GPT(layers=layers, width=width, heads=16, seq=seq, vocab=1024)
        ids = torch.randint(0, 1024, (1, seq))
    return trace(model, (ids,), leaf_modules=(gpt.CausalSelfAttention,))


def _megatron(layer, options):
    """Model-parallel or whole, never rows split (nor sharded rows)."""
    return [s for s in options if s.name != "data_parallel" and not s.name.startswith("fsdp")]


def _megatron_without_sp(layer, options):
    return [s for s in _megatron(layer, options) if Layout.SEQUENCE not in (s.takes, s.gives)]


def _solved(graph, devices, budget_bytes, keep):
    choices = layer_choices(graph, parse_devices(devices), "adam", budget_bytes, keep=keep,
                            levers=False)
    solution = solve(choices.problem)
    assert solution.status == "optimal"
    names = {row.layer.name: row.strategies[solution.choice[i]].name
             for i, row in enumerate(choices.layers)}
    return names, choices.problem.memory_of(solution.choice), solution.objective_s


NORMS = ("h.0.ln_2", "h.1.ln_1", "h.1.ln_2")


def test_solver_splits_norms_by_tokens_where_memory_is_tight():
    """4 H100, one 2,048-token sequence: NVLink SHARP all-reduces faster than it
    reduce-scatters and all-gathers, so without a limit plain tensor parallelism wins; at
    85% of its memory the norms and residual adds run on their tokens."""
    graph = _one_sequence_gpt(layers=2, width=1024, seq=2048)
    free, tp_memory, tp_s = _solved(graph, "4xH100", None, _megatron)
    assert "sequence_parallel" not in free.values()
    tight, memory, time_s = _solved(graph, "4xH100", 0.85 * tp_memory, _megatron)
    assert memory <= 0.85 * tp_memory and time_s > tp_s
    assert {tight[n] for n in NORMS} == {"sequence_parallel"}


def test_solver_splits_norms_by_tokens_where_it_pays():
    """4 A100 (all-reduce = reduce-scatter + all-gather, in time as in bytes), one
    8,192-token sequence 2,048 wide: the norms and adds at 1/4 of the work pay for the
    all-gather into the first split, and the plan needs less memory as well."""
    graph = _one_sequence_gpt(layers=4, width=2048, seq=8192)
    plain, tp_memory, tp_s = _solved(graph, "4xA100-80GB", None, _megatron_without_sp)
    free, memory, time_s = _solved(graph, "4xA100-80GB", None, _megatron)
    assert time_s < tp_s and memory < tp_memory
    assert {free[n] for n in NORMS + ("h.3.ln_2", "ln_f")} == {"sequence_parallel"}


# --- executed: 2 and 4 gloo ranks equal one process ---------------------------------------


def _pins(model) -> dict[str, str]:
    """Megatron-SP on the GPT: attention by heads, MLP column-then-row, vocabulary-split
    embedding and LM head; every norm and residual add between them on its tokens."""
    layers = len(model.h)
    pin = {"wte": "vocab_parallel", "lm_head": "column_parallel", "ln_f": "sequence_parallel"}
    for i in range(layers):
        pin |= {f"h.{i}.attn": "head_parallel", f"h.{i}.mlp.fc": "column_parallel",
                f"h.{i}.mlp.act": "feature_parallel", f"h.{i}.mlp.proj": "row_parallel",
                f"h.{i}.ln_1": "sequence_parallel", f"h.{i}.ln_2": "sequence_parallel"}
    for k in range(1, 2 * layers + 1):
        pin[f"add_{k}"] = "sequence_parallel"  # the residual adds (add: the embeddings')
    return pin


def _batch(step, rows):
    g = torch.Generator().manual_seed(100 + step)
    ids = torch.randint(0, VOCAB, (rows, SIZE["seq"]), generator=g)
    return ids, torch.randint(0, VOCAB, (rows, SIZE["seq"]), generator=g)


def _train(model, shard, rows):
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        ids, targets = shard(_batch(step, rows))
        loss = F.cross_entropy(model(ids).flatten(0, 1), targets.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model


def _train_planned(rank, world, plan_json, rows):
    plan = planner.Plan.from_json(plan_json)
    model = _train(executor.parallelize(_model(), plan), lambda b: executor.shard_batch(plan, b),
                   rows)
    return executor.full_parameters(model, dict(_model().named_parameters()))


def test_gpt_sequence_parallel_matches_single_process():
    """2 ranks, one row each (each rank gets its rows of the logits back, as every 1-D
    plan hands them), the norms and residual adds pinned to their tokens."""
    model, ranks = _model(), 2
    pin = _pins(model)
    plan = planner.optimize(model, f"{ranks}xcpu", example_inputs=(_batch(0, ranks)[0],),
                            pin=pin, measure=False)
    by_name = {l.name: l for l in plan.layers}
    assert {k: by_name[k].strategy for k in pin} == pin
    for i in range(len(model.h)):  # the reductions reduce-scatter into tokens
        for name in (f"h.{i}.attn", f"h.{i}.mlp.proj"):
            assert by_name[name].output_layout == "sequence"
    line = next(l for l in plan.explain().splitlines() if l.startswith("Sequence parallel:"))
    assert "h.0.ln_1" in line and f"1/{ranks} of the tokens" in line
    results = run_ranks(_train_planned, ranks, plan.to_json(), ranks)
    expected = {k: v.detach() for k, v in _train(_model(), lambda b: b, ranks).named_parameters()}
    assert_ranks_match(results, expected)


def _loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def _train_3d(rank, world, plan_json, rows):
    from torch.distributed.tensor import DTensor

    plan = planner.Plan.from_json(plan_json)
    model = executor.parallelize(_model(), plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        executor.train_step(model, plan, _batch(step, rows), _loss, opt)
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.stage.named_parameters()}


def test_gpt_pipeline_of_sequence_parallel_stages_matches_single_process():
    """4 ranks: 2 pipeline stages (1F1B, 2 microbatches), each tensor-parallel over 2 with
    its norms on their tokens: the norms' gradients are summed over the stage's group."""
    from planner.plan3d import optimize_3d
    from planner.search import Shape

    model, rows = _model(), 4
    plan = optimize_3d(model, "4xcpu", (_batch(0, rows)[0],), measure=False,
                       only=[Shape(2, 1, 2, 2, "1F1B")], pin=_pins(model))
    assert plan.mesh.shape == [2, 1, 2]
    assert sum(l.strategy == "sequence_parallel" for l in plan.layers) == 9
    results = run_ranks(_train_3d, 4, plan.to_json(), rows)
    expected = {k: v.detach() for k, v in _train(_model(), lambda b: b, rows).named_parameters()}
    seen = set()
    for rank, params in enumerate(results):
        for key, value in params.items():
            seen.add(key)
            torch.testing.assert_close(value.reshape(expected[key].shape), expected[key],
                                       rtol=1e-5, atol=1e-6, msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected)
