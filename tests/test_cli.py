"""`hyplan plan` and `hyplan show`: a plan round-trips through JSON, and each bad input ends
in one line on stderr with exit status 2, never a traceback. V100 devices plan on meta
tensors, so nothing is timed here."""

import subprocess
import sys
from pathlib import Path

from planner.cli import main, parse_memory

ROOT = Path(__file__).resolve().parents[1]
MLP = str(ROOT / "examples" / "mlp.py")


def _fails_with_one_line(capsys, argv) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("hyplan: error: ") and err.count("\n") == 1, err
    return err


def test_plan_saved_as_json_shows_the_same_plan(capsys, tmp_path):
    path = tmp_path / "plan.json"
    assert main(["plan", MLP, "--devices", "2xV100", "--batch", "64", "--json", str(path)]) == 0
    planned = capsys.readouterr().out
    assert path.is_file() and str(path) in planned

    assert main(["show", str(path)]) == 0
    shown = capsys.readouterr().out
    for text in ("fc1", "fc2", "fc3", "Predicted step time", "global batch 64", "2xV100"):
        assert text in shown
    assert shown in planned


def test_unknown_device_names_it_and_the_known_ones(capsys):
    err = _fails_with_one_line(capsys, ["plan", MLP, "--devices", "8xFOO", "--batch", "64"])
    assert "'FOO'" in err and "V100" in err and "H100" in err


def test_missing_model_file(capsys, tmp_path):
    missing = str(tmp_path / "nope.py")
    err = _fails_with_one_line(capsys, ["plan", missing, "--devices", "2xV100", "--batch", "8"])
    assert "nope.py" in err and "not found" in err


def test_model_file_without_build(capsys, tmp_path):
    path = tmp_path / "empty.py"
    path.write_text("x = 1\n")
    err = _fails_with_one_line(capsys, ["plan", str(path), "--devices", "2xV100", "--batch", "8"])
    assert "build" in err


def test_corrupted_plan_json(capsys, tmp_path):
    path = tmp_path / "plan.json"
    path.write_text('{"schema_version": 1, "model": ')
    err = _fails_with_one_line(capsys, ["show", str(path)])
    assert "JSON" in err


def test_negative_batch(capsys):
    err = _fails_with_one_line(capsys, ["plan", MLP, "--devices", "2xV100", "--batch", "-64"])
    assert "--batch" in err and "-64" in err


def test_plan_that_does_not_fit_names_the_flag(capsys):
    err = _fails_with_one_line(capsys, ["plan", MLP, "--devices", "2xV100", "--batch", "8",
                                        "--memory-limit", "1MB"])
    assert "does not fit" in err and "--memory-limit" in err


def test_memory_sizes():
    assert parse_memory("40GB") == 40e9
    assert parse_memory("40GiB") == 40 * 2**30
    assert parse_memory("512MB") == 512e6
    assert parse_memory("1024") == 1024


def test_help_runs_as_a_command():
    result = subprocess.run([sys.executable, "-m", "planner.cli", "--help"], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "plan" in result.stdout and "show" in result.stdout


def test_examples_build_on_meta_without_allocating_weights():
    """A 10 B-parameter GPT built on meta costs no memory (built under torch.device)."""
    import subprocess
    import sys

    code = ("import resource, sys; sys.path.insert(0, 'examples'); import gpt, alexnet, mlp\n"
            "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
            "m, _, _ = gpt.build(8, layers=48, width=4096, heads=32)\n"
            "for mod in (alexnet, mlp): mod.build(8)\n"
            "grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before\n"
            "assert sum(p.numel() for p in m.parameters()) > 1e10\n"
            "assert grew < 2_000_000, f'{grew} KiB'  # 40 GB when the weights were allocated\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=str(Path(__file__).resolve().parents[1]))
    assert out.returncode == 0, out.stderr[-2000:]
