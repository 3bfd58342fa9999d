"""A plan in bf16-mixed (or fp16-mixed) trains like one process in the same precision: after
3 SGD steps through executor.train_step on 2 and 4 gloo ranks, data-parallel, tensor-parallel
(column, row, channel), FSDP2 and pipelined layers end with the parameters of a
single-process run whose forward runs under the same torch.autocast, loss in fp32.

Tolerance. The parallel run cannot match bit for bit: each rank rounds its own partial
products to bf16 (a row-parallel layer's partial outputs, a data-parallel layer's weight
gradient over its own rows) and the ranks sum them in another order, each rounding an
error of up to u = 2^-8 relative (bf16 keeps 8 significant bits) on values that may cancel.
Measured here (2026-11-23, 3 steps, lr 0.05): the largest difference of any weight, over
its tensor's largest weight, was 1.35e-3 for bf16 (the 2-rank data-parallel first layer,
and the pipeline's microbatched one), 2.1e-5 for fp16 (u = 2^-11). The tests hold every
weight to within one rounding of its tensor's largest weight, u·max|w|: 2.9x the worst
bf16 difference and 23x the fp16 one, and below what the forward's own low-precision copy
of that weight can resolve. fp32 plans still match at rtol 1e-5 (tests/
test_parallel_equivalence.py, test_memory_levers.py, test_pipeline_equivalence.py run
their CPU plans in fp32, the CPU default). That each run really ran in its precision is
checked on its own: every Linear's output is in the compute dtype, every gradient fp32.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import executor
import models
from distributed import run_ranks
from planner import Plan, optimize
from planner.plan3d import optimize_3d
from planner.search import Shape

STEPS, ROWS, LR = 3, 16, 0.05
UNIT_ROUNDOFF = {"bf16-mixed": 2.0**-8, "fp16-mixed": 2.0**-11}
DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def _full(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    inner = getattr(module, "stage", getattr(module, "module", module))
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in inner.named_parameters()}


def _train_plans(rank, world, plans: list[tuple[str, str]]):
    """Each (model name, plan JSON) trained for STEPS through executor.train_step: its
    parameters, losses, the dtypes of its Linears' outputs and of its gradients."""
    out = []
    for name, plan_json in plans:
        plan = Plan.from_json(plan_json)
        model = executor.parallelize(models.build(name), plan)
        seen = set()
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.register_forward_hook(lambda mod, args, y: seen.add(y.dtype))
        opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
        losses = [executor.train_step(model, plan, models.batch(name, ROWS, s), F.cross_entropy,
                                      opt) for s in range(STEPS)]
        grads = {p.grad.dtype for p in model.parameters() if p.grad is not None}
        out.append((_full(model), losses, seen, grads))
    return out


def _train_single(name: str, precision: str):
    """One process, whole batch, the forward under autocast, loss in fp32; fp16 scales the
    loss with torch.amp.GradScaler (the rule executor.precision.LossScaler follows)."""
    model = models.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    scaler = torch.amp.GradScaler("cpu", enabled=precision == "fp16-mixed")
    losses = []
    for step in range(STEPS):
        x, y = models.batch(name, ROWS, step)
        with torch.autocast("cpu", dtype=DTYPES[precision]):
            out = model(x)
        loss = F.cross_entropy(out.float(), y)
        opt.zero_grad()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters()}, losses


def _check(case, results, precision):
    name = case[0]
    expected, expected_losses = _train_single(name, precision)
    u = UNIT_ROUNDOFF[precision]
    merged = {}
    for params, losses, seen, grads in results:
        assert seen == {DTYPES[precision]}, f"{case}: Linear outputs in {seen}"
        assert grads == {torch.float32}, f"{case}: gradients in {grads}"
        assert losses == pytest.approx(expected_losses, rel=u), case
        merged.update(params)
    assert merged.keys() == expected.keys()  # every parameter lives on some rank
    for key, value in expected.items():
        torch.testing.assert_close(merged[key], value, rtol=0, atol=u * value.abs().max().item(),
                                   msg=lambda m: f"{case}, {key}: {m}")


def _plan_1d(name, world, pin, precision):
    example = models.batch(name, ROWS, 0)[0]
    return optimize(models.build(name), f"{world}xcpu", (example,), pin=pin, measure=False,
                    precision=precision)


TWO_RANKS = [
    ("mlp", {"0": "data_parallel", "2": "column_parallel", "4": "row_parallel"}, "bf16-mixed"),
    ("cnn", {"features.0": "data_parallel", "features.3": "channel_parallel",
             "classifier.0": "column_parallel", "classifier.2": "row_parallel",
             "classifier.4": "fsdp"}, "bf16-mixed"),
    ("mlp", {"0": "fsdp+recompute", "2": "fsdp", "4": "data_parallel"}, "bf16-mixed"),
    ("mlp", {"0": "data_parallel", "2": "column_parallel", "4": "row_parallel"}, "fp16-mixed"),
]


def test_mixed_precision_plans_on_two_ranks_equal_one_process_in_that_precision():
    """Data, tensor (column, row, channel) and FSDP2 layers, and a two-stage pipeline, in one
    launch of 2 ranks (a launch costs more than the training)."""
    plans = [(name, _plan_1d(name, 2, pin, precision)) for name, pin, precision in TWO_RANKS]
    example = models.batch("mlp", ROWS, 0)[0]
    pipelined = optimize_3d(models.build("mlp"), "2xcpu", (example,), measure=False,
                            only=[Shape(2, 1, 1, 4, "1F1B")], precision="bf16-mixed")
    plans.append(("mlp", pipelined))
    assert all(plan.precision != "fp32" for _, plan in plans)
    ranks = run_ranks(_train_plans, 2, [(name, plan.to_json()) for name, plan in plans])
    for i, (name, plan) in enumerate(plans):
        _check((name, i), [ranks[r][i] for r in range(2)], plan.precision)


def test_bf16_tensor_and_data_parallel_on_four_ranks_equal_one_process():
    pin = {"0": "column_parallel", "2": "row_parallel", "4": "data_parallel"}
    plan = _plan_1d("mlp", 4, pin, "bf16-mixed")
    ranks = run_ranks(_train_plans, 4, [("mlp", plan.to_json())])
    _check(("mlp", 4), [r[0] for r in ranks], "bf16-mixed")
