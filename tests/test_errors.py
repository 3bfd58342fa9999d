"""Bad input stops early with one message that names what was wrong and the fix."""

import re

import pytest
import torch
import torch.distributed as dist
from torch import nn

import executor
import models
import planner
from distributed import free_port
from profiler import TraceError
from strategies import parse_devices


class Gate(nn.Module):
    """Data-dependent control flow: torch.fx cannot follow it."""

    def forward(self, x):
        if x.sum() > 0:
            return x
        return -x


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)
        self.gate = Gate()

    def forward(self, x):
        return self.gate(self.fc(x))


def test_untraceable_module_is_named_with_the_leaf_fix():
    with pytest.raises(TraceError) as info:
        planner.optimize(Gated(), "2xV100", example_inputs=(torch.randn(4, 8),))
    message = str(info.value)
    assert "'gate' (Gate)" in message and "leaf_modules=[Gate]" in message


def test_leaf_module_makes_it_plannable():
    plan = planner.optimize(Gated(), "2xV100", example_inputs=(torch.randn(4, 8),),
                            leaf_modules=[Gate])
    assert plan.layer("gate").strategy == "replicate"  # unknown: replicated, always correct


def test_plan_that_cannot_fit_says_needed_and_available_memory():
    from alexnet_example import build

    model, inputs, _ = build(65536, "meta")
    with pytest.raises(planner.PlanDoesNotFit) as info:
        planner.optimize(model, "8xK20", example_inputs=inputs)
    message = str(info.value)
    assert "needs at least" in message and "has 5.4 GB" in message and "add devices" in message


def test_the_memory_a_plan_needs_at_least_counts_what_the_step_holds_beside_its_layers():
    """The figure is the least-memory assignment's peak as a step holds it (DDP's buckets,
    the loss, optimizer temporaries beside the layers), not the layers' least alone."""
    from alexnet_example import build

    from planner.choices import layer_choices
    from planner.optimize import least_need_bytes
    from planner.profiled import profiled_graph

    model, inputs, _ = build(65536, "meta")
    with pytest.raises(planner.PlanDoesNotFit) as info:
        planner.optimize(model, "8xK20", example_inputs=inputs)
    needed = float(re.search(r"needs at least ([\d.]+) GB", str(info.value)).group(1)) * 1e9
    graph, cluster = profiled_graph(model, "8xK20", inputs)
    choices = layer_choices(graph, cluster, "adam", cluster.device.memory_bytes)
    layers_least = sum(min(c.memory_bytes for c in row.costs) for row in choices.layers)
    peak = least_need_bytes(choices, cluster, "adam", graph.outputs)
    assert peak > layers_least and needed >= layers_least
    assert needed == pytest.approx(peak, abs=0.05e9)  # printed to 0.1 GB


@pytest.mark.parametrize("spec,needle", [("8xFOO", "unknown device 'FOO'"),
                                         ("eight V100", "cannot read"),
                                         (0, "at least 1")])
def test_bad_device_strings(spec, needle):
    with pytest.raises(ValueError, match=needle):
        parse_devices(spec)


def test_bad_optimizer_and_pin_are_named():
    model, x = models.build("mlp"), models.batch("mlp", 8, 0)[0]
    with pytest.raises(ValueError, match="optimizer: 'lamb'"):
        planner.optimize(model, "2xV100", example_inputs=(x,), optimizer="lamb")
    with pytest.raises(ValueError, match="pin: layer '1' cannot use 'column_parallel'"):
        planner.optimize(model, "2xV100", example_inputs=(x,), pin={"1": "column_parallel"})
    with pytest.raises(ValueError, match=r"pin: no layer named \['fc9'\]"):
        planner.optimize(model, "2xV100", example_inputs=(x,), pin={"fc9": "data_parallel"})


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}",
                            rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_world_size_mismatch_names_both_numbers(one_rank_group):
    x = models.batch("mlp", 8, 0)[0]
    plan = planner.optimize(models.build("mlp"), "2xV100", example_inputs=(x,))
    with pytest.raises(executor.PlanMismatch, match="plan is for 2 devices, this run has 1"):
        executor.parallelize(models.build("mlp"), plan)


def test_plan_for_another_model_is_refused(one_rank_group):
    x = models.batch("mlp", 8, 0)[0]
    plan = planner.optimize(models.build("mlp"), "1xV100", example_inputs=(x,))
    with pytest.raises(executor.PlanMismatch, match="made for a Sequential"):
        executor.parallelize(Gated(), plan, leaf_modules=[Gate])


def test_shard_batch_checks_the_global_batch():
    x, y = models.batch("mlp", 8, 0)
    plan = planner.optimize(models.build("mlp"), "2xV100", example_inputs=(x,))
    with pytest.raises(ValueError, match="global batch of 8"):
        executor.shard_batch(plan, (x[:4], y[:4]), rank=0)


class Masked(nn.Module):
    """A forward with a keyword input: a mask over its rows."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, mask=None):
        return self.fc(x) * mask[:, None]


def test_keyword_inputs_are_split_by_rows_and_checked_by_name():
    x, mask = torch.randn(8, 8), torch.arange(8.0)
    plan = planner.baseline(Masked(), "2xcpu", "ddp", example_inputs=(x,),
                            example_kwargs={"mask": mask}, measure=False)
    assert [(i.name, i.layout, i.keyword) for i in plan.inputs] == [
        ("x", "batch", False), ("mask", "batch", True)]
    assert [i.name for i in plan.positional_inputs] == ["x"]
    mine = executor.shard_keywords(plan, {"mask": mask, "scale": 2.0}, rank=1)
    assert mine["mask"].tolist() == [4.0, 5.0, 6.0, 7.0] and mine["scale"] == 2.0
    with pytest.raises(ValueError, match="keyword 'mask' has 4 rows"):
        executor.shard_keywords(plan, {"mask": mask[:4]}, rank=0)


def test_a_weight_with_a_complete_and_a_partial_gradient_is_refused_before_a_step():
    from executor.modules import _refuse_mixed_gradients, module_path, partial_outside_modules

    model = models.TiedTransposed()
    plan = planner.baseline(model, "2xcpu", "ddp", example_inputs=(torch.randint(0, 16, (4, 3)),),
                            measure=False, tracer="export")
    paths = {l.node: module_path(model, l) for l in plan.layers}
    with pytest.raises(ValueError, match="'embed.weight' is read by a replicated module"):
        _refuse_mixed_gradients(plan, paths, partial_outside_modules(plan.layers, paths))


class Pooled(nn.Module):
    """A layer computed and never used (SqueezeBERT's pooler under a masked-LM head)."""

    def __init__(self):
        super().__init__()
        self.fc, self.pooler = nn.Linear(8, 4), nn.Linear(8, 8)

    def forward(self, x):
        self.pooler(x[:, 0])
        return self.fc(x)


def test_parameters_no_gradient_reaches_are_left_out_of_ddp():
    from executor.styles import dead_params, summed_params

    plan = planner.baseline(Pooled(), "2xcpu", "ddp", example_inputs=(torch.randn(4, 3, 8),),
                            measure=False)
    assert dead_params(plan) == {"pooler.weight", "pooler.bias"}
    assert summed_params(plan) == {"fc.weight", "fc.bias"}


def test_a_gpu_plan_on_cpu_ranks_says_so(one_rank_group):
    x = models.batch("mlp", 8, 0)[0]
    plan = planner.optimize(models.build("mlp"), "1xV100", example_inputs=(x,))
    with pytest.raises(ValueError, match=r"CUDA devices \(V100\) and this process sees "
                                         r"none; .*devices='1xcpu'"):
        executor.parallelize(models.build("mlp"), plan)
