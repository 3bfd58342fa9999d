"""Baselines are the plans of their kind, costed like hyplan's own, and never beat it."""

import pytest
import torch
from torch import nn

import planner
from planner.baseline import ONE_D_KINDS, available, fsdp_tp
from planner.price import price
from planner.search import CostCache, build
from planner.pipeline.stages import brute_force
from profiler import profile, trace
from strategies.parse import parse_devices
from planner.cli import main
from tests.models import mlp


def _x():
    return (torch.randn(64, 16),)


def test_ddp_baseline_is_pure_data_parallel():
    plan = planner.baseline(mlp(), "4xV100", "ddp", _x())
    assert {l.strategy for l in plan.layers if l.param_bytes} == {"data_parallel"}
    chosen = planner.optimize(mlp(), "4xV100", example_inputs=_x())
    assert plan.predicted.step_time_s == pytest.approx(chosen.predicted.data_parallel_step_time_s)


def test_tensor_baseline_splits_every_linear():
    plan = planner.baseline(mlp(), "4xV100", "tensor", _x())
    assert all(l.model_parallel for l in plan.layers if l.param_bytes)
    assert not any(l.strategy == "data_parallel" for l in plan.layers)


@pytest.mark.parametrize("devices", ["2xV100", "8xK20", "4xH100"])
def test_chosen_plan_is_never_predicted_slower_than_a_baseline(devices):
    chosen = planner.optimize(mlp(), devices, example_inputs=_x())
    assert set(chosen.predicted.baseline_step_time_s) == set(available(ONE_D_KINDS))
    for kind, t in chosen.predicted.baseline_step_time_s.items():
        assert chosen.predicted.step_time_s <= t * (1 + 1e-6), kind
    assert "tensor parallel (Megatron-style)" in chosen.explain()


def test_unavailable_or_unknown_baseline_is_a_clear_error():
    if "fsdp" not in available():
        with pytest.raises(ValueError, match="'fsdp' is not available yet"):
            planner.baseline(mlp(), "2xV100", "fsdp", _x())
    with pytest.raises(ValueError, match="unknown kind 'zero'"):
        planner.baseline(mlp(), "2xV100", "zero", _x())


def test_compare_prints_every_kind(capsys):
    assert main(["compare", "examples/mlp.py", "--devices", "8xV100", "--batch", "64"]) == 0
    out = capsys.readouterr().out
    for label in ("hyplan (chosen per layer)", "DDP (pure data parallel)",
                  "tensor parallel (Megatron-style)", "FSDP", "pipeline"):
        assert label in out


def test_pipeline_baseline_is_the_best_pipeline_without_tensor_parallelism():
    pipeline = planner.baseline(mlp(), "4xV100", "pipeline", _x())
    assert pipeline.pipeline is not None and len(pipeline.pipeline.stages) >= 2
    assert pipeline.mesh.dim_names == ["pp", "dp", "tp"] and pipeline.mesh.shape[2] == 1
    searched = planner.optimize(mlp(), "4xV100", example_inputs=_x(), mesh="3d")
    assert searched.predicted.step_time_s <= pipeline.predicted.step_time_s * (1 + 1e-6)


def _hybrid_model():
    """Channel-split conv into a column/row-split FC block: on 4xV100 the optimum is a
    hybrid 4.5% faster than the best standard plan (Megatron-style tensor parallel), in
    fp32 with SGD (the tests pass precision="fp32" and optimizer="sgd"; V100's default,
    fp16-mixed, and Adam's heavier update move the gap)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(), nn.Flatten(),
                          nn.Linear(32 * 16 * 16, 4096), nn.ReLU(), nn.Linear(4096, 4096),
                          nn.ReLU(), nn.Linear(4096, 10))
    return model, (torch.randn(64, 3, 16, 16),)


def test_a_standard_plan_within_tolerance_of_the_optimum_is_kept_and_says_why():
    model, inputs = _hybrid_model()
    optimum = planner.optimize(model, "4xV100", inputs, measure=False, prefer_standard=0.0,
                                precision="fp32", optimizer="sgd")
    tensor_s = optimum.predicted.baseline_step_time_s["tensor"]
    assert optimum.predicted.step_time_s < tensor_s < optimum.predicted.step_time_s * 1.05
    assert optimum.standard_choice == ""

    kept = planner.optimize(model, "4xV100", inputs, measure=False, prefer_standard=0.05,
                            precision="fp32", optimizer="sgd")
    assert kept.predicted.step_time_s == pytest.approx(tensor_s, rel=1e-9)
    assert all(l.model_parallel or l.strategy != "data_parallel" for l in kept.layers)
    assert "tensor parallel" in kept.standard_choice and "4.5%" in kept.standard_choice
    assert "Standard plan: kept the tensor parallel" in kept.explain()
    # the default (3%) keeps this optimum: its 4.5% gain is beyond the tolerance
    default = planner.optimize(model, "4xV100", inputs, measure=False, precision="fp32",
                               optimizer="sgd")
    assert default.predicted.step_time_s == optimum.predicted.step_time_s


def test_prefer_standard_outside_zero_to_one_is_refused_by_name():
    model, inputs = _hybrid_model()
    with pytest.raises(ValueError, match="prefer_standard"):
        planner.optimize(model, "4xV100", inputs, measure=False, prefer_standard=1.5)


def test_fsdp_tp_baseline_prices_every_weighted_layer_as_its_fsdp_variant_at_tp():
    """FSDP x TP (torchtitan's 2-D plan): every Linear runs a tp strategy +fsdp over the
    dp group, each option priced by planner.price as that variant, and the baseline's step
    is the brute-force best of those options on its shape."""
    graph = profile(trace(mlp(), _x()), measure=False)
    cluster = parse_devices("2x4xV100")
    plan = fsdp_tp(graph, cluster, "adam", cluster.device.memory_bytes, 0.0, tp=4)
    pp, dp, tp = plan.mesh.shape
    assert (pp, dp, tp) == (1, 2, 4) and plan.pipeline is None
    weighted = [l for l in plan.layers if l.param_bytes]
    assert weighted and all(l.dp_shard and not l.hsdp for l in weighted)

    cache = CostCache(graph, cluster, "adam")
    rows = 64 // (dp * plan.microbatches)
    pin = {l.name: "+fsdp" for l in graph.layers}
    built = build(cache, 1, dp, tp, rows, pin=pin)
    for i, layer in enumerate(graph.layers):
        options = built.problem.layers[i]
        if not layer.param_bytes:
            continue
        assert all(n.endswith("+fsdp") for n in options.strategies), options.strategies
        assert "column_parallel+fsdp" in options.strategies  # the tp half stays free
        entry = cache.layer(layer, tp, rows)
        for j, strategy in enumerate(built.strategies[i]):
            assert options.microbatch_s[j] == price(entry.layer, strategy, entry.ctx, dp,
                                                    "+fsdp").microbatch_s
    best = brute_force(built.problem, 1, plan.microbatches, "1F1B", None)
    fixed = plan.predicted.fixed_s
    assert plan.predicted.step_time_s == pytest.approx(best[0].step_s + fixed, rel=1e-9)


def test_fsdp_tp_baseline_needs_a_dp_and_a_tp_group():
    with pytest.raises(ValueError, match="'fsdp_tp' needs a tp group"):
        planner.baseline(mlp(), "2xV100", "fsdp_tp", _x())
