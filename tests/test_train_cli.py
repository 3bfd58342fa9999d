"""`hyplan train` under torchrun: a pipelined plan's ranks killed mid-checkpoint and then
mid-step, restarted by torchrun, a two-node job on loopback, and a Hugging Face Llama from a model file all end
with the parameters of an uninterrupted single-process run of the same steps."""

import math
import os
import signal
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
HF_LLAMA = os.path.join(ROOT, "examples", "hf_llama.py")
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


@pytest.fixture
def train_here(capfd, monkeypatch):
    """train_here(*args, fault=None) -> output: `hyplan train ARGS` run by this process
    (`planner.cli.main`: torchrun's agent in-process, its workers new interpreters), its
    output and its workers' read from the file descriptors; the environment the command
    sets for its workers restored after. A `python -m planner.cli` child cost each launch
    3-4 s of interpreter start on this machine."""
    from planner.cli import main

    def run(*args, fault: str | None = None) -> str:
        monkeypatch.chdir(ROOT)  # workers import the model file and hyplan from here
        monkeypatch.setenv("OMP_NUM_THREADS", "1")
        if fault:
            monkeypatch.setenv("HYPLAN_FAULT", fault)
        else:
            monkeypatch.delenv("HYPLAN_FAULT", raising=False)
        before = dict(os.environ)

        def hung(signum, frame):  # a safety net: a hung job fails, not blocks
            raise TimeoutError("hyplan train ran past 300 s")

        handler = signal.signal(signal.SIGALRM, hung)
        signal.alarm(300)
        try:
            code = main(["train", *args])
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, handler)
            os.environ.clear()
            os.environ.update(before)
        out, err = capfd.readouterr()
        assert code == 0, (out + err)[-3000:]
        return out + err
    return run


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


def test_killed_ranks_restart_from_the_last_complete_checkpoint_and_end_as_uninterrupted(
        tmp_path, train_here):
    """A plan of two pipeline stages (1F1B, 4 microbatches), each rank saving its stage's
    part, killed twice. First rank 0, after checkpoint 4's shards were written but before it
    was marked complete: 2 is the last complete one, and torchrun restarts both ranks, each
    loading its stage's part of it. Then rank 1, in step 5's backward (checkpoint 4, made
    again, complete): both restart from 4. The final checkpoint holds the whole model as one
    process trains it. (One job for both faults: each attempt costs two new interpreters,
    ~7 s of this machine each.)"""
    from planner.plan3d import optimize_3d
    from planner.search import Shape

    model, inputs, _ = train_model.build(16, "cpu")
    plan = optimize_3d(model, "2xcpu", inputs, measure=False, only=[Shape(2, 1, 1, 4, "1F1B")])
    assert plan.is_mesh_3d and len(plan.pipeline.stages) == 2
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    out = train_here(str(tmp_path / "plan.json"), MODEL, "--steps", str(STEPS),
                     "--checkpoint-dir", str(ckpt), "--checkpoint-every", "2",
                     "--nproc-per-node", "2", "--max-restarts", "2",
                     fault="0:3:checkpoint,1:4:step")
    assert "HYPLAN_FAULT: SIGKILL rank 0 at step 3 (checkpoint)" in out, out
    assert f"resumed from {checkpoint.step_dir(ckpt, 2)} (step 2)" in out, out
    # the rank really was SIGKILLed (torchrun's own log names whichever failure it saw
    # first: the killed rank's -9 or its peer's error in the collective)
    assert "HYPLAN_FAULT: SIGKILL rank 1 at step 4 (step)" in out, out
    assert f"resumed from {checkpoint.step_dir(ckpt, 4)} (step 4)" in out, out
    assert not list(ckpt.glob(".partial-*"))
    _assert_final_equals_uninterrupted(ckpt)


def test_two_node_job_on_loopback_matches_one_process(tmp_path, train_here):
    """Two `hyplan train` agents, one process each (a new interpreter and this one), meet
    at a c10d rendezvous and run a plan made for two nodes of one CPU device."""
    plan, ckpt = _plan(tmp_path, "2x1xcpu"), tmp_path / "ckpt"
    assert planner.Plan.load(plan).mesh.nodes == 2
    args = [plan, MODEL, "--steps", str(STEPS), "--checkpoint-dir", str(ckpt),
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend", "c10d",
            "--rdzv-endpoint", f"127.0.0.1:{free_port()}", "--rdzv-id", "hyplan-test"]
    other = _hyplan_train(*args)
    try:
        here = train_here(*args)
    except BaseException:
        other.kill()  # its peer is gone: not left waiting at the rendezvous
        raise
    outs = [here, _finish(other)]
    assert sum(f"step {STEPS}/{STEPS}" in o for o in outs) == 1  # rank 0's node reports
    _assert_final_equals_uninterrupted(ckpt)


def _hf_llama_reference(steps: int, optimizer: str, batch: int = 8, lr: float = 1e-3,
                        seed: int = 0) -> dict[str, torch.Tensor]:
    """What `hyplan train ... examples/hf_llama.py --steps STEPS` should end with: one
    process, whole global batches of the synthetic token ids hyplan makes."""
    from executor.data import global_batch, synthetic_dataset
    from executor.train import make_optimizer
    from planner.cli import forward_kwargs, load_factory

    build = load_factory(HF_LLAMA)
    torch.manual_seed(seed)
    model, inputs, loss_fn = build(batch, device="cpu")
    kwargs = forward_kwargs(build)
    data = synthetic_dataset(model, inputs, loss_fn, 64 * batch, seed, forward_kwargs=kwargs)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    for step in range(steps):
        ids, targets = global_batch(data, batch, step, seed)
        loss = loss_fn(model(ids, **kwargs), targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}


def test_hf_llama_model_file_trains_as_one_process(tmp_path, train_here):
    """examples/hf_llama.py (transformers' Llama, traced by torch.export with
    use_cache=False) under a hybrid plan for 2 CPU processes (attention replicated, as
    hyplan chooses when it times this model here; the rest data parallel): finite losses,
    token ids within the vocabulary, and the final checkpoint equals one process."""
    pytest.importorskip("transformers")
    from planner.cli import forward_kwargs, load_factory

    build = load_factory(HF_LLAMA)
    model, inputs, _ = build(8, device="cpu")
    attention = {f"model.layers.{i}.self_attn": "replicate" for i in range(2)}
    plan = planner.optimize(model, "2xcpu", example_inputs=inputs, pin=attention,
                            example_kwargs=forward_kwargs(build), measure=False)
    assert plan.tracer == "export"
    assert {l.name: l.strategy for l in plan.layers if l.name in attention} == attention
    plan.save(tmp_path / "plan.json")
    ckpt = tmp_path / "ckpt"
    out = train_here(str(tmp_path / "plan.json"), HF_LLAMA, "--steps", "3",
                     "--checkpoint-dir", str(ckpt), "--nproc-per-node", "2")
    losses = [float(line.split()[3]) for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 3 and all(math.isfinite(x) for x in losses), out[-2000:]
    assert abs(losses[0] - math.log(256)) < 0.5  # random ids over the 256-token vocabulary

    step, path = checkpoint.latest_checkpoint(ckpt)
    assert step == 3
    trained, _, _ = build(8, device="cpu")
    checkpoint.load_model(path, trained)
    expected = _hf_llama_reference(3, plan.optimizer)
    # atol 5e-5: Adam divides each gradient by its own running size, so a gradient near
    # zero whose sum over 2 ranks rounds differently moves by up to lr (1e-3); on this
    # host one element of 16,384 in up_proj ended 1.03e-5 apart, before any change of ours
    for key, value in trained.named_parameters():
        torch.testing.assert_close(value.detach(), expected[key], rtol=1e-5, atol=5e-5,
                                   msg=lambda m: f"{key}: {m}")


def test_hf_llama_without_transformers_names_the_extra(monkeypatch):
    from planner.cli import load_factory

    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` fails
    with pytest.raises(ValueError, match=r"pip install 'hyplan\[hf\]'"):
        load_factory(HF_LLAMA)
