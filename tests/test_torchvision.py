"""torchvision's classifiers (tests/torchvision_zoo.py) train under hyplan's plans exactly
like one process: 2 gloo ranks, 3 SGD steps, every parameter equal to the single-process
run (rtol 1e-5, float64). A few rows of benchmarks/torchvision_zoo.py's table, the ones
that broke or that stand for a family: AlexNet's optimum and tensor plans and
MobileNetV3-small's tensor plan (in-place activations after tensor-parallel layers) and
Inception-v3's DDP plan (two outputs, one loss); ResNet-18's rows are the benchmark's
(tests/zoo.py's Hugging Face ResNet covers BatchNorm and residual adds in the suite). All run in one launch of spawned ranks, as tests/test_zoo.py's do.
"""

from __future__ import annotations

import pytest
import torch
import torch.fx as fx
from torch import nn

import executor
import planner
from distributed import run_ranks
from executor.view_outputs import own_output, written_in_place
from test_zoo import make_plan, run_plans
from torchvision_zoo import TORCHVISION_ZOO
from zoo import reference

# not VGG-11: its tensor plan runs (the table's row), but its 129 M parameters in float64
# peak at 14 GB over 2 ranks, too much beside the suite's other worker; AlexNet's tensor
# plan splits the same classifier (Linear, ReLU(inplace=True), Linear, ...)
ROWS = [("alexnet", "optimum"), ("alexnet", "tensor"), ("mobilenet_v3_small", "tensor"),
        ("inception_v3", "ddp")]
RTOL, ATOL = 1e-5, 1e-6


def compared_with_one_process(rank: int, world: int, jobs: list) -> dict:
    """Each job (model, kind, plan JSON) -> (the largest relative difference, norm over
    norm, of a parameter this rank holds from the single-process run; the first one
    outside rtol/atol, or None; the names it holds; the names one process trains), or the
    error it raised, as text. Compared here, one job at a time, one reference alive at a
    time: VGG-11's parameters are 1 GB in float64, and a rank that kept every job's to
    hand back held several."""
    out, expected = {}, (None, None)
    for job in jobs:
        name, kind, _ = job
        if expected[0] != name:
            expected = (None, None)  # the last model's freed before this one's is made
            expected = (name, reference(TORCHVISION_ZOO[name]))
        _trim()
        got = run_plans(rank, world, [job])[(name, kind)]
        _trim()
        if isinstance(got, str):
            out[(name, kind)] = got
            continue
        worst, outside = 0.0, None
        for key, value in got.items():
            want = expected[1][key]
            worst = max(worst, ((value - want).norm() / want.norm().clamp_min(1e-12)).item())
            if outside is None and not torch.allclose(value, want, rtol=RTOL, atol=ATOL):
                outside = key
        out[(name, kind)] = (worst, outside, sorted(got), sorted(expected[1]))
    return out


def _trim() -> None:
    """Hand freed pages back to the system (glibc): parallelize keeps freed memory in the
    process, and between jobs that held VGG-11 in float64 a rank peaked at 9 GB, 7 with
    this."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # another C library: nothing to hand back this way
        pass


def assert_trained_like_one_process(jobs: list, ranks: list[dict]) -> None:
    for name, kind, _ in jobs:
        held: set[str] = set()
        for rank, result in enumerate(ranks):
            got = result[(name, kind)]
            assert not isinstance(got, str), f"{name} {kind} rank {rank}: {got}"
            worst, outside, names, expected = got
            assert outside is None, (f"{name} {kind} rank {rank}: {outside} differs from one "
                                     f"process (largest relative difference {worst:.1e})")
            held |= set(names)
        assert held == set(expected), f"{name} {kind}: no rank holds {set(expected) - held}"


def copied_outputs(rank: int, world: int, jobs: list) -> tuple[dict, list[str]]:
    """compared_with_one_process's results, and the modules whose outputs the first job's
    plan copies."""
    name, _, plan_json = jobs[0]
    model = executor.parallelize(TORCHVISION_ZOO[name].make(), planner.Plan.from_json(plan_json))
    copied = sorted(path for path, module in model.named_modules()
                    if own_output in module._forward_hooks.values())
    del model
    return compared_with_one_process(rank, world, jobs), copied


@pytest.fixture(scope="module")
def torchvision_runs():
    plans = {}
    for name in dict(ROWS):
        model = TORCHVISION_ZOO[name].make()  # one instance for its kinds: traced once
        for kind in [k for n, k in ROWS if n == name]:
            plans[(name, kind)] = make_plan(name, kind, model=model)
    jobs = [(name, kind, plans[(name, kind)].to_json()) for name, kind in ROWS]
    jobs.sort(key=lambda job: job[:2] != ("alexnet", "tensor"))  # the one copied_outputs reads
    ranks = run_ranks(copied_outputs, 2, jobs, forked=False, timeout_s=900)
    return plans, jobs, [results for results, _ in ranks], [copied for _, copied in ranks]


def test_torchvision_plans_train_like_one_process(torchvision_runs):
    _, jobs, results, _ = torchvision_runs
    assert_trained_like_one_process(jobs, results)


def test_tensor_plans_split_the_classifiers_with_in_place_activations(torchvision_runs):
    """The rows that stopped at the first step ("a view ... is being modified inplace")
    did split a layer whose output an in-place activation writes."""
    plans = torchvision_runs[0]
    for name, head in (("alexnet", "classifier_1"), ("mobilenet_v3_small", "classifier_0")):
        layer = {l.node: l for l in plans[(name, "tensor")].layers}[head]
        assert layer.model_parallel, (name, layer.strategy)


def test_only_outputs_written_in_place_are_copied(torchvision_runs):
    """AlexNet's tensor plan: every split layer whose output `ReLU(inplace=True)` writes
    hands on a tensor of its own (a copy where DTensor's is a view: the Linears'); the
    last Linear, read by the loss only, hands on DTensor's view."""
    plans, _, _, copied = torchvision_runs
    split = {l.name for l in plans[("alexnet", "tensor")].layers if l.model_parallel}
    assert {"classifier.1", "classifier.4", "classifier.6"} <= split
    for paths in copied:
        assert {p.removeprefix("module.") for p in paths} == split - {"classifier.6"}


class _Writes(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        y = torch.nn.functional.relu(self.a(x), inplace=True)  # Inception's BasicConv2d
        self.b(y).flatten(1).add_(1)  # through a view
        return self.c(y) + torch.relu(self.c(y))


def test_written_in_place_sees_functional_inplace_and_views():
    gm = fx.symbolic_trace(_Writes())
    node = {n.target: n for n in gm.graph.nodes if n.op == "call_module"}
    assert written_in_place(node["a"], gm)
    assert written_in_place(node["b"], gm)
    assert not written_in_place(node["c"], gm)
