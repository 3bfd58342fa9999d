"""Mixture-of-experts models (tests/moe_zoo.py) plan and train like one process in every
plan kind, expert parallelism among them: 2 gloo ranks, 3 SGD steps, every parameter
equal to the single-process run on the whole batch (rtol 1e-5, as tests/test_zoo.py).

The experts modules are found by their shape and kept whole (profiler.export_trace); the
routing ops between modules keep rows (strategies.rowwise); expert parallelism splits the
experts and moves tokens by all-to-all (strategies.experts, executor.experts). All plans
are made first, in this process; one launch of 2 ranks runs them all, and one of 4
the ep 2 x dp 2 plans and the 3-D plans whose EP group is carved out of a stage's dp x tp
ranks (executor.experts.apply_carved): tests/test_zoo.py's launches, where the tests that
check these plans are (`test_experts_*`), so that a rank's start (seconds of this
machine: transformers and each model family imported) is paid once for the zoo's jobs and
these.
"""

from __future__ import annotations

import time

import pytest
import torch
from torch import nn

import executor
import planner
from moe_zoo import MOE_ZOO, ROUTED, StackedExperts
from test_zoo import refused_as_listed
from planner.profiled import trace_model
from strategies.catalog import CostContext
from strategies.collectives import all_to_all_s
from strategies.parse import parse_devices
from strategies.experts import ExpertParallel
from strategies.rowwise import keeps_rows
from zoo import reference_once, train

KINDS = ("ddp", "fsdp", "tensor", "pipeline", "optimum", "ep")
# kind -> models for which the planner refuses it, and a word of the reason it gives
REFUSED = {
    "pipeline": {},
    # Llama 4's experts take every token once per expert (dense routing): none to dispatch
    "ep": {"llama4": "none that split"},
}
RTOL, ATOL = 1e-5, 1e-6
BATCH = 4


# --- the routing ops between modules --------------------------------------------------


class Routing(nn.Module):
    """DeepSeek-V3's routing and attention writes, and their row-mixing twins."""

    def forward(self, q, pe, scores, positions):
        q = q.clone()
        q[..., 4:] = pe  # copy_ into a slice of a tensor with the same rows
        groups = scores.unflatten(-1, (2, 2)).amax(-1)
        mask = torch.zeros_like(groups).scatter_(-1, groups.topk(1, dim=-1)[1], 1)
        across = torch.zeros_like(groups).scatter_(0, groups.topk(1, dim=0)[1], 1)
        top = scores.topk(2, dim=-1)[0]
        top /= top.sum(-1, keepdim=True) + 1e-20  # div_ in place
        chunk = torch.floor_divide(positions, 4)
        return q, mask + across, top, chunk


def test_routing_ops_between_modules_keep_rows_and_their_row_mixing_twins_do_not():
    args = (torch.randn(BATCH, 8, 8), torch.randn(BATCH, 8, 4), torch.randn(BATCH, 8, 4),
            torch.arange(8).repeat(BATCH, 1))
    graph = trace_model(Routing(), args, tracer="export")
    by_kind: dict[str, list[bool]] = {}
    for layer in graph.layers:
        if layer.op == "call_function":
            by_kind.setdefault(layer.kind, []).append(keeps_rows(layer, BATCH))
    assert by_kind["copy_"] == [True]
    assert by_kind["scatter_"] == [True, False]  # along the scores; along the rows
    assert by_kind["div_"] == [True]
    assert by_kind["floor_divide"] == [True]


# --- experts found by shape, priced -----------------------------------------------------


def test_experts_modules_are_found_by_their_shape():
    from profiler.export_trace import experts_units

    for name in ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"):
        routed, blocks = experts_units(MOE_ZOO[name].make())
        assert [t.__name__ for t in routed] == [t.__name__ for t in routed if
                                                 t.__name__.endswith("Experts")] and routed
        assert blocks == ()
    routed, blocks = experts_units(MOE_ZOO["llama4"].make())
    assert routed == () and [t.__name__ for t in blocks] == ["Llama4TextMoe"]
    # stacked weights alone are not experts: an embedding's 2-D table, a conv's 4-D kernel
    assert experts_units(nn.Sequential(nn.Embedding(8, 4), nn.Conv2d(2, 2, 3))) == ((), ())


def test_expert_parallel_price_is_its_share_of_the_work_and_four_all_to_alls():
    entry = MOE_ZOO["mixtral"]
    inputs, kwargs = entry.example()
    graph = trace_model(entry.make(), inputs, kwargs, tracer="export")
    layer = next(l for l in graph.layers if l.name == "model.layers.0.mlp.experts")
    assert (layer.attrs["experts"], layer.attrs["top_k"]) == (4, 2)
    cluster = parse_devices("8xH100")
    ctx = CostContext(cluster, 8, graph.batch_size, "adam")
    assert not ExpertParallel().applies(layer, ctx)  # 4 experts do not split over 8
    ctx = CostContext(cluster, 2, graph.batch_size, "adam")
    cost = ExpertParallel().cost(layer, ctx)
    dispatched = layer.output.nbytes * 2  # every (token, expert) pair, hidden-sized
    assert cost.notes["dispatched_bytes"] == dispatched
    tokens = layer.output.shape[0]
    assert cost.communication_s == pytest.approx(
        4 * all_to_all_s(dispatched, 2, ctx.link) + all_to_all_s(tokens * 2 * 8, 2, ctx.link)
        + all_to_all_s(8 * 4, 2, ctx.link))
    data_parallel = next(s for s in planner_candidates(layer, ctx) if s.name == "data_parallel")
    assert cost.compute_s == pytest.approx(data_parallel.cost(layer, ctx).compute_s)
    assert cost.memory_bytes < data_parallel.cost(layer, ctx).memory_bytes


def planner_candidates(layer, ctx):
    from strategies.catalog import candidates

    return candidates(layer, ctx)


def test_ep_baseline_refuses_a_model_without_experts():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    with pytest.raises(ValueError, match="'ep' splits experts modules"):
        planner.baseline(model, "2xcpu", "ep", (torch.randn(4, 8),), measure=False)


# --- every plan kind trains like one process ----------------------------------------------


def make_plan(name: str, kind: str, model) -> planner.Plan:
    inputs, kwargs = MOE_ZOO[name].example()
    if kind == "optimum":
        return planner.optimize(model, "2xcpu", example_inputs=inputs, example_kwargs=kwargs,
                                optimizer="sgd", measure=False, prefer_standard=0)
    return planner.baseline(model, "2xcpu", kind, example_inputs=inputs, example_kwargs=kwargs,
                            optimizer="sgd", measure=False)


def run_plans(rank: int, world: int, jobs: list) -> dict:
    """Each job (model, kind, plan JSON): this rank's parameters after 3 steps, or the
    error it raised (as text, so one failure does not hide the others)."""
    out = {}
    for name, kind, plan_json in jobs:
        entry = MOE_ZOO[name]
        plan = planner.Plan.from_json(plan_json)
        try:
            model = executor.parallelize(entry.make(), plan)
            model = train(model, entry, lambda m, b, loss, opt, kw: executor.train_step(
                m, plan, b, loss, opt, forward_kwargs=kw))
            out[(name, kind)] = executor.full_parameters(
                model, dict(entry.make().named_parameters()))
        except Exception as error:  # noqa: BLE001 - reported per job by the test
            out[(name, kind)] = f"{type(error).__name__}: {error}"
    return out


def plan_every_kind() -> tuple[dict, dict, dict]:
    """(model, kind) -> its 2-rank plan, and -> the reason it is refused: every model of
    MOE_ZOO in every kind, planned in this process for one launch of 2 ranks
    (`run_plans`); and the instances planned (traced once: planner.profiled), for
    `plan_ep2_x_dp2`. The launch is tests/test_zoo.py's: its zoo's jobs and these run in
    the same ranks (a rank started fresh costs ~5 s of this machine), and the test that
    checks them (`assert_every_kind_trains_like_one_process`) is there."""
    plans, refusals, models = {}, {}, {}
    for name in MOE_ZOO:
        model = models[name] = MOE_ZOO[name].make()
        for kind in KINDS:
            try:
                plans[(name, kind)] = make_plan(name, kind, model)
            except ValueError as error:
                refusals[(name, kind)] = str(error)
    return plans, refusals, models


def assert_every_kind_trains_like_one_process(plans: dict, refusals: dict, results: list) -> None:
    """Each (model, kind) is refused as REFUSED says, or every parameter on every rank
    after 3 steps (`results`: each rank's `run_plans` of every plan) equals one process's.
    One check for all of them, as one test: each failure listed."""
    failures = []
    for name in MOE_ZOO:
        expected = reference_once(MOE_ZOO[name])
        for kind in KINDS:
            try:
                check_kind(name, kind, plans, refusals, results, expected)
            except AssertionError as error:
                failures.append(f"{name} {kind}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def check_kind(name, kind, plans, refusals, results, expected) -> None:
    """`kind` is refused for `name` as REFUSED says, or its every parameter on every rank
    equals one process's."""
    if refused_as_listed(name, kind, refusals, REFUSED):
        return
    if kind == "ep":
        assert name in ROUTED
        assert any(l.strategy == "expert_parallel" for l in plans[(name, kind)].layers)
    seen: set[str] = set()
    for rank, result in enumerate(results):
        got = result[(name, kind)]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        seen |= set(got)
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected), f"no rank holds {sorted(set(expected) - seen)}"


# --- ep 2 x dp 2 on 4 ranks: experts replicated, or FSDP-sharded, over the dp ranks ------

EP_DP = ("mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss")
CARVED = ("expert_parallel:ep2", "expert_parallel:ep2:fsdp")


def experts_paths(model: nn.Module) -> list[str]:
    from profiler.export_trace import experts_units

    routed, _ = experts_units(model)
    return [name for name, m in model.named_modules() if isinstance(m, routed)]


def carved_pins(family: int, model: nn.Module) -> dict[str, str]:
    """Each experts module of the `family`-th model on ep 2 x dp 2, replicated and
    FSDP-sharded over dp in turn (DeepSeek-V3's one MoE layer sharded), so one plan per
    family runs both."""
    return {path: CARVED[(i + family) % 2] for i, path in enumerate(experts_paths(model))}


def plan_ep2_x_dp2(models: dict | None = None) -> tuple[dict, dict]:
    """The EP group carved out of 4 data-parallel ranks (ep 2 x dp 2): each expert on the
    2 ranks of a dp group, its gradient summed over them, or FSDP2-sharded over them; the
    experts modules pinned, the rest solved. (model, "ep2xdp2") -> its 4-rank plan, and
    model -> its pins, for one launch of 4 ranks that runs every family: tests/test_zoo.py's
    4-rank launch, beside the zoo's 4-rank plans (`assert_ep2_x_dp2_trains_like_one_process`
    checks them there). `models`: instances `plan_every_kind` planned, planned again here
    (their traces kept: a Hugging Face model's torch.export trace is ~1-2 s); fresh ones
    where not given."""
    plans, pins = {}, {}
    for family, name in enumerate(EP_DP):
        entry = MOE_ZOO[name]
        model = models[name] if models else entry.make()
        inputs, kwargs = entry.example()
        pins[name] = carved_pins(family, model)
        plans[(name, "ep2xdp2")] = planner.optimize(
            model, "4xcpu", example_inputs=inputs, example_kwargs=kwargs, optimizer="sgd",
            measure=False, pin=pins[name])
    assert {s for pin in pins.values() for s in pin.values()} == set(CARVED)
    return plans, pins


def assert_ep2_x_dp2_trains_like_one_process(plans: dict, pins: dict, results: list) -> None:
    """Each plan keeps its pins, and every parameter on every one of the 4 ranks
    (`results`: each rank's `run_plans` of the plans) equals one process's."""
    failures = []
    for name in EP_DP:
        got = {l.name: l.strategy for l in plans[(name, "ep2xdp2")].layers if l.name in pins[name]}
        assert got == pins[name]
        try:
            check_kind(name, "ep2xdp2", plans, {}, results,
                       reference_once(MOE_ZOO[name]))
        except AssertionError as error:
            failures.append(f"{name}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


# --- random plans with expert parallelism ---------------------------------------------

RANDOM_EP = ("qwen3_moe", "deepseek_v3", "gpt_oss", "fx_moe")
# on 4 ranks, the two whose first two draws carve ep 2 out of dp (a launch of 4 is dear)
RANDOM_EP_4 = ("qwen3_moe", "gpt_oss")


def plan_random(models: dict, devices: str = "2xcpu", count: int = 3,
                names: tuple[str, ...] = RANDOM_EP) -> dict:
    """(model, "random i") -> a random feasible plan (tests/random_plans.py: the real
    integer program under a random objective) of each RANDOM_EP model on `devices`; the
    seed is fixed so that expert parallelism is among them (ep over every rank and, on 4
    ranks, ep 2 carved out of dp). `models`: instances `plan_every_kind` traced."""
    from random_plans import random_plans

    plans = {}
    for name in names:
        inputs, kwargs = MOE_ZOO[name].example()
        drawn = random_plans(models[name], devices, inputs, count, seed=1, kwargs=kwargs)
        plans.update({(name, f"random {i}"): plan for i, plan in enumerate(drawn)})
    return plans


def assert_random_plans_train_like_one_process(plans: dict, results: list) -> None:
    """Every random plan (`plan_random`) trains like one process, and expert parallelism
    was drawn in some of them."""
    experts = {s for plan in plans.values() for l in plan.layers
               if (s := l.strategy).startswith("expert_parallel")}
    assert experts, "no random plan drew expert parallelism: change the seed"
    failures = []
    for name, kind in plans:
        try:
            check_kind(name, kind, plans, {}, results, reference_once(MOE_ZOO[name]))
        except AssertionError as error:
            failures.append(f"{name} {kind}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


# --- 3-D plans: the EP group carved out of the stage's dp x tp ranks ---------------------

# (pp, dp, tp), the experts layers' option: ep over tp·e consecutive ranks of the stage
# (planner.expert_degrees), its experts replicated over the dp·tp/K ranks holding the
# same ones or FSDP2-sharded over them; ep over the whole stage; a pipeline
CARVED_3D = (((1, 4, 1), "expert_parallel:ep2"), ((1, 4, 1), "expert_parallel:ep2+fsdp"),
             ((1, 4, 1), "expert_parallel:ep4"), ((1, 2, 2), "expert_parallel:ep4"),
             ((2, 2, 1), "expert_parallel:ep2"))
CARVED_3D_MODELS = ("qwen3_moe", "fx_moe")
# a torch.export graph runs tp > 1 only with each microbatch's rows whole on every tp
# rank (planner.search.tp_whole_rows), rows no EP group can split: the search offers none
NOT_PLANNED_3D = {("qwen3_moe", (1, 2, 2))}


def plan_carved_3d(models: dict) -> tuple[dict, dict]:
    """(model, "3d pp x dp x tp option") -> its 4-rank plan from the 3-D search restricted
    to that one shape (a microbatch per pipeline rank, 1F1B), its experts layers pinned to
    the option and the rest solved, as planner.price_job pins a job's; and (model, shape)
    -> why the search found none. For tests/test_zoo.py's 4-rank launch, where
    `assert_carved_3d_trains_like_one_process` checks them. `models`: instances
    `plan_every_kind` traced (traced once: planner.profiled)."""
    from planner.plan3d import plan_3d
    from planner.profiled import PlanDoesNotFit, profiled_graph
    from planner.search import Shape

    plans, refusals = {}, {}
    for name in CARVED_3D_MODELS:
        inputs, kwargs = MOE_ZOO[name].example()
        graph, cluster = profiled_graph(models[name], "4xcpu", inputs, kwargs, measure=False)
        experts = experts_paths(models[name])
        for (pp, dp, tp), option in CARVED_3D:
            shape = Shape(pp, dp, tp, microbatches=pp, schedule="1F1B")
            try:
                plans[(name, carved_label((pp, dp, tp), option))] = plan_3d(
                    graph, cluster, "sgd", cluster.device.memory_bytes, time.perf_counter(),
                    only=[shape], pin=dict.fromkeys(experts, option), search_time_s=10)
            except PlanDoesNotFit as error:
                refusals[(name, (pp, dp, tp))] = str(error)
    return plans, refusals


def carved_label(shape: tuple[int, int, int], option: str) -> str:
    """The job's kind in the launch's results: its shape and option, unique per model."""
    return "3d {}x{}x{} {}".format(*shape, option)


def assert_carved_3d_trains_like_one_process(plans: dict, refusals: dict, results: list):
    """Each plan is of its shape with its experts layers as pinned (a strategy of that
    degree, sharded over dp where "+fsdp"), the shapes the search cannot plan are those
    NOT_PLANNED_3D lists, and every parameter on every one of the 4 ranks (`results`:
    each rank's `run_plans` of the plans) equals one process's."""
    assert set(refusals) == NOT_PLANNED_3D, refusals
    failures = []
    for name in CARVED_3D_MODELS:
        paths = experts_paths(MOE_ZOO[name].make())
        expected = reference_once(MOE_ZOO[name])
        for shape, option in CARVED_3D:
            if (name, shape) in NOT_PLANNED_3D:
                continue
            kind = carved_label(shape, option)
            plan = plans[(name, kind)]
            strategy, _, shard = option.partition("+")
            experts = [l for l in plan.layers if l.name in paths]
            assert plan.mesh.shape == list(shape) and experts, (name, kind)
            assert {(l.strategy, l.dp_shard) for l in experts} == {(strategy, bool(shard))}
            try:
                check_kind(name, kind, plans, {}, results, expected)
            except AssertionError as error:
                failures.append(f"{name} {kind}: {str(error).splitlines()[0]}")
    assert not failures, "\n".join(failures)


def test_a_carved_ep_group_the_3d_executor_cannot_run_is_refused_by_name_before_any_group():
    """executor.experts.stage_meshes refuses, naming the layer and the fix, a degree that
    does not divide the stage's ranks or the experts, and HSDP of the experts, before it
    makes any process group (no launch needed to see it)."""
    from executor.experts import stage_meshes
    from planner.plan3d import plan_3d
    from planner.profiled import profiled_graph
    from planner.search import Shape

    model = MOE_ZOO["fx_moe"].make()
    inputs, kwargs = MOE_ZOO["fx_moe"].example()
    graph, cluster = profiled_graph(model, "4xcpu", inputs, kwargs, measure=False)
    plan = plan_3d(graph, cluster, "sgd", cluster.device.memory_bytes, time.perf_counter(),
                   only=[Shape(1, 4, 1, 1, "1F1B")], pin={"experts": "expert_parallel:ep2"},
                   search_time_s=10)

    def refusal(experts=model.experts, **change):
        edited = plan.model_copy(update={"layers": [
            l.model_copy(update=change) if l.name == "experts" else l for l in plan.layers]})
        with pytest.raises(ValueError) as error:
            stage_meshes(edited, lambda layer: experts)
        assert "layer 'experts'" in str(error.value) and "re-plan" in str(error.value)
        return str(error.value)

    assert "dp x tp = 4 ranks" in refusal(strategy="expert_parallel:ep3")
    assert "its 6 experts" in refusal(StackedExperts(experts=6), strategy="expert_parallel:ep4")
    assert "'expert_parallel:ep2+fsdp'" in refusal(hsdp=True, dp_shard=True)
