"""`hyplan train` under torchrun: a rank killed mid-step or mid-checkpoint, restarted by
torchrun, and a two-node job on loopback all end with the parameters of an uninterrupted
single-process run of the same steps."""

import os
import subprocess
import sys

import pytest
import torch

import planner
import train_model
from distributed import free_port
from executor import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = os.path.join(ROOT, "tests", "train_model.py")
STEPS = 6


def _plan(tmp_path, devices: str) -> str:
    model, inputs, _ = train_model.build(16, "cpu")
    path = tmp_path / f"plan-{devices}.json"
    planner.optimize(model, devices, example_inputs=inputs, measure=False).save(path)
    return str(path)


def _hyplan_train(*args, fault: str | None = None) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "HYPLAN_FAULT"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env["OMP_NUM_THREADS"] = "1"
    if fault:
        env["HYPLAN_FAULT"] = fault
    return subprocess.Popen([sys.executable, "-m", "planner.cli", "train", *args], cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _finish(proc: subprocess.Popen) -> str:
    try:
        out, _ = proc.communicate(timeout=300)  # a safety net: a hung job fails, not blocks
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
        raise AssertionError(f"hyplan train hung:\n{out[-3000:]}") from None
    assert proc.returncode == 0, out[-3000:]
    return out


def _assert_final_equals_uninterrupted(directory):
    step, path = checkpoint.latest_checkpoint(directory)
    assert step == STEPS
    model, _, _ = train_model.build(16, "cpu")
    checkpoint.load_model(path, model)
    expected = train_model.reference(STEPS)
    for key, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), expected[key], rtol=1e-5, atol=1e-6,
                                   msg=lambda m: f"{key}: {m}")


@pytest.mark.parametrize("fault,resumed", [("1:4:step", 4), ("0:3:checkpoint", 2)],
                         ids=["killed-mid-step", "killed-mid-checkpoint"])
def test_killed_rank_restarts_and_ends_as_uninterrupted(tmp_path, fault, resumed):
    """rank 1 killed in step 5's backward (checkpoint 4 is complete), or rank 0 killed after
    checkpoint 4's shards were written but before it was marked complete (so 2 is the last
    complete one): torchrun restarts both ranks, which resume and finish."""
    ckpt = tmp_path / "ckpt"
    out = _finish(_hyplan_train(_plan(tmp_path, "2xcpu"), MODEL, "--steps", str(STEPS),
                                "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                                "--nproc-per-node", "2", "--max-restarts", "1", fault=fault))
    assert "exitcode: -9" in out  # the rank really was SIGKILLed
    assert f"resumed from {checkpoint.step_dir(ckpt, resumed)} (step {resumed})" in out, out
    assert not list(ckpt.glob(".partial-*"))
    _assert_final_equals_uninterrupted(ckpt)


def test_two_node_job_on_loopback_matches_one_process(tmp_path):
    """Two `hyplan train` agents, one process each, meet at a c10d rendezvous and run a
    plan made for two nodes of one CPU device."""
    plan, ckpt = _plan(tmp_path, "2x1xcpu"), tmp_path / "ckpt"
    assert planner.Plan.load(plan).mesh.nodes == 2
    launch = ["--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
              "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hyplan-test"]
    agents = [_hyplan_train(plan, MODEL, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
                            *launch) for _ in range(2)]
    outs = [_finish(a) for a in agents]
    assert sum(f"step {STEPS}/{STEPS}" in o for o in outs) == 1  # rank 0's node reports
    _assert_final_equals_uninterrupted(ckpt)
