"""The 3-D search fits what a step holds, not only the stage problem's rows: on GPUs its
rows carry foreach AdamW's temporaries (strategies.step_memory.summed_temp_bytes), and a
plan whose step holds more beside them (the loss, FSDP's gathered groups, the pipeline's
buffers: planner.pipeline.stage_held.peak_bytes) is solved again in less room
(planner.search._Search.refit). So every plan the search keeps fits the budget by the
figure the Plan reports, and its bounds come from the rows' budget, a relaxation."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from planner.plan3d import to_plan
from planner.profiled import profiled_graph
from planner.search import search
from planner.pipeline.stage_held import peak_bytes

GPT_LIKE = 2048
ROWS = 4096


def _graph(devices: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, GPT_LIKE), nn.ReLU(), nn.Linear(GPT_LIKE, GPT_LIKE),
                          nn.ReLU(), nn.Linear(GPT_LIKE, GPT_LIKE), nn.ReLU(),
                          nn.Linear(GPT_LIKE, 8192))
    return profiled_graph(model, devices, (torch.randn(ROWS, 256),), measure=False)


@pytest.mark.parametrize("limit_mb", [180, 200, 250, 290])
def test_every_plan_the_search_keeps_fits_what_its_step_holds(limit_mb):
    graph, cluster = _graph("4x1xA100-80GB")
    budget = limit_mb * 1e6
    result = search(graph, cluster, "adam", budget, time_limit_s=5)
    kept = [c for c in result.candidates if c.solution is not None]
    if result.best is None:
        assert not kept
        return
    for c in kept:
        built = search_problem(result, graph, cluster, c)
        peak = peak_bytes(built, c.solution, c.shape, cluster, "adam", set(graph.outputs))
        assert max(peak) <= budget * (1 + 1e-9), (c.shape, max(peak) / 1e6)
        assert c.bound_s <= c.solution.times.step_s * (1 + 1e-9)
    plan = to_plan(graph, cluster, "adam", budget, result, 1.0)
    # the Plan reports the peak the search checked, and it fits
    assert max(plan.predicted.memory_bytes) <= budget * (1 + 1e-9)
    assert plan.solver.bound_s <= plan.solver.objective_s * (1 + 1e-9)


def search_problem(result, graph, cluster, c):
    """The candidate's stage problem as the search built it (its best's is kept on the
    result; another's is built again, the same)."""
    if c is result.best:
        return result.built
    from planner.pipeline import block_recompute
    from planner.search import CostCache, build

    cache = CostCache(graph, cluster, "adam")
    s = c.shape
    built = build(cache, s.pp, s.dp, s.tp, s.rows(graph.batch_size))
    return block_recompute.recompute_blocks(built, graph) if s.recompute else built


def test_the_rows_carry_the_foreach_temporaries_on_gpus_only():
    from planner.search import CostCache, build

    for devices, temps in (("2xA100-80GB", True), ("2xcpu", False)):
        graph, cluster = _graph(devices)
        built = build(CostCache(graph, cluster, "adam"), 1, 2, 1, 32)
        for i, local in enumerate(built.local_param_bytes):
            want = local if temps else 0 * local
            assert built.temp_bytes[i] == pytest.approx(want)
