"""A plan for one device runs the model as it is: no DDP around it (one rank sums nothing;
DDP would only add its hooks and bucket copies), and its training step equals the plain
loop's."""

import torch
from torch import nn

import executor
import planner
from tests.distributed import run_ranks


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4))


def _rank(rank, world, plan_json):
    plan = planner.Plan.from_json(plan_json)
    model = _model()
    parallel = executor.parallelize(model, plan)
    reference = _model()
    x, y = torch.randn(8, 16), torch.randn(8, 4)
    for m in (parallel, reference):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(2):
            opt.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            opt.step()
    same = all(torch.allclose(a, b) for a, b in zip(parallel.parameters(), reference.parameters()))
    return type(parallel).__name__, same


def test_a_one_device_plan_trains_without_ddp_and_equals_the_plain_loop():
    plan = planner.optimize(_model(), "1xcpu", (torch.randn(8, 16),), measure=False)
    assert all(layer.strategy in ("data_parallel", "replicate") or not layer.param_bytes
               for layer in plan.layers)
    [(kind, same)] = run_ranks(_rank, 1, plan.to_json())
    assert "DistributedDataParallel" not in kind and same
