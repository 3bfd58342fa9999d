"""Precision is priced as the executor keeps and sends each tensor: on a model of three
Linears the predicted memory under bf16-mixed and fp32 is the byte arithmetic written out
here, activation layout changes cost half, gradient reductions stay fp32; each device kind
trains in its usual precision unless asked; the plan records and explains its precision."""

import json

import pytest

from strategies import gpu_compute
import torch
from torch import nn

import planner
from planner.choices import layer_choices
from planner.profiled import profiled_graph
from strategies import DEVICES, LinkSpec, parse_devices
from strategies.precision import default_precision, parse_precision

BATCH = 32


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 128), nn.ReLU(),
                         nn.Linear(128, 16))


PARAMS = 64 * 128 + 128 + 128 * 128 + 128 + 128 * 16 + 16  # 26,896 weights
# elements autograd keeps for backward (profiler.saved): each ReLU's output (it saves its
# result, the next Linear its input) and the last Linear's (returned to the loss); a Linear
# before a ReLU keeps none of its own
KEPT = BATCH * (128 + 128 + 16)
INPUT = BATCH * 64


def _cluster(precision: str):
    """2 H100 on a link without latency, so a collective's time is its bytes / bandwidth."""
    link = LinkSpec(name="ideal", bandwidth_bytes_per_s=100e9, latency_s=0.0)
    cluster = parse_devices("2xH100").model_copy(update={"intra_node": link, "inter_node": link})
    return cluster.at_precision(precision)


def _plan(precision: str, pin: dict[str, str]):
    return planner.optimize(_model(), _cluster(precision), (torch.randn(BATCH, 64),),
                            measure=False, pin=pin)


def test_data_parallel_memory_is_the_byte_arithmetic_of_each_precision():
    pin = {name: "data_parallel" for name in ("0", "1", "2", "3", "4")}
    fp32, bf16 = _plan("fp32", pin), _plan("bf16-mixed", pin)
    ranks, adam = 2, 2
    # fp32: weights, gradients and 2 Adam moments at 4 bytes; each rank keeps its rows' share
    expected_fp32 = PARAMS * 4 * (2 + adam) + (KEPT + INPUT) * 4 / ranks
    # bf16-mixed: the same fp32 masters, gradients and state, plus autocast's 2-byte copy of
    # each weight; activations in bf16; the input as the user passes it (fp32)
    expected_bf16 = PARAMS * (4 * (2 + adam) + 2) + KEPT * 2 / ranks + INPUT * 4 / ranks
    # and what the step holds beside them in either precision (strategies.step_memory):
    # DDP's buckets, an fp32 gradient's copy, and foreach Adam's sqrt of every moment
    held = PARAMS * 4 + PARAMS * 4
    expected_fp32, expected_bf16 = expected_fp32 + held, expected_bf16 + held
    # the peak is the optimizer step's (every gradient and Adam's temporaries, no
    # activation left: step_memory.not_together_bytes), the activations' share above
    # being less than a gradient's and a temporary's
    assert (KEPT + INPUT) * 4 / ranks < PARAMS * 8
    expected_fp32 -= (KEPT + INPUT) * 4 / ranks
    expected_bf16 -= KEPT * 2 / ranks + INPUT * 4 / ranks
    assert fp32.predicted.memory_bytes[0] == pytest.approx(expected_fp32, rel=1e-12)
    assert bf16.predicted.memory_bytes[0] == pytest.approx(expected_bf16, rel=1e-12)
    assert (fp32.precision, bf16.precision) == ("fp32", "bf16-mixed")


def test_fsdp_keeps_no_low_precision_copy_and_gathers_half_the_bytes():
    graph32, c32 = profiled_graph(_model(), _cluster("fp32"), (torch.randn(BATCH, 64),),
                                  measure=False)
    graph16, c16 = profiled_graph(_model(), _cluster("bf16-mixed"), (torch.randn(BATCH, 64),),
                                  measure=False)
    rows32 = {r.layer.name: r for r in layer_choices(graph32, c32, "adam", None).layers}
    rows16 = {r.layer.name: r for r in layer_choices(graph16, c16, "adam", None).layers}

    def cost(rows, name, strategy):
        row = rows[name]
        return row.costs[[s.name for s in row.strategies].index(strategy)]

    p = (128 * 128 + 128) * 4  # layer "2": fp32 bytes of its weights
    out = 0  # kept for backward: none of its output (the ReLU after it saves its result)
    f32, f16 = cost(rows32, "2", "fsdp"), cost(rows16, "2", "fsdp")
    assert f32.memory_bytes == pytest.approx(p / 2 * 4 + out * 4 / 2)  # w, g, 2 moments
    assert f16.memory_bytes == pytest.approx(p / 2 * 4 + out * 2 / 2)  # the same, bf16 rows
    # all-gathers (forward and backward) in bf16: half; the reduce-scatter in fp32: the same
    assert f16.notes["param_all_gather_s"] == pytest.approx(f32.notes["param_all_gather_s"] / 2)
    assert f16.notes["gradient_reduce_scatter_s"] == pytest.approx(
        f32.notes["gradient_reduce_scatter_s"])
    d32, d16 = cost(rows32, "2", "data_parallel"), cost(rows16, "2", "data_parallel")
    assert d16.notes["gradient_all_reduce_s"] == pytest.approx(d32.notes["gradient_all_reduce_s"])
    # a row-parallel layer's output all-reduce carries bf16 activations: half the time
    r32, r16 = cost(rows32, "2", "row_parallel"), cost(rows16, "2", "row_parallel")
    assert r16.communication_s == pytest.approx(r32.communication_s / 2)
    # compute at each precision's dtype (strategies.gpu_compute: the GEMMs by shape)
    layer32, layer16 = rows32["2"].layer, rows16["2"].layer
    h100 = DEVICES["H100"]
    for layer, dtype, row_cost in ((layer32, "float32", d32), (layer16, "bfloat16", d16)):
        assert row_cost.compute_s == pytest.approx(
            gpu_compute.layer_s(layer, 1 / 2, "batch", h100, dtype))
    assert d16.compute_s < d32.compute_s


def test_activation_layout_changes_cost_half_in_bf16():
    """Data parallel into a column split: the edge all-gathers the rows forward and
    reduce-scatters the partial input gradient backward, both in the activation's dtype."""
    pin = {"0": "data_parallel", "1": "data_parallel", "2": "column_parallel",
           "3": "feature_parallel", "4": "row_parallel"}
    fp32, bf16 = _plan("fp32", pin), _plan("bf16-mixed", pin)
    column32, column16 = fp32.layer("2"), bf16.layer("2")
    assert column32.reshard_in_s > 0
    assert column16.reshard_in_s == pytest.approx(column32.reshard_in_s / 2)


def test_each_device_trains_in_its_usual_precision_unless_asked():
    expected = {"H100": "bf16-mixed", "H200": "bf16-mixed", "A100": "bf16-mixed",
                "A100-40GB": "bf16-mixed", "V100": "fp16-mixed", "V100-32GB": "fp16-mixed",
                "K20": "fp32", "K80": "fp32"}
    for name, precision in expected.items():
        assert default_precision(DEVICES[name]).name == precision, name
        assert parse_devices(f"2x{name}").training_precision.name == precision, name
    assert parse_devices("1xcpu").training_precision.name == "fp32"
    assert parse_devices("1xcpu").at_precision("bf16-mixed").training_precision.mixed
    with pytest.raises(ValueError, match="V100 has no arithmetic.*fp16-mixed or fp32"):
        parse_devices("2xV100").at_precision("bf16-mixed")
    with pytest.raises(ValueError, match="'bf17' is not one of bf16-mixed"):
        parse_precision("bf17")


def test_the_plan_records_and_explains_its_precision():
    plan = _plan("bf16-mixed", {})
    assert plan.precision == "bf16-mixed" and plan.cluster.precision == "bf16-mixed"
    assert "Precision: bf16-mixed: bf16 matmuls and activations" in plan.explain()
    again = planner.Plan.from_json(plan.to_json())
    assert again.precision == "bf16-mixed" and again == plan
    # a plan file from before precisions existed was priced in fp32
    old = json.loads(plan.to_json())
    del old["precision"], old["cluster"]["precision"]
    assert planner.Plan.from_json(json.dumps(old)).precision == "fp32"
    old.update(precision="fp16-mixed")
    old["cluster"]["precision"] = "bf16-mixed"
    with pytest.raises(planner.PlanFileError, match="precision"):
        planner.Plan.from_json(json.dumps(old))


def test_cli_precision_flag(tmp_path, capsys):
    from planner.cli import main

    model = tmp_path / "three.py"
    model.write_text(
        "import torch\nfrom torch import nn\n"
        "def build(batch, device='meta'):\n"
        "    m = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 16)).to(device)\n"
        "    return m, (torch.randn(batch, 64, device=device),), nn.functional.cross_entropy\n")
    out = tmp_path / "plan.json"
    assert main(["plan", str(model), "--devices", "2xH100", "--batch", "32",
                 "--precision", "fp32", "--json", str(out)]) == 0
    assert "Precision: fp32 throughout" in capsys.readouterr().out
    assert planner.Plan.load(out).precision == "fp32"
    assert main(["plan", str(model), "--devices", "2xH100", "--batch", "32"]) == 0
    assert "Precision: bf16-mixed" in capsys.readouterr().out
    assert main(["plan", str(model), "--devices", "2xV100", "--batch", "32",
                 "--precision", "bf16-mixed"]) == 2
    assert "--precision: bf16-mixed computes in bfloat16" in capsys.readouterr().err
