"""`hyplan export` and `hyplan compare --torchtitan/--megatron`: a per-layer hybrid plan
says which layers the frameworks cannot express and prices the nearest configuration they
run; a user's job is priced beside hyplan's plan with what to change."""

import tomllib

import pytest

import planner
from planner.cli import main
from planner.cli.job_args import build_any
from planner.cli.model_args import load_factory
from planner.export import read_megatron, read_torchtitan

ALEXNET = "examples/alexnet.py"


@pytest.fixture(scope="module")
def alexnet_plan(tmp_path_factory):
    """AlexNet on 8 K20 at batch 1024 (`hyplan plan` as the README runs it): data-parallel
    (FSDP) convolutions beside model-parallel classifiers."""
    from planner.cli.model_args import build_model

    model, inputs = build_model(load_factory(ALEXNET), 1024, "meta")
    plan = planner.optimize(model, "8xK20", inputs)
    path = tmp_path_factory.mktemp("plans") / "alexnet.json"
    plan.save(path)
    return path, plan


def test_export_of_a_per_layer_hybrid_names_the_layers_and_prices_the_nearest(
        alexnet_plan, tmp_path, capsys):
    path, plan = alexnet_plan
    out_file = tmp_path / "job.toml"
    assert main(["export", str(path), "--to", "torchtitan", "-o", str(out_file),
                 "--model", ALEXNET]) == 0
    out = capsys.readouterr().out
    convs = [l.name for l in plan.layers if l.kind == "Conv2d"]
    assert "torchtitan cannot express this plan exactly" in out
    assert "run sharded (FSDP) where most weights tensor parallel" in out
    assert all(name in out for name in convs)
    # the plan's price, then the nearest configuration's, slower: the convolutions split
    # over tp as the classifiers are
    plan_line, nearest_line = [l for l in out.splitlines() if "step " in l][-2:]
    assert f"{plan.predicted.step_time_s * 1e3:.1f} ms" in plan_line
    assert "x faster" in nearest_line
    text = out_file.read_text()
    tomllib.loads(text)
    job = read_torchtitan(text, devices=8)
    assert (job.tp, job.dp, job.global_batch) == (8, 1, 1024)


def test_export_to_megatron_prints_arguments_megatron_reads(alexnet_plan, capsys):
    path, _ = alexnet_plan
    assert main(["export", str(path), "--to", "megatron"]) == 0
    lines = capsys.readouterr().out.splitlines()
    job = read_megatron(lines[0], devices=8)
    assert job.tp == 8 and job.global_batch == 1024
    assert all(line.startswith("# ") for line in lines[1:])
    assert any("pass --model MODEL" in line for line in lines)


def test_compare_prices_a_torchtitan_job_beside_hyplans_plan(tmp_path, capsys):
    job = tmp_path / "mlp.toml"
    job.write_text("[training]\nlocal_batch_size = 16\n[parallelism]\n"
                   "data_parallel_shard_degree = -1\n[activation_checkpoint]\nmode = 'none'\n")
    assert main(["compare", "examples/mlp.py", "--devices", "4xA100",
                 "--torchtitan", str(job)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("torchtitan mlp.toml (dp_shard 4, 1 microbatch(es) of 16")
    assert "hyplan's plan (tp 4" in out
    assert "Change FSDP shard degree 4 -> 1; tensor parallel 1 -> 4: predicted" in out


def test_compare_with_megatron_arguments_that_are_hyplans_plan_says_keep(capsys):
    args = "--tensor-model-parallel-size 4 --micro-batch-size 64 --global-batch-size 64 --bf16"
    assert main(["compare", "examples/mlp.py", "--devices", "4xA100", "--megatron", args]) == 0
    out = capsys.readouterr().out
    assert out.startswith("Megatron-LM arguments (tp 4")
    assert "Keep yours" in out


def test_compare_names_a_missing_job_file(tmp_path, capsys):
    assert main(["compare", "examples/mlp.py", "--devices", "4xA100",
                 "--torchtitan", str(tmp_path / "none.toml")]) == 2
    assert "--torchtitan: file" in capsys.readouterr().err


def test_build_any_reads_an_llm_preset_at_the_jobs_sequence():
    built = build_any("llama3-8b", 2, 128, None)
    assert built.tracer == "blocks" and built.seq == 128
    assert tuple(built.inputs[0].shape) == (2, 128)
