"""A missing optional dependency (matplotlib for --plot, transformers for a Hugging Face
model file) is one line on stderr naming the extra to install, and exit status 2; the
import is made to fail by putting None in sys.modules, as if the package were absent."""

import subprocess
import sys

import pytest

from planner.cli import main
from planner.extras import MissingExtra
from test_cli import MLP, ROOT

PLOT_LINE = "hyplan: error: --plot needs matplotlib; install it with pip install 'hyplan[plot]'\n"


@pytest.fixture
def no_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)


@pytest.fixture
def plan_file(tmp_path, capsys):
    path = tmp_path / "plan.json"
    assert main(["plan", MLP, "--devices", "2xV100", "--batch", "8", "--json", str(path)]) == 0
    capsys.readouterr()
    return str(path)


def test_plan_with_plot_without_matplotlib_names_the_extra_before_planning(
        no_matplotlib, capsys, tmp_path):
    pictures = tmp_path / "pictures"
    argv = ["plan", MLP, "--devices", "2xV100", "--batch", "8", "--plot", str(pictures)]
    assert main(argv) == 2
    out, err = capsys.readouterr()
    assert err == PLOT_LINE
    assert out == "" and not pictures.exists()  # nothing planned, nothing written


def test_show_with_plot_without_matplotlib_names_the_extra(plan_file, no_matplotlib, capsys,
                                                           tmp_path):
    assert main(["show", plan_file, "--plot", str(tmp_path / "pictures")]) == 2
    assert capsys.readouterr().err == PLOT_LINE


def test_plot_api_without_matplotlib_raises_missing_extra(plan_file, no_matplotlib, tmp_path):
    from planner import Plan
    from planner.report.plot import write_plots

    with pytest.raises(MissingExtra, match=r"needs matplotlib; install it with pip install "
                                           r"'hyplan\[plot\]'"):
        write_plots(Plan.load(plan_file), tmp_path)


def test_model_file_needing_transformers_names_the_hf_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)
    model = tmp_path / "hf_model.py"
    model.write_text("from transformers import LlamaConfig\n\ndef build(batch, device='meta'):\n"
                     "    raise AssertionError('not reached')\n")
    assert main(["plan", str(model), "--devices", "2xV100", "--batch", "8"]) == 2
    assert capsys.readouterr().err == (f"hyplan: error: model: {model} needs transformers; "
                                       f"install it with pip install 'hyplan[hf]'\n")


def test_the_hyplan_command_exits_2_with_one_line(plan_file, tmp_path):
    """The real process: its exit status and all of its stderr."""
    code = ("import sys; sys.modules['matplotlib'] = None; from planner.cli import main; "
            f"raise SystemExit(main(['show', {plan_file!r}, '--plot', {str(tmp_path)!r}]))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert done.returncode == 2
    assert done.stderr == PLOT_LINE
