"""Training runs: checkpoints through DCP, resume after a stop, and resume under another
plan (data parallel -> model parallel, 2 -> 1 processes, pipelined -> 1-D) end with the
parameters of an uninterrupted single-process run of the same steps."""

import torch
from torch import nn

import executor
import models
import planner
from distributed import run_ranks
from executor import checkpoint
from executor.data import global_batch, synthetic_dataset
from executor.pipeline import StageModel
from executor.train import make_optimizer
from planner.plan3d import optimize_3d
from planner.search import Shape

ROWS, LR, SIZE = 16, 0.01, 64
DP = {"0": "data_parallel", "2": "data_parallel", "4": "data_parallel"}
MP = {"0": "column_parallel", "2": "row_parallel", "4": "data_parallel"}


def _dataset():
    x = models.batch("mlp", ROWS, 0)[0]
    return synthetic_dataset(models.build("mlp"), (x,), nn.CrossEntropyLoss(), SIZE, seed=1)


def _plan(world: int, pin: dict) -> planner.Plan:
    x = models.batch("mlp", ROWS, 0)[0]
    return planner.optimize(models.build("mlp"), f"{world}xcpu", example_inputs=(x,),
                            pin=pin, measure=False)


def _pipelined_plan() -> planner.Plan:
    """Two pipeline stages on two ranks (1F1B, 4 microbatches)."""
    x = models.batch("mlp", ROWS, 0)[0]
    plan = optimize_3d(models.build("mlp"), "2xcpu", (x,), measure=False,
                       only=[Shape(2, 1, 1, 4, "1F1B")])
    assert plan.is_mesh_3d and plan.mesh.shape == [2, 1, 1]
    return plan


def _full(module) -> dict[str, torch.Tensor]:
    """This rank's parameters by their names in the user's model, as full tensors."""
    from torch.distributed.tensor import DTensor

    inner = module.stage if isinstance(module, StageModel) else getattr(module, "module", module)
    return {k: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for k, p in inner.named_parameters()}


def reference(steps: int, optimizer: str = "adam") -> dict[str, torch.Tensor]:
    """Single-process training on the whole global batch of each step."""
    model, data = models.build("mlp"), _dataset()
    opt = make_optimizer(optimizer, model.parameters(), LR)
    for step in range(steps):
        x, y = global_batch(data, ROWS, step, seed=0)
        loss = nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def _run(rank, world, plan_json, steps, directory):
    plan = planner.Plan.from_json(plan_json)
    result = executor.train(models.build("mlp"), plan, _dataset(), nn.CrossEntropyLoss(),
                            steps=steps, lr=LR, checkpoint_dir=directory, checkpoint_every=2)
    return result.start_step, _full(result.model), result.losses


def _merged(results) -> dict[str, torch.Tensor]:
    """The whole model's parameters from every rank's (each pipeline stage holds its own)."""
    return {k: v for _, params, _ in results for k, v in params.items()}


def _assert_equal(params, expected):
    assert params.keys() == expected.keys()
    for key, value in expected.items():
        torch.testing.assert_close(params[key], value, rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


def test_resume_under_a_model_parallel_plan_equals_uninterrupted_run(tmp_path):
    dp, mp = _plan(2, DP), _plan(2, MP)
    assert {l.strategy for l in mp.layers if l.param_bytes} >= {"column_parallel", "row_parallel"}
    first = run_ranks(_run, 2, dp.to_json(), 3, str(tmp_path))
    assert [s for s, _, _ in first] == [0, 0]
    assert [step for step, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    _assert_equal(first[0][1], reference(3))

    second = run_ranks(_run, 2, mp.to_json(), 6, str(tmp_path))
    for start, params, losses in second:
        assert start == 3 and sorted(losses) == [3, 4, 5]
        _assert_equal(params, reference(6))


def test_resume_on_fewer_processes(tmp_path):
    run_ranks(_run, 2, _plan(2, MP).to_json(), 2, str(tmp_path))
    ((start, params, _),) = run_ranks(_run, 1, _plan(1, {}).to_json(), 4, str(tmp_path))
    assert start == 2
    _assert_equal(params, reference(4))


def test_pipelined_run_resumes_under_itself_and_under_a_1d_plan(tmp_path):
    """Each stage's ranks hold and save only their stage's parameters; DCP's metadata holds
    the whole model, so a restart under the same pipelined plan loads each stage's part,
    and a 1-D (model-parallel) plan loads all of it."""
    pp = _pipelined_plan().to_json()
    first = run_ranks(_run, 2, pp, 3, str(tmp_path))
    stage_params = [set(params) for _, params, _ in first]
    assert stage_params[0] and stage_params[1] and not stage_params[0] & stage_params[1]
    assert [step for step, _ in checkpoint.complete_checkpoints(tmp_path)] == [2, 3]
    _assert_equal(_merged(first), reference(3))
    whole = models.build("mlp")
    checkpoint.load_model(checkpoint.step_dir(tmp_path, 3), whole)
    _assert_equal(dict(whole.named_parameters()), reference(3))

    second = run_ranks(_run, 2, pp, 5, str(tmp_path))
    assert [(s, sorted(losses)) for s, _, losses in second] == [(3, [3, 4])] * 2
    _assert_equal(_merged(second), reference(5))

    for start, params, _ in run_ranks(_run, 2, _plan(2, MP).to_json(), 6, str(tmp_path)):
        assert start == 5
        _assert_equal(params, reference(6))


def _tail_model() -> nn.Module:
    """The MLP, then a parameter-free LogSoftmax: with NLLLoss, the MLP's cross-entropy."""
    return nn.Sequential(models.build("mlp"), nn.LogSoftmax(dim=1))


def _run_tail(rank, world, plan_json, steps, directory):
    plan = planner.Plan.from_json(plan_json)
    result = executor.train(_tail_model(), plan, _dataset(), nn.NLLLoss(), steps=steps, lr=LR,
                            checkpoint_dir=directory, checkpoint_every=2)
    return result.start_step, _full(result.model), result.losses


def test_a_parameter_free_stage_trains_saves_and_resumes(tmp_path):
    """The planner cuts the LogSoftmax off as stage 1: its rank holds no parameters, steps
    an empty optimizer, saves an empty part of each checkpoint and loads nothing back."""
    x = models.batch("mlp", ROWS, 0)[0]
    plan = optimize_3d(_tail_model(), "2xcpu", (x,), measure=False,
                       only=[Shape(2, 1, 1, 4, "1F1B")])
    assert [s.layers for s in plan.pipeline.stages][1] == ["1"]
    run_ranks(_run_tail, 2, plan.to_json(), 2, str(tmp_path))
    (start, params, _), (_, none, losses) = run_ranks(_run_tail, 2, plan.to_json(), 3,
                                                      str(tmp_path))
    assert start == 2 and none == {} and sorted(losses) == [2]
    _assert_equal({k.removeprefix("0."): v for k, v in params.items()}, reference(3))


def test_a_checkpoint_without_its_marker_is_never_loaded(tmp_path):
    """Shards and DCP metadata alone are not a checkpoint: hyplan.json, written last and
    renamed into place with the folder, is (the mid-checkpoint kill in test_train_cli
    leaves such a folder for real)."""
    done, half = checkpoint.step_dir(tmp_path, 2), checkpoint.step_dir(tmp_path, 4)
    for folder in (done, half, tmp_path / ".partial-step_00000006"):
        folder.mkdir()
        (folder / ".metadata").write_bytes(b"")
        (folder / "__0_0.distcp").write_bytes(b"")
    (done / checkpoint.MARKER).write_text("{}")
    assert checkpoint.latest_checkpoint(tmp_path) == (2, done)
