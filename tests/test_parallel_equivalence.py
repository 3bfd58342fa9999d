"""A plan never changes the math: after 3 SGD steps on 2 and 4 gloo ranks, the parameters of
a planned run that mixes data- and model-parallel layers equal single-process training on
the whole batch."""

import pytest
import torch
import torch.nn.functional as F

import executor
import models
import planner
from distributed import run_ranks

STEPS, ROWS, LR = 3, 16, 0.05


def _full_parameters(module) -> dict[str, torch.Tensor]:
    from torch.distributed.tensor import DTensor

    inner = getattr(module, "module", module)  # DDP wraps the rewritten module
    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in inner.named_parameters()}


def _train_planned(rank, world, plan_json, name):
    plan = planner.Plan.from_json(plan_json)
    model = executor.parallelize(models.build(name), plan)
    opt = torch.optim.SGD(model.parameters(), lr=LR, foreach=False)
    for step in range(STEPS):
        x, y = executor.shard_batch(plan, models.batch(name, ROWS, step))
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return _full_parameters(model)


def _train_single(name, losses: list | None = None):
    """Single-process SGD on the whole batch: the reference; each step's loss goes into
    `losses` when given."""
    model = models.build(name)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        x, y = models.batch(name, ROWS, step)
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if losses is not None:
            losses.append(loss.item())
    return {k: v.detach() for k, v in model.named_parameters()}


CASES = [
    ("mlp", 2, {"0": "data_parallel", "2": "column_parallel", "4": "row_parallel"}),
    ("mlp", 4, {"0": "column_parallel", "2": "row_parallel", "4": "data_parallel"}),
    ("cnn", 2, {"features.0": "data_parallel", "features.3": "channel_parallel",
                "classifier.0": "column_parallel", "classifier.2": "row_parallel",
                "classifier.4": "data_parallel"}),
    ("cnn", 4, {"features.0": "channel_parallel", "features.3": "data_parallel",
                "classifier.0": "row_parallel", "classifier.2": "column_parallel",
                "classifier.4": "row_parallel"}),
]


@pytest.mark.parametrize("name,world,pin", CASES, ids=[f"{c[0]}-{c[1]}ranks" for c in CASES])
def test_mixed_plan_parameters_equal_single_process(name, world, pin):
    example = models.batch(name, ROWS, 0)[0]
    plan = planner.optimize(models.build(name), f"{world}xcpu", example_inputs=(example,),
                            pin=pin, measure=False)
    strategies = {l.name: l.strategy for l in plan.layers}
    assert {strategies[k] for k in pin} >= {"data_parallel"} | ({"column_parallel"} & set(pin.values()))
    results = run_ranks(_train_planned, world, plan.to_json(), name)
    expected = _train_single(name)
    models.assert_ranks_match(results, expected)
