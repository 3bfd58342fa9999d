"""Context parallelism as a degree of the 3-D search (planner.context_degrees): a cp shape's
program finds what brute force over its layers' options finds, with and without a memory
budget that binds; its plan says the degree and why; a pinned search offers none."""

from __future__ import annotations

import itertools

import pytest
import torch

from planner.choices import layer_choices
from planner.context_degrees import ContextGroup
from planner.pipeline.stage_held import peak_bytes
from planner.problem import Solution
from planner.profiled import profiled_graph
from planner.search import CostCache, Shape, search

SEQ, VOCAB = 16, 64
SHAPE = Shape(1, 1, 4, 1, "1F1B", cp=2)  # cp 2 x dp 2: one group of 4 devices


@pytest.fixture(scope="module")
def graph_cluster():
    from examples.gpt import GPT

    torch.manual_seed(0)
    model = GPT(layers=1, width=32, heads=4, seq=SEQ, vocab=VOCAB)
    ids = torch.randint(0, VOCAB, (2, SEQ))
    return profiled_graph(model, "4xH100", (ids,), measure=False)


def _every_assignment(graph, cluster):
    """(step, peak memory per device) of every assignment of the cp shape's options: each
    layer with weights replicated or FSDP2-sharded over the 4 ranks, priced as the plan
    kinds price one assignment (evaluate, peak_bytes)."""
    cache = CostCache(graph, cluster, "adam")
    choices = layer_choices(graph, cluster, "adam", None, cache=cache,
                            group=ContextGroup(cp=SHAPE.cp))
    problem = choices.built.problem
    out = []
    for choice in itertools.product(*(range(len(o.strategies)) for o in problem.layers)):
        staged = choices.staged(Solution(choice, 0.0, 0.0, "optimal", 0.0, ""))
        peak = peak_bytes(choices.built, staged, choices.shape, cluster, "adam",
                          set(graph.outputs))
        out.append((staged.times.step_s, max(peak)))
    return out


def test_a_cp_shape_finds_what_brute_force_over_its_options_finds(graph_cluster):
    graph, cluster = graph_cluster
    every = _every_assignment(graph, cluster)
    assert len(every) >= 2 ** 6  # the options multiply: a real choice per layer
    fastest = min(every)
    leanest = min(peak for _, peak in every)
    for budget in (None, fastest[1] * 2, (leanest + fastest[1]) / 2):
        result = search(graph, cluster, "adam", budget, only=[SHAPE], search_time_s=None)
        fits = [step for step, peak in every if budget is None or peak <= budget]
        assert result.best.solution.times.step_s == pytest.approx(min(fits), rel=1e-9)
    # the budget that binds makes the program shard: not the fastest assignment
    assert min(s for s, p in every if p <= (leanest + fastest[1]) / 2) > fastest[0]


def test_a_cp_plan_of_the_search_says_its_degree_and_why():
    """A sequence of 1,024 tokens, 2 of them on 4 H100s: the search's best is cp 2 x dp 2,
    its plan on the ("dp", "cp") mesh, its why naming the other degree and the best shape
    without cp, each layer's reason its own traffic; exported to torchtitan with its cp."""
    from examples.gpt import GPT
    from planner.export.torchtitan import to_torchtitan
    from planner.plan3d import optimize_3d

    torch.manual_seed(0)
    seq = 1024
    model = GPT(layers=1, width=64, heads=4, seq=seq, vocab=VOCAB)
    plan = optimize_3d(model, "4xH100", (torch.randint(0, VOCAB, (2, seq)),), measure=False)
    assert plan.mesh.dim_names == ["dp", "cp"] and plan.mesh.shape == [2, 2]
    assert plan.context_parallel.degree == 2
    why = plan.context_parallel.why
    assert why.startswith("cp 2 x dp 2: step") and "cp 4 x dp 1" in why and "pp " in why
    attention = next(l for l in plan.layers if l.strategy.startswith("context_parallel"))
    assert "activation traffic" in attention.reason
    assert "cp 2 x dp 2" in plan.explain()
    # handed to torchtitan as its context_parallel_degree beside the weights' majority
    exported = to_torchtitan(plan)
    assert exported.job.cp == 2 and exported.job.dp == 2
    assert "context_parallel_degree = 2" in exported.text


def test_a_pinned_search_offers_no_cp_shape(graph_cluster):
    graph, cluster = graph_cluster
    result = search(graph, cluster, "adam", None, pin={"lm_head": "data_parallel"},
                    search_time_s=None)
    assert all(c.shape.cp == 1 for c in result.candidates)
    free = search(graph, cluster, "adam", None, search_time_s=None)
    assert {c.shape.cp for c in free.candidates} == {1, 2, 4}
