"""Baselines are priced as they run and reported as they are: FSDP sends 1.5x DDP's bytes
and holds a 1/P share of the weights' state; a baseline that does not fit says what it
needs, never how much faster the plan is."""

import json
import re

import pytest
import torch
from torch import nn

import models
import planner
from distributed import run_ranks
from planner.report.compare import compare, render
from strategies import parse_devices
from test_parallel_equivalence import _train_planned, _train_single

F32 = 4  # bytes
# fp32 training (a V100 defaults to fp16-mixed, whose weight gathers carry half the bytes)
V100_FP32 = parse_devices("4xV100").at_precision("fp32")


def _linears() -> nn.Module:
    """Three Linear layers and nothing else: every layer has weights, so FSDP shards all."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 32), nn.Linear(32, 8))


WEIGHT_BYTES = (16 * 32 + 32 + 32 * 32 + 32 + 32 * 8 + 8) * F32


def test_fsdp_sends_one_and_a_half_times_ddp_bytes():
    """DDP all-reduces the gradients, 2(P-1)/P x W per device; FSDP all-gathers the weights
    before forward and before backward and reduce-scatters the gradients, 3(P-1)/P x W.
    The ReLUs between the Linears run on each rank's rows (no layout change, no bytes)."""
    x = (torch.randn(64, 16),)
    ddp = planner.baseline(models.mlp(), V100_FP32, "ddp", x, measure=False)
    fsdp = planner.baseline(models.mlp(), V100_FP32, "fsdp", x, measure=False)
    assert {l.strategy for l in fsdp.layers if l.param_bytes} == {"fsdp"}
    assert {l.strategy for l in fsdp.layers if not l.param_bytes} == {"data_parallel"}
    weights = sum(l.param_bytes for l in ddp.layers)
    assert weights == WEIGHT_BYTES
    assert ddp.predicted.communication_bytes == pytest.approx(2 * 3 / 4 * weights)
    assert fsdp.predicted.communication_bytes == pytest.approx(3 * 3 / 4 * weights)
    assert fsdp.predicted.communication_bytes / ddp.predicted.communication_bytes == \
        pytest.approx(1.5)


def test_fsdp_memory_is_the_sharded_state_plus_this_ranks_activations():
    """(weights + gradients + 2 Adam moments) / P, plus the input and each Linear's output
    at the per-rank batch (64 / 4 = 16 rows), plus what FSDP2's backward holds beside them
    (strategies.step_memory: the largest layer gathered with its whole gradient, the next
    prefetched, the previous one's reduce-scatter input), which outweighs the optimizer's
    foreach temporaries here."""
    x = (torch.randn(64, 16),)
    plan = planner.baseline(_linears(), V100_FP32, "fsdp", x, optimizer="adam", measure=False)
    assert {l.strategy for l in plan.layers} == {"fsdp"}
    rows = 64 // 4
    activations = rows * (16 + 32 + 32 + 8) * F32
    top = sorted((l.param_bytes for l in plan.layers), reverse=True)[:3]
    backward = top[0] + sum(top)
    assert backward > WEIGHT_BYTES / 4  # the foreach temporaries: one copy of the shards
    # the sum prices every gradient beside every activation, which a step that zeroes its
    # gradients to None never holds together (step_memory.not_together_bytes): at most the
    # smaller of the two less
    summed = 4 * WEIGHT_BYTES / 4 + activations + backward
    overcount = min(WEIGHT_BYTES / 4, activations)
    assert summed - overcount <= max(plan.predicted.memory_bytes) <= summed


def test_fsdp_baseline_trains_like_one_process():
    """The baseline as it is now priced (fully_shard on the Linears, ReLUs on each rank's
    rows) is a plan the executor runs, and it changes nothing in the math."""
    example = models.batch("mlp", 16, 0)[0]
    plan = planner.baseline(models.build("mlp"), "2xcpu", "fsdp", (example,), measure=False)
    assert {l.strategy for l in plan.layers if l.param_bytes} == {"fsdp"}
    results = run_ranks(_train_planned, 2, plan.to_json(), "mlp")
    models.assert_ranks_match(results, _train_single("mlp"))


def _wide() -> tuple[nn.Module, tuple]:
    """4.2 MB of weights, 16.9 MB with Adam's gradients and state, 27.6 MB as a DDP step
    holds them (buckets, optimizer temporaries): over a 15 MB limit unless the weights are
    split or sharded."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(1024, 1024), nn.ReLU(), nn.Linear(1024, 8))
    return model, (torch.randn(64, 1024),)


LIMIT = 15e6
NO_RATIO = re.compile(r"\d\.\d\dx")


def test_data_parallel_that_does_not_fit_says_what_it_needs_in_explain():
    model, x = _wide()
    plan = planner.optimize(model, "4xV100", x, memory_limit_bytes=LIMIT, measure=False)
    p = plan.predicted
    assert p.data_parallel_fits is False and p.speedup_over_data_parallel is None
    assert p.baselines["ddp"].fits is False and p.baselines["fsdp"].fits is True
    lines = {line.split(":")[0].strip(): line for line in plan.explain().splitlines()
             if "on the same devices" in line}
    dp = lines["pure data parallel on the same devices"]
    needs = p.data_parallel_memory_bytes / 1e6
    assert f"does not fit (needs {needs:.1f} MB of 15.0 MB per device)" in dp
    assert not NO_RATIO.search(dp) and "faster" not in dp
    fsdp = lines["FSDP (sharded data parallel) on the same devices"]
    assert "faster" in fsdp and "sends" in fsdp
    # the JSON keeps each baseline's memory and fit
    again = planner.Plan.from_json(plan.to_json())
    assert again.predicted.baselines == p.baselines


def test_a_baseline_that_does_not_fit_has_no_ratio_in_compare():
    model, x = _wide()
    rows = compare(model, "4xV100", x, memory_limit_bytes=LIMIT, kinds=["ddp", "fsdp"])
    lines = render(rows).splitlines()
    row = next(line for line in lines if line.startswith("│ DDP"))  # the table's row
    assert "does not fit" in row and not NO_RATIO.search(row)
    needs = max(rows[1].plan.predicted.memory_bytes) / 1e6
    assert f"DDP (pure data parallel): does not fit (needs {needs:.1f} MB of 15.0 MB per " \
           f"device)" in lines
    assert any(line.startswith("The fastest baseline that fits is FSDP") for line in lines)


def test_plans_saved_with_step_times_only_still_load():
    """Before baselines kept their memory, a plan saved {kind: step time}: it loads, with
    the fit unknown."""
    model, x = _wide()
    plan = planner.optimize(model, "4xV100", x, measure=False)
    data = json.loads(plan.to_json())
    times = {k: b["step_time_s"] for k, b in data["predicted"].pop("baselines").items()}
    data["predicted"].pop("communication_bytes")
    data["predicted"].pop("data_parallel_memory_bytes")
    data["predicted"]["baseline_step_time_s"] = times
    old = planner.Plan.from_json(json.dumps(data))
    assert old.predicted.baseline_step_time_s == times
    assert all(b.fits is None for b in old.predicted.baselines.values())
    assert "FSDP (sharded data parallel) on the same devices" in old.explain()
