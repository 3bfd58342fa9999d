"""Krizhevsky's "one weird trick", found by the solver: on AlexNet, data-parallel
convolutions and model-parallel fully connected layers, and the FC choice flips to data
parallelism once the batch is large enough that activations outweigh weights."""

import pytest

import planner
from alexnet_example import build

FC_4096 = ("classifier.1", "classifier.4")
# data parallel, its weights replicated (DDP) or sharded (FSDP): where the collectives run
# beside the convolutions' compute (GPUs, strategies.overlap) sharding is the cheaper of
# the two by the optimizer's work on 1/P of the weights, and both split the batch by rows
ROWS_SPLIT = ("data_parallel", "fsdp")


def _plan(devices, batch, **kwargs):
    model, inputs, _ = build(batch, "meta")
    return planner.optimize(model, devices, example_inputs=inputs, optimizer="sgd_momentum",
                            **kwargs)


@pytest.mark.parametrize("devices", ["8xK20", "8xV100"])
@pytest.mark.parametrize("batch", [128, 1024])
def test_convs_data_parallel_and_wide_fc_model_parallel(devices, batch):
    plan = _plan(devices, batch)
    for layer in plan.layers:
        if layer.kind == "Conv2d":
            assert layer.strategy in ROWS_SPLIT, (layer.name, layer.strategy)
    for name in FC_4096:
        assert plan.layer(name).model_parallel, (name, plan.layer(name).strategy)
    assert plan.solver.status == "optimal"
    assert plan.solver.bound_s == pytest.approx(plan.solver.objective_s, rel=1e-6)
    assert plan.predicted.speedup_over_data_parallel > 1.0
    assert 1.0 < plan.predicted.speedup_over_single_device <= 8.0
    # the first conv is data-parallel, so each rank loads only its rows, as with DDP
    assert [i.layout for i in plan.inputs] == ["batch"]


def test_fc_flips_to_data_parallel_far_above_the_crossover():
    # by communication volume the crossover is near a global batch of 3,400 (REFERENCES.md)
    plan = _plan("8xK20", 32768, memory_limit_bytes=1e13)
    assert all(plan.layer(n).strategy in ROWS_SPLIT for n in FC_4096)


def test_explain_states_speedups_and_reasons():
    plan = _plan("8xK20", 1024)
    text = plan.explain()
    assert "pure data parallel on the same devices" in text
    assert "speedup" in text
    assert "classifier.1: model-parallel" in text
    # the sentence quotes the data-parallel traffic it avoided: DDP's or FSDP's
    assert "MB of gradients" in text or "MB of weights" in text


def test_plan_json_round_trip():
    plan = _plan("8xV100", 128)
    again = planner.Plan.from_json(plan.to_json())
    assert again == plan
    assert again.predicted.memory_bytes == plan.predicted.memory_bytes
    assert len(again.predicted.memory_bytes) == 8
