"""The catalogue of bad inputs at the command line, beyond those in test_cli.py: each ends
in one line on stderr that names the field and the fix, with exit status 2, before any
process is started."""

import json

import pytest

from planner.cli import main
from test_cli import MLP, ROOT, _fails_with_one_line

TRAIN_MODEL = str(ROOT / "tests" / "train_model.py")


@pytest.fixture(scope="module")
def mlp_plan(tmp_path_factory) -> str:
    """A 2-device plan for examples/mlp.py."""
    path = tmp_path_factory.mktemp("plans") / "mlp.json"
    assert main(["plan", MLP, "--devices", "2xV100", "--batch", "64", "--json", str(path)]) == 0
    return str(path)


@pytest.fixture
def plan_file(mlp_plan, tmp_path, capsys):
    capsys.readouterr()
    return mlp_plan


CASES = {
    "zero batch": (["plan", MLP, "--devices", "2xV100", "--batch", "0"],
                   ["--batch", "positive"]),
    "device count zero": (["plan", MLP, "--devices", "0xV100", "--batch", "8"],
                          ["devices", "positive"]),
    "unreadable memory size": (["plan", MLP, "--devices", "2xV100", "--batch", "8",
                                "--memory-limit", "lots"], ["--memory-limit", "40GB"]),
    "unknown dtype": (["plan", MLP, "--devices", "2xV100", "--batch", "8", "--dtype", "float7"],
                      ["--dtype", "float7"]),
    "train: plan for another model": (["train", "{plan}", TRAIN_MODEL, "--nproc-per-node", "2"],
                                      ["plan mismatch", "hyplan plan MODEL"]),
    "train: world size mismatch": (["train", "{plan}", MLP, "--nproc-per-node", "3"],
                                   ["world size mismatch", "--nproc-per-node 2", "re-plan"]),
    "train: two nodes for a one-node plan": (["train", "{plan}", MLP, "--nnodes", "2",
                                              "--nproc-per-node", "2"],
                                             ["--nnodes 1 --nproc-per-node 2"]),
    "train: negative steps": (["train", "{plan}", MLP, "--steps", "-5"], ["--steps", "-5"]),
    "train: zero learning rate": (["train", "{plan}", MLP, "--lr", "0"], ["--lr", "positive"]),
    "train: missing plan": (["train", "{missing}", MLP], ["not found", "hyplan plan"]),
}


@pytest.mark.parametrize("argv,needles", CASES.values(), ids=CASES.keys())
def test_bad_input_is_one_line_naming_field_and_fix(capsys, plan_file, tmp_path, argv, needles):
    argv = [a.format(plan=plan_file, missing=tmp_path / "nope.json") for a in argv]
    err = _fails_with_one_line(capsys, argv)
    for needle in needles:
        assert needle in err, err


def test_plan_file_with_a_bad_field_names_it(capsys, plan_file, tmp_path):
    data = json.loads(open(plan_file).read())
    data["global_batch"] = -64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    for verb in (["show", str(bad)], ["train", str(bad), MLP]):
        err = _fails_with_one_line(capsys, verb)
        assert "'global_batch'" in err and "re-create the plan" in err


def test_binary_plan_file_is_refused(capsys, tmp_path):
    bad = tmp_path / "plan.json"
    bad.write_bytes(b"\x80\x04\x95 not json, a pickle perhaps")
    err = _fails_with_one_line(capsys, ["train", str(bad), MLP])
    assert "JSON" in err


def test_checkpoints_of_another_model_are_refused(capsys, plan_file, tmp_path):
    step = tmp_path / "ckpt" / "step_00000004"
    step.mkdir(parents=True)
    (step / ".metadata").write_bytes(b"")
    (step / "hyplan.json").write_text(json.dumps({"step": 4, "model": "ResNet",
                                                  "fingerprint": "0123456789abcdef"}))
    err = _fails_with_one_line(capsys, ["train", plan_file, MLP, "--nproc-per-node", "2",
                                        "--checkpoint-dir", str(tmp_path / "ckpt")])
    assert "--checkpoint-dir" in err and "ResNet" in err and "new directory" in err
