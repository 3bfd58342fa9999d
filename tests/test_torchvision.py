"""torchvision's classifiers (tests/torchvision_zoo.py) train under hyplan's plans exactly
like one process: 2 gloo ranks, 3 SGD steps, every parameter equal to the single-process
run (rtol 1e-5, float64). A few rows of benchmarks/torchvision_zoo.py's table, the ones
that broke or that stand for a family: AlexNet's optimum and tensor plans and
MobileNetV3-small's tensor plan (in-place activations after tensor-parallel layers);
ResNet-18's rows are the benchmark's (tests/zoo.py's Hugging Face ResNet covers BatchNorm
and residual adds in the suite). All run in one launch of ranks, as
tests/test_zoo.py's do. Inception-v3's two outputs, one loss (the DDP row a user tries first,
its pipeline row at the namedtuple output of the last stage) are checked on a small model
of the same shape here (`_TwoHeads`, DDP and two stages in one launch: a few seconds, where
Inception-v3's DDP row took ~35 s of this machine's CPU, a float64 reference at 299 pixels
and two ranks); VGG-11, RegNet, Swin-T and all five of Inception-v3's rows are the
benchmark's.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn

import executor
import planner
from distributed import run_ranks
from executor.pipeline import plain_tuple_output
from executor.view_outputs import own_output, written_in_place
from planner.search import Shape
from test_zoo import make_plan, run_plans
from torchvision_zoo import TORCHVISION_ZOO
from zoo import reference

# not VGG-11: its rows run (the table's), but its 133 M parameters in float64 (1.06 GB a
# copy) take 30-100 s a plan and peak at 7-14 GB over 2 ranks, too much beside the suite's
# other worker; AlexNet's tensor plan splits the same classifier (Linear,
# ReLU(inplace=True), Linear, ...)
ROWS = [("alexnet", "optimum"), ("alexnet", "tensor"), ("mobilenet_v3_small", "tensor")]
RTOL, ATOL = 1e-5, 1e-6


def compared_with_one_process(rank: int, world: int, jobs: list,
                              references: dict | None = None) -> dict:
    """Each job (model, kind, plan JSON) -> (the largest relative difference, norm over
    norm, of a parameter this rank holds from the single-process run; the first one
    outside rtol/atol, or None; the names it holds; the names one process trains), or the
    error it raised, as text. Compared here, one job at a time, one reference alive at a
    time: VGG-11's parameters are 1 GB in float64, and a rank that kept every job's to
    hand back held several. `references`: model -> a file of its single-process
    parameters (`save_reference`), read mapped (both ranks share its pages); a model not
    in it has its reference trained here, on each rank."""
    out, expected = {}, (None, None)
    for job in jobs:
        name, kind, _ = job
        if expected[0] != name:
            expected = (None, None)  # the last model's freed before this one's is made
            path = (references or {}).get(name)
            expected = (name, torch.load(path, mmap=True, weights_only=True) if path
                        else reference(TORCHVISION_ZOO[name]))
        _trim()
        got = run_plans(rank, world, [job])[(name, kind)]
        _trim()
        if isinstance(got, str):
            out[(name, kind)] = got
            continue
        worst, outside, names = 0.0, None, sorted(got)
        for key in names:
            value, want = got.pop(key), expected[1][key]  # each freed once compared
            relative, close = _compare(value, want)
            worst = max(worst, relative)
            if outside is None and not close:
                outside = key
            del value
        out[(name, kind)] = (worst, outside, names, sorted(expected[1]))
    return out


def save_reference(name: str, path: str) -> str:
    """Train `name`'s single-process reference in this process, on one thread as a rank
    runs, and save its parameters to `path` for compared_with_one_process: trained once
    instead of once per rank, and held in the page cache, not twice in the ranks' heaps."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        torch.save(reference(TORCHVISION_ZOO[name]), path)
    finally:
        torch.set_num_threads(threads)
    _trim()
    return path


CHUNK = 1 << 22  # elements compared at once: VGG-11's first Linear is 103 M (822 MB)


def _compare(value: torch.Tensor, want: torch.Tensor) -> tuple[float, bool]:
    """(||value - want|| / ||want||, every element within RTOL/ATOL), a slice at a time:
    whole-tensor differences and allclose's temporaries of a 822 MB weight were GBs."""
    if value.shape != want.shape:
        return float("inf"), False
    a, b = value.reshape(-1), want.reshape(-1)
    squared, norm, close = 0.0, 0.0, True
    for start in range(0, a.numel(), CHUNK):
        x, y = a[start:start + CHUNK], b[start:start + CHUNK]
        squared += (x - y).square().sum().item()
        norm += y.square().sum().item()
        close = close and torch.allclose(x, y, rtol=RTOL, atol=ATOL)
    return squared ** 0.5 / max(norm ** 0.5, 1e-12), close


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


def copied_outputs(rank: int, world: int, jobs: list,
                   references: dict | None = None) -> tuple[dict, list[str]]:
    """compared_with_one_process's results (`references` as it takes them), and the
    modules whose outputs the first job's plan copies."""
    name, _, plan_json = jobs[0]
    model = executor.parallelize(TORCHVISION_ZOO[name].make(), planner.Plan.from_json(plan_json))
    copied = sorted(path for path, module in model.named_modules()
                    if own_output in module._forward_hooks.values())
    del model
    return compared_with_one_process(rank, world, jobs, references), copied


@pytest.fixture(scope="module")
def torchvision_runs(tmp_path_factory):
    """The rows' plans, and one launch of 2 ranks that runs them all against each model's
    single-process reference, trained once here (`save_reference`, on one thread as a
    rank trains it) instead of on each rank: the same 3 float64 steps, ~6 s of this
    machine a rank for AlexNet."""
    plans = {}
    for name in dict(ROWS):
        model = TORCHVISION_ZOO[name].make()  # one instance for its kinds: traced once
        for kind in [k for n, k in ROWS if n == name]:
            plans[(name, kind)] = make_plan(name, kind, model=model)
    jobs = [(name, kind, plans[(name, kind)].to_json()) for name, kind in ROWS]
    jobs.sort(key=lambda job: job[:2] != ("alexnet", "tensor"))  # the one copied_outputs reads
    folder = tmp_path_factory.mktemp("torchvision-references")
    references = {name: save_reference(name, str(folder / f"{name}.pt")) for name in dict(ROWS)}
    ranks = run_ranks(copied_outputs, 2, jobs, references, timeout_s=900)
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


class Outputs(NamedTuple):
    """Inception-v3's training output in small (`InceptionOutputs`: logits, aux_logits)."""

    logits: torch.Tensor
    aux_logits: torch.Tensor | None


class _TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU())
        self.aux = nn.Linear(16, 4)
        self.head = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))

    def forward(self, x):
        y = self.body(x)
        return Outputs(self.head(y), self.aux(y))


def _two_heads_loss(output, target):
    assert isinstance(output, Outputs), type(output)  # the model's own output type
    return F.cross_entropy(output.logits, target) + 0.4 * F.cross_entropy(output.aux_logits,
                                                                          target)


def _two_heads_batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)


def _two_heads_planned(rank, world, plans):
    """Each plan's parameters after 3 steps of `_TwoHeads` on this rank."""
    out = []
    for plan_json in plans:
        plan = planner.Plan.from_json(plan_json)
        model = executor.parallelize(_TwoHeads(), plan)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
        for step in range(3):
            executor.train_step(model, plan, _two_heads_batch(step), _two_heads_loss, opt)
        out.append(executor.full_parameters(model))
    return out


def test_plain_tuple_output_either_way_fx_records_a_namedtuple():
    """fx records Inception-v3's `InceptionOutputs(x, aux)` as a call; a namedtuple built
    of nodes in the output is the other form. Both become a plain tuple, the type kept."""
    gm = fx.symbolic_trace(_TwoHeads())
    assert plain_tuple_output(gm) is Outputs
    out = gm(torch.randn(2, 8))
    assert type(out) is tuple and len(out) == 2
    assert plain_tuple_output(gm) is None  # a plain tuple now: left as it is
    graph = fx.Graph()
    x = graph.placeholder("x")
    graph.output(Outputs(graph.call_function(torch.relu, (x,)), x))
    assert plain_tuple_output(fx.GraphModule(nn.Module(), graph)) is Outputs
    assert plain_tuple_output(nn.Linear(2, 2)) is None


def test_two_outputs_one_loss_train_like_one_process_in_ddp_and_a_pipeline():
    """Inception-v3's training output, in small: its DDP row (two outputs, one loss) and its
    pipeline row, which stopped at the first backward ("'InceptionOutputs' object has no
    attribute '_is_view'"): torch.distributed.pipelining detaches each element of the last
    stage's output, a namedtuple is not a tuple to it. The last stage returns a plain
    tuple, and the loss gets the model's namedtuple back."""
    from planner.plan3d import optimize_3d

    example = (_two_heads_batch(0)[0],)
    pipelined = optimize_3d(_TwoHeads(), "2xcpu", example, measure=False,
                            only=[Shape(2, 1, 1, 2, "1F1B")], optimizer="sgd")
    assert len(pipelined.pipeline.stages) == 2
    ddp = planner.baseline(_TwoHeads(), "2xcpu", "ddp", example, measure=False,
                           optimizer="sgd")
    results = run_ranks(_two_heads_planned, 2, [ddp.to_json(), pipelined.to_json()])
    model = _TwoHeads()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, foreach=False)
    for step in range(3):
        x, y = _two_heads_batch(step)
        opt.zero_grad()
        _two_heads_loss(model(x), y).backward()
        opt.step()
    expected = dict(model.named_parameters())
    for i, kind in enumerate(("ddp", "pipeline")):
        seen = set()
        for rank, runs in enumerate(results):
            for key, value in runs[i].items():
                seen.add(key)
                torch.testing.assert_close(
                    value, expected[key].detach(), rtol=1e-5, atol=1e-6,
                    msg=lambda m, r=rank, k=key, kd=kind: f"{kd} rank {r}, {k}: {m}")
        assert seen == set(expected), kind
