"""The collectives a planned step issues are the ones the cost model priced: for every edge
and every model-parallel layer, the kinds and counts DTensor runs (seen by CommDebugMode)
equal those `strategies.layouts` predicts; DDP all-reduces the data-parallel weights."""

from collections import Counter

import pytest
import torch.nn.functional as F

import executor
import models
import planner
from distributed import run_ranks
from profiler import fx_trace
from strategies.layouts import Layout, edge_collectives

ROWS = 16


def predicted_collectives(plan: planner.Plan, model) -> Counter:
    """Count of each collective one forward+backward should issue under `plan`."""
    gives = {i.name: (Layout(i.layout), True) for i in plan.inputs}
    gives.update({l.node: (Layout(l.output_layout), False) for l in plan.layers})
    layers = {l.node: l for l in plan.layers}
    counts: Counter = Counter()

    def edge(src: str, takes: Layout):
        layout, is_input = gives[src]
        fwd, bwd = edge_collectives(layout, takes)
        counts.update([c for c in (fwd, None if is_input else bwd) if c])

    for node in fx_trace(model).graph.nodes:
        if node.op == "output":
            for src in node.all_input_nodes:
                edge(src.name, Layout.BATCH)
        layer = layers.get(node.name)
        if layer is None:
            continue
        for src in node.all_input_nodes:
            if src.name in gives:
                edge(src.name, Layout(layer.input_layout))
        if layer.strategy == "row_parallel":
            counts.update(["all_reduce"] if layer.output_layout == "replicate"
                          else ["reduce_scatter", "all_gather"])
    return counts


def _observed(rank, world, plan_json, name):
    from torch.distributed.tensor.debug import CommDebugMode

    plan = planner.Plan.from_json(plan_json)
    model = executor.parallelize(models.build(name), plan)
    x, y = executor.shard_batch(plan, models.batch(name, ROWS, 0))
    with CommDebugMode() as comm:
        F.cross_entropy(model(x), y).backward()
    return {str(op): n for op, n in comm.get_comm_counts().items()}


FUNCTIONAL = {"all_gather_into_tensor": "all_gather", "reduce_scatter_tensor": "reduce_scatter",
              "all_reduce": "all_reduce", "all_to_all_single": "all_to_all"}


@pytest.mark.parametrize("name,pin", [
    ("mlp", {"0": "data_parallel", "2": "column_parallel", "4": "row_parallel"}),
    ("cnn", {"features.3": "channel_parallel", "classifier.0": "row_parallel",
             "classifier.2": "column_parallel"}),
])
def test_collectives_equal_the_plans(name, pin):
    example = models.batch(name, ROWS, 0)[0]
    plan = planner.optimize(models.build(name), "2xcpu", example_inputs=(example,), pin=pin,
                            measure=False)
    expected = predicted_collectives(plan, models.build(name))
    observed = run_ranks(_observed, 2, plan.to_json(), name)[0]
    functional = Counter()
    for op, n in observed.items():
        kind = op.split(".")[-1]
        if op.startswith("c10d_functional.") and kind in FUNCTIONAL:
            functional[FUNCTIONAL[kind]] += n
    assert functional == expected, (observed, plan.explain())
    has_dp_weights = any(l.strategy == "data_parallel" and l.param_bytes for l in plan.layers)
    assert (observed.get("c10d.allreduce_", 0) > 0) == has_dp_weights
