"""Context parallelism: the head-tail split and its inverse; the "cp" baseline's plan
(planner.context_plan) run by executor.parallelize for 3 SGD steps, cp 2 on 2 gloo ranks
and dp 2 x cp 2 on 4 (DDP, FSDP2 with recomputation, FSDP2 on the MLPs only), leaving the
parameters of one process's 3 steps on the whole batch, for a tiny Hugging Face Llama and
the fx GPT of examples/gpt.py (float64); the layers a mix cannot shard; the price of a
block (strategies.context) on hand-counted bytes; the baseline's mesh, record and
refusals."""

from __future__ import annotations

from itertools import product

import pytest
import torch
import torch.nn.functional as F

from executor.context_parallel import (
    IGNORE_INDEX,
    join_sequence,
    shift_labels,
    split_sequence,
    token_loss,
    weight_mode,
)
from planner import Plan
from tests.distributed import run_ranks

VOCAB, SEQ, ROWS, STEPS, LR = 64, 16, 2, 3, 0.5


def _llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ,
        attention_dropout=0.0, use_cache=False, bos_token_id=0, eos_token_id=0,
        pad_token_id=0)
    return transformers.LlamaForCausalLM(config).double().train()


def _gpt():
    from examples.gpt import GPT

    torch.manual_seed(0)
    return GPT(layers=2, width=32, heads=4, seq=SEQ, vocab=VOCAB).double()


MODELS = {"llama": _llama, "gpt": _gpt}


def _ids(step: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (ROWS, SEQ), generator=torch.Generator().manual_seed(step))


def _logits(output):
    return getattr(output, "logits", output)


def _reference(name: str) -> dict[str, torch.Tensor]:
    model = MODELS[name]()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = _ids(step)
        logits = _logits(model(ids))
        opt.zero_grad()
        F.cross_entropy(logits.flatten(0, 1), shift_labels(ids).flatten(),
                        ignore_index=IGNORE_INDEX).backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _plans(models: dict, devices: str) -> dict[str, str]:
    """The "cp" baseline of each model on `devices` at cp 2, as JSON (made once, in the
    parent, from one instance per model: traced once; priced without timing layers here;
    the best degree on 2 CPU ranks is cp 1, which moves no K/V)."""
    from planner.baseline import baseline

    return {name: baseline(model, devices, "cp", (_ids(0),), cp=2, measure=False).to_json()
            for name, model in models.items()}


def _sharded_recomputed(plan):
    """`plan` with its weights FSDP2-sharded over the mesh (the mode the planner picks where
    DDP's replicas do not fit), a Llama's first block recomputed whole (full AC) and every
    MLP projection outside it recomputed alone."""
    layers = [l.model_copy(update={"recompute": ".mlp." in l.name and l.param_bytes > 0})
              for l in plan.layers]
    cp = plan.context_parallel.model_copy(update={"sharded": True})
    blocks = ["model.layers.0"] if plan.tracer == "export" else []
    return plan.model_copy(update={"context_parallel": cp, "layers": layers,
                                   "recompute_blocks": blocks})


def _mixed(plan):
    """`plan` with its MLP layers' weights FSDP2-sharded (`dp_shard`, as the 3-D search
    writes it) and every other layer's replicated."""
    layers = [l.model_copy(update={"dp_shard": ".mlp." in l.name and l.param_bytes > 0})
              for l in plan.layers]
    return plan.model_copy(update={"layers": layers})


def _searched(model, share: float = 0.8):
    """The 3-D search's plan of `model` on its cp 2 x dp 2 shape alone, within `share` of
    the memory its unconstrained plan takes (so its program shards some layers' weights)."""
    from planner.plan3d import optimize_3d
    from planner.search import Shape

    only = [Shape(1, 1, 4, 1, "1F1B", cp=2)]
    free = optimize_3d(model, "4xcpu", (_ids(0),), measure=False, only=only)
    return optimize_3d(model, "4xcpu", (_ids(0),), measure=False, only=only,
                       memory_limit_bytes=share * max(free.predicted.memory_bytes))


def _random_cp(plan, seed: int):
    """`plan` with its options drawn at random (seeded): each layer with weights sharded or
    not (`dp_shard`, as the 3-D search writes it, or a `+fsdp` strategy, as the cp baseline
    does) and recomputed or not, each of a Llama's blocks recomputed whole or not (the plan
    kind's choices, as tests/random_plans.py draws the others'): a mix of DDP and FSDP2."""
    import random

    rng = random.Random(seed)
    layers = []
    for l in plan.layers:
        update = {"recompute": l.param_bytes > 0 and rng.random() < 0.3}
        if l.param_bytes > 0 and rng.random() < 0.5:
            if rng.random() < 0.5:
                update["dp_shard"] = True
            else:
                update["strategy"] = l.strategy + "+fsdp"
        layers.append(l.model_copy(update=update))
    blocks = ([b for b in ("model.layers.0", "model.layers.1") if rng.random() < 0.5]
              if plan.tracer == "export" else [])
    return plan.model_copy(update={"layers": layers, "recompute_blocks": blocks})


def _ranks(rank: int, world: int, plans: dict[str, str]) -> dict:
    """Each model's cp plan through executor.parallelize and shard_batch, 3 SGD steps; on 4
    ranks (dp 2 x cp 2) the cp baseline also with FSDP and recomputation, and with the MLPs
    alone FSDP (the search's and the random plans are such mixes already), and a padding
    mask refused."""
    from planner import Plan

    out = {}
    for run, text in plans.items():
        plan, name = Plan.from_json(text), run.split()[0]
        out[run] = _train(name, plan)
        if world == 4 and run == name:  # the cp baseline
            out[run + " fsdp+recompute"] = _train(name, _sharded_recomputed(plan))
            out[run + " mixed"] = _train(name, _mixed(plan))
    if world == 4:
        import executor

        model = executor.parallelize(_llama(), Plan.from_json(plans["llama"]))
        ids = executor.shard_batch(Plan.from_json(plans["llama"]), (_ids(0),))[0]
        try:  # a padding mask would be dropped by transformers: refused first
            model(ids, attention_mask=torch.ones_like(ids))
        except ValueError as error:
            out["padding"] = str(error)
    return out


def _train(name: str, plan) -> dict:
    import executor

    model = executor.parallelize(MODELS[name](), plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        ids = _ids(step)
        inputs, labels = executor.shard_batch(plan, (ids, shift_labels(ids)))
        logits = _logits(model(inputs))
        opt.zero_grad()
        token_loss(logits, labels).backward()
        opt.step()
    inner = getattr(model, "module", model)  # DDP keeps it as .module; FSDP in place
    return {k: getattr(v, "full_tensor", lambda v=v: v)().detach()
            for k, v in inner.named_parameters()}


def test_split_sequence_balances_causal_work_and_joins_back():
    whole = torch.arange(2 * 12).view(2, 12)
    parts = [split_sequence(whole, r, 3) for r in range(3)]
    assert parts[0][0].tolist() == [0, 1, 10, 11]  # chunks 0 and 5 of 6
    assert parts[2][0].tolist() == [4, 5, 6, 7]  # chunks 2 and 3
    # under a causal mask each rank's queries see the same number of keys
    assert len({int((p[0] + 1).sum()) for p in parts}) == 1
    assert torch.equal(join_sequence(parts), whole)
    with pytest.raises(ValueError, match="2·cp = 8 equal chunks"):
        split_sequence(whole, 0, 4)


def test_cp_plans_train_like_one_process():
    """planner.baseline(..., "cp") + executor.parallelize: cp 2 on 2 ranks (and cp 1 x dp
    2), cp 2 x dp 2 on 4 (DDP, FSDP2 with a recomputed block and MLPs, and FSDP2 on the
    MLPs only), cp 4 with its options drawn at random (each layer sharded or not), and the
    3-D search's cp 2 x dp 2 plan (its program's mix of DDP and FSDP2), 3 steps each,
    parameters equal to one process's steps on the whole batch."""
    from planner.baseline import baseline

    models = {name: make() for name, make in MODELS.items()}
    plans = {2: _plans(models, "2xcpu"), 4: _plans(models, "4xcpu")}
    for world, made in plans.items():
        for text in made.values():
            plan = Plan.from_json(text)  # DDP over the mesh: FSDP2 is the variant below
            assert plan.mesh.shape == [world // 2, 2] and not plan.context_parallel.sharded
    # the family's data-parallel end, cp 1 x dp 2: the same executor path
    plans[2]["gpt cp1"] = baseline(models["gpt"], "2xcpu", "cp", (_ids(0),), cp=1,
                                   measure=False).to_json()
    # cp 4 (every rank one group), its options drawn at random, two draws per model
    for name, model in models.items():
        cp4 = baseline(model, "4xcpu", "cp", (_ids(0),), cp=4, measure=False)
        for seed in (0, 1):
            drawn = _random_cp(cp4, seed)
            assert isinstance(weight_mode(drawn), list)  # a mix: some layers sharded
            plans[4][f"{name} cp4 random {seed}"] = drawn.to_json()
    # the 3-D search's own cp 2 x dp 2 plan (a cp degree of the search, Shape.cp), under a
    # memory limit that makes its program shard some layers' weights and not others
    for name, model in models.items():
        made = _searched(model)
        assert made.mesh.shape == [2, 2] and isinstance(weight_mode(made), list)
        plans[4][f"{name} search"] = made.to_json()
    results = {world: run_ranks(_ranks, world, plans[world]) for world in plans}
    worst = 0.0
    for name in MODELS:
        expected = _reference(name)
        for world, got_ranks in results.items():
            runs = [run for run in got_ranks[0] if run.split()[0] == name]
            for (rank, result), run in product(enumerate(got_ranks), runs):
                got = result[run]
                assert got.keys() == expected.keys(), run
                for key, value in expected.items():
                    torch.testing.assert_close(got[key], value, rtol=1e-9, atol=1e-11,
                                               msg=f"{run} on {world} ranks, rank {rank} {key}")
                    worst = max(worst, float((got[key] - value).abs().max()))
    assert all("pass no attention_mask" in r["padding"] for r in results[4])
    print(f"largest parameter difference: {worst:.3g}")


def test_a_mix_refuses_layers_fsdp2_cannot_shard_alone():
    """Which modules a mix shards (each owner of weights under a sharded layer, deepest
    first), and the layers it refuses, named with the fix: no module, a weight shared with
    a replicated module, a module an fx graph reads without calling, a replicated layer
    inside a sharded one."""
    from types import SimpleNamespace

    from torch import fx, nn

    from executor.context_parallel import _shard_units
    from planner.plan import LayerPlan

    class Scaled(nn.Module):  # fx inlines its forward: reads .scale without a call
        def __init__(self):
            super().__init__()
            self.fc, self.scale = nn.Linear(4, 4), nn.Parameter(torch.ones(4))

        def forward(self, x):
            return self.fc(x) * self.scale

    net = nn.Sequential(Scaled(), nn.Linear(4, 4))
    graph = fx.symbolic_trace(net)
    assert _shard_units(net, ["0"]) == [net[0].fc, net[0]]  # eager: both are called
    assert _shard_units(graph, ["0.fc", "1"]) == [graph.get_submodule("1"),
                                                  graph.get_submodule("0.fc")]
    with pytest.raises(ValueError, match="layer '0' is marked sharded, but the traced "
                                         "graph reads the weights of '0'.*leave '0' repl"):
        _shard_units(graph, ["0"])
    with pytest.raises(ValueError, match="layer 'mul' is marked sharded, but Sequential has no "
                                         "module at that path.*dp_shard=False"):
        _shard_units(graph, ["mul"])
    net[1].weight = net[0].fc.weight  # tied
    with pytest.raises(ValueError, match="'1.weight' of a sharded layer is shared"):
        _shard_units(net, ["1"])

    def layer(name, dp_shard):
        return LayerPlan.model_construct(name=name, param_bytes=4, dp_shard=dp_shard,
                                         strategy="x")

    plan = SimpleNamespace(context_parallel=SimpleNamespace(sharded=False),
                           layers=[layer("a", True), layer("a.b", False), layer("c", False)])
    with pytest.raises(ValueError, match="'a.b' is replicated inside layer 'a'.*shard both"):
        weight_mode(plan)
    plan.layers[1] = plan.layers[1].model_copy(update={"dp_shard": True})
    assert weight_mode(plan) == ["a", "a.b"]
    plan.layers[2] = plan.layers[2].model_copy(update={"strategy": "token_shard+fsdp"})
    assert weight_mode(plan) is True


def test_context_parallel_price_counts_kv_gather_and_scatter_bytes():
    # a Llama-like block: 8 query heads of 64 over 2 K/V heads, 2 rows of 1,024 tokens in
    # float32, on 4 ranks of a 1 GB/s link with 1 ms per message
    from torch import nn

    from profiler.graph import Layer, TensorMeta
    from strategies.catalog import CostContext
    from strategies.cluster import Cluster
    from strategies.context import context_parallel_cost
    from strategies.devices import DeviceSpec, LinkSpec

    device = DeviceSpec(name="cpu", kind="cpu", peak_flops={"float32": 1e11}, efficiency=1.0,
                        memory_bytes=1e10, memory_bandwidth_bytes_per_s=1e10)
    link = LinkSpec(name="l", bandwidth_bytes_per_s=1e9, latency_s=1e-3)
    cluster = Cluster(device=device, devices_per_node=4, intra_node=link, inter_node=link)
    out = 2 * 1024 * 512 * 4  # 4 MiB
    layer = Layer(name="block", node="block", op="call_module", kind="LlamaDecoderLayer",
                  inputs=(), output=TensorMeta((2, 1024, 512), "float32", out),
                  module_type=nn.Module, attrs={"num_attention_heads": 8,
                                                "num_key_value_heads": 2},
                  param_bytes=2**20, param_count=2**18, fwd_flops=4e9, bwd_flops=8e9)
    ctx = CostContext(cluster=cluster, ranks=1, batch=2, optimizer="sgd")
    cost = context_parallel_cost(layer, 4, ctx)
    kv = 2 * (2 * 1024) * 2 * 64 * 4  # K and V: rows x tokens x kv heads x head dim, fp32
    assert cost.notes["kv_bytes"] == kv == 2 * 2**20
    # all-gather and reduce-scatter each send 3/4 of it from every rank
    assert cost.notes["kv_sent_bytes"] == 2 * 3 / 4 * kv
    assert cost.communication_s == pytest.approx(2 * (3 * 1e-3 + 3 / 4 * kv / 1e9))
    whole = context_parallel_cost(layer, 1, ctx)
    assert whole.communication_s == 0 and cost.compute_s == pytest.approx(whole.compute_s / 4)
    # a quarter of the activations and the gathered K/V kept for backward, weights whole
    assert cost.memory_bytes - whole.memory_bytes == pytest.approx(out / 4 - out + kv)
    assert cost.notes["gradient_sent_bytes"] == 2 * 3 / 4 * 2**20  # DDP's all-reduce
    assert cost.notes["communication_bytes"] == 2 * 3 / 4 * (kv + 2**20)  # both, per step
    with pytest.raises(ValueError, match="2·cp = 6"):
        context_parallel_cost(layer, 3, ctx)


def test_cp_baseline_is_the_fastest_cp_x_dp_plan_with_a_cp_mesh():
    from planner import Plan
    from planner.baseline import baseline

    plan = baseline(_llama(), "4xcpu", "cp", (_ids(0),))
    cp = plan.context_parallel
    assert plan.mesh.dim_names == ["dp", "cp"] and plan.mesh.shape == [4 // cp.degree, cp.degree]
    assert plan.mesh.groups["cp"][0] == list(range(cp.degree))
    strategies = {l.name: l.strategy for l in plan.layers}
    assert strategies["model.layers.0.self_attn"].startswith("context_parallel")
    assert strategies["model.layers.0.mlp.up_proj"].startswith("token_shard")
    # every (degree, weights) candidate is named in why, the chosen one the fastest fitting
    # cp 1 would need dp 4 over a batch of 2
    assert all(f"cp {d} {w}" in cp.why for d in (2, 4) for w in ("DDP", "FSDP"))
    assert "Context parallel: cp" in plan.explain()
    assert Plan.from_json(plan.to_json()) == plan
    old = plan.model_dump(mode="json")
    del old["context_parallel"]  # a plan file from before context parallelism
    assert Plan.model_validate(old).context_parallel is None
    from executor import train_step

    model = torch.nn.Linear(2, 2)  # refused before anything runs: its loss needs token_loss
    with pytest.raises(ValueError, match="token_loss"):
        train_step(model, plan, (_ids(0),), None, torch.optim.SGD(model.parameters()))


def test_cp_baseline_refuses_a_model_without_attention_or_an_unsplit_sequence():
    from planner.baseline import baseline

    mlp = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
    with pytest.raises(ValueError, match="has none"):
        baseline(mlp, "2xcpu", "cp", (torch.randn(2, 16, 8),))
    from examples.gpt import GPT

    gpt = GPT(layers=1, width=16, heads=2, seq=6, vocab=VOCAB)
    with pytest.raises(ValueError, match="2·cp equal chunks"):
        baseline(gpt, "4xcpu", "cp", (torch.zeros(2, 6, dtype=torch.long),))


def test_cp_degrees_divide_devices_sequence_and_batch():
    from planner.context_degrees import degrees

    assert degrees(8, 8, 32768) == [1, 2, 4, 8]  # torchtitan's 32K job: any degree
    assert degrees(8, 2, 131072) == [4, 8]  # dp = 8 / cp must split 2 rows
    assert degrees(8, 1, 12) == []  # one row: only cp 8 splits it, and 12 is no 16 chunks


def test_hyplan_plan_kind_cp_for_a_long_sequence(tmp_path, capsys):
    from planner.cli import main
    from test_presets import llama_config_file

    path = llama_config_file(tmp_path, 4096)
    argv = ["plan", str(path), "--devices", "4xH100", "--seq", "4096", "--batch", "1"]
    assert main([*argv, "--kind", "cp"]) == 0
    out = capsys.readouterr().out  # one sequence on 4 devices: only cp 4 splits it
    assert "Context parallel: cp 4 x dp 1" in out and "tokens/s per device" in out


def test_the_3d_search_weighs_cp_degrees_beside_pipeline_data_and_tensor(tmp_path, capsys):
    """optimize(mesh="3d") with one sequence on 4 devices: its cp degree (4) is a shape of
    the search (its best per shape lists them), and its plan is no slower than the best
    cp baseline (whose uniform weights and recomputation the search's per-layer program
    includes); under "1d" (`hyplan plan`'s default) a cp plan is returned only where the
    1-D plan does not fit, saying so."""
    import planner
    from planner.cli import main
    from test_presets import llama_config_file

    gpt, one = _gpt(), (_ids(0)[:1],)
    plan = planner.optimize(gpt, "4xH100", one, mesh="3d", measure=False)
    cp = planner.baseline(gpt, "4xH100", "cp", one, measure=False)
    assert {c.cp for c in plan.search.best_per_shape} == {1, 4}  # cp 2 x dp 2: 2 rows
    assert plan.predicted.step_time_s <= cp.predicted.step_time_s * (1 + 1e-9)
    one_d = planner.optimize(gpt, "4xH100", one, measure=False)
    assert one_d.context_parallel is None and "context" not in (one_d.mesh_choice or "")
    path = llama_config_file(tmp_path, 32768)  # one sequence of 32 K tokens, 4 GB a device
    argv = ["plan", str(path), "--devices", "4xH100", "--seq", "32768", "--batch", "1"]
    assert main([*argv, "--memory-limit", "4GB"]) == 0
    out = capsys.readouterr().out
    assert "Mesh choice: context parallel cp 4" in out and "the 1-D plan does not fit" in out
