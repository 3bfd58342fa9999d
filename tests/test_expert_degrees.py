"""Expert parallelism carved out of a shape's data-parallel ranks (planner.expert_degrees):
its options are what the catalog prices over the wider group, and the search's pick among
an experts layer's options equals brute force over them."""

import time

import pytest

from moe_zoo import MOE_ZOO
from planner.expert_degrees import sharing
from planner.plan3d import plan_3d
from planner.profiled import profiled_graph
from planner.search import CostCache, Shape, build
from strategies.catalog import compute_s
from strategies.experts import ExpertParallel
from strategies.parse import parse_devices


def _graph(name: str, devices: str):
    inputs, kwargs = MOE_ZOO[name].example()
    return profiled_graph(MOE_ZOO[name].make(), parse_devices(devices), inputs, kwargs, (),
                          False, "auto")


def _experts_index(built) -> int:
    return next(i for i, names in enumerate(built.problem.layers)
                if any(n.startswith("expert_parallel") for n in names.strategies))


@pytest.mark.parametrize("name", ["fx_moe", "qwen3_moe"])
def test_carved_options_are_the_catalogs_price_over_the_wider_group(name):
    graph, cluster = _graph(name, "8xH100")
    cache = CostCache(graph, cluster, "adam")
    dp, tp = 4, 1
    built = build(cache, 1, dp, tp, graph.batch_size // dp)
    i = _experts_index(built)
    names = built.problem.layers[i].strategies
    assert {"expert_parallel:ep2", "expert_parallel:ep2+fsdp", "expert_parallel:ep4"} <= set(names)
    whole = graph.layers[i].param_bytes
    for c, option in enumerate(names):
        if not option.startswith("expert_parallel:"):
            continue
        k = int(option.split(":ep")[1].split("+")[0])
        price = built.prices[i][c]
        # 1/K of the experts, or 1/(dp·tp) of them sharded over the ranks that share them
        held = whole / k / (dp * tp // k if option.endswith("+fsdp") else 1)
        assert price.local_param_bytes == pytest.approx(held)
        assert sharing(option, dp, tp) == (dp * tp // k, k)
        # the catalog's ExpertParallel over the K ranks holding the K/tp replicas' rows
        rows = graph.batch_size // dp
        wide = cache.layer(graph.layers[i], k, rows * k // tp)
        assert price.cost == ExpertParallel(ep=k).cost(wide.layer, wide.ctx)
        # ... whose rank computes its own rows over its own experts: what a tp rank of
        # this replica computes of the layer, with the weights' share of 1/K
        per_rank = compute_s(wide.layer, 1 / k, wide.ctx, split="shard")
        assert price.cost.compute_s == pytest.approx(per_rank)
        assert price.cost.notes["ep"] == k


def test_the_search_picks_the_experts_option_brute_force_finds():
    """Every other layer held at the search's pick, each of the experts layers' options
    pinned in turn: none beats the unpinned search's plan on the one shape."""
    graph, cluster = _graph("fx_moe", "4xH100")
    shape = Shape(1, 4, 1, 1, "1F1B")
    started = time.perf_counter()
    free = plan_3d(graph, cluster, "adam", cluster.device.memory_bytes, started, only=[shape],
                   search_time_s=None)
    experts = next(l for l in free.layers if l.name == "experts")
    built = build(CostCache(graph, cluster, "adam"), 1, 4, 1, graph.batch_size // 4)
    names = built.problem.layers[_experts_index(built)].strategies
    assert any(n.startswith("expert_parallel:ep") for n in names)
    pin = {l.name: l.strategy + ("+fsdp" if l.dp_shard else "") for l in free.layers
           if l.name != "experts" and not l.name.startswith("input")}
    steps = {}
    for option in names:
        plan = plan_3d(graph, cluster, "adam", cluster.device.memory_bytes,
                       time.perf_counter(), only=[shape], pin={**pin, "experts": option},
                       search_time_s=None)
        steps[option] = plan.predicted.step_time_s
    best = min(steps.values())
    assert free.predicted.step_time_s == pytest.approx(best, rel=1e-6)
    chosen = experts.strategy + ("+fsdp" if experts.dp_shard else "")
    assert steps[chosen] == pytest.approx(best, rel=1e-6)


def test_a_pinned_ep_degree_is_kept_or_refused_by_name_never_dropped():
    """A pin the search cannot honour on a shape rules that shape out (before, the pin
    was dropped there and the plan ran the experts data parallel); "expert_parallel:ep4"
    on a tp group of 4 is the catalog's EP over that group; one no shape offers is a
    ValueError naming the pin; the export says its EP degree."""
    import planner
    from planner.export.config import express

    entry = MOE_ZOO["fx_moe"]
    inputs, kwargs = entry.example()
    model = entry.make()
    plan = planner.optimize(model, "4xH100", inputs, kwargs, mesh="3d", measure=False,
                            pin={"experts": "expert_parallel:ep4"})
    experts = next(l for l in plan.layers if l.name == "experts")
    k = plan.mesh.size("tp") if experts.strategy == "expert_parallel" else int(
        experts.strategy.split(":ep")[1])
    assert experts.strategy.startswith("expert_parallel") and k == 4
    assert express(plan).job.ep == 4  # handed to torchtitan and Megatron-LM as their EP
    with pytest.raises(ValueError, match="pin: no mesh shape offers .*expert_parallel:ep8"):
        planner.optimize(model, "4xH100", inputs, kwargs, mesh="3d", measure=False,
                         pin={"experts": "expert_parallel:ep8"})
