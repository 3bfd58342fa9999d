"""Conformance: every plan kind hyplan offers for models no one here wrote (tests/zoo.py)
trains exactly like one process: 2 gloo ranks, 3 SGD steps, every parameter equal to the
single-process run on the whole batch (rtol 1e-5). A plan kind the planner cannot offer
for a model is refused up front with a one-line reason, and the refusals are listed here,
so a new refusal (or a lost one) fails the test.

All plans are made first, in this process; then one launch of 2 ranks runs them all
(starting processes is the slow part on this machine), the ranks forked from the fork
server (tests/distributed.py: run again as new interpreters should a forked rank die of a
signal, as three did in November's suites; 46-51 s a launch forked, 58 s spawned, here).
tests/test_experts.py's mixture-of-experts plans run in the same launches (its 2-rank
jobs in the 2-rank one, its ep 2 x dp 2 and 3-D carved-EP plans in the 4-rank one), and
so does tests/test_moe_pricing.py's sparse-routed Llama 4 pipeline (2 ranks); the tests that
check them are here (`test_experts_*`, `test_moe_pricing_*`): a rank's start (its
imports of transformers and each model family) is seconds of this machine.
"""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

import executor
import planner
from distributed import run_ranks
from zoo import ZOO, ZooModel, canonical_names, reference_once, run_once, skeleton, train

KINDS = ("ddp", "fsdp", "tensor", "pipeline", "optimum")
# kind -> models for which the planner refuses it, and a word of the reason it gives
REFUSED = {  # decoder-only causal LMs are cut between blocks (a tied head: a copy per end)
    "pipeline": {**{name: "blocks" for name in ("bert", "albert", "t5", "convnext", "resnet",
                                                "bart", "pegasus", "opt", "swin",
                                                "squeezebert")},
                 "vit": "LM head", "bloom": "before its first block",
                 "gpt2_padded": "token ids alone"},
}
RTOL, ATOL = 1e-5, 1e-6


def entry_of(name: str) -> ZooModel:
    """A model of tests/zoo.py or of tests/torchvision_zoo.py, by name."""
    if name in ZOO:
        return ZOO[name]
    from torchvision_zoo import TORCHVISION_ZOO

    return TORCHVISION_ZOO[name]


def make_plan(name: str, kind: str, devices: str = "2xcpu", model=None) -> planner.Plan:
    """`model`: one instance planned for every kind (traced once: planner.profiled)."""
    entry = entry_of(name)
    inputs, kwargs = entry.example()
    model = model if model is not None else entry.make()
    if kind == "optimum":
        return planner.optimize(model, devices, example_inputs=inputs, example_kwargs=kwargs,
                                optimizer="sgd", measure=False, prefer_standard=0)
    return planner.baseline(model, devices, kind, example_inputs=inputs, example_kwargs=kwargs,
                            optimizer="sgd", measure=False)


def run_plans(rank: int, world: int, jobs: list) -> dict:
    """Each job (model, kind, plan JSON): this rank's parameters after 3 steps, or the
    error it raised (as text, so one failure does not hide the others)."""
    out = {}
    for name, kind, plan_json in jobs:
        entry = entry_of(name)
        plan = planner.Plan.from_json(plan_json)
        try:
            model = executor.parallelize(entry.make(), plan)
            model = train(model, entry, lambda m, b, loss, opt, kw: executor.train_step(
                m, plan, b, loss, opt, forward_kwargs=kw))
            full = executor.full_parameters(model, dict(skeleton(entry).named_parameters()))
            canonical = canonical_names(entry)  # a tied head's copy under the model's name
            out[(name, kind)] = {canonical.get(k, k): v for k, v in full.items()}
        except Exception as error:  # noqa: BLE001 - reported per job by the test
            out[(name, kind)] = f"{type(error).__name__}: {error}"
    return out


def assert_runs_match(jobs: list, results: list) -> None:
    """Every rank of every job ran, and each parameter it holds equals one process's."""
    for name, label, _ in jobs:
        expected = reference_once(entry_of(name))
        for rank, result in enumerate(results):
            got = result[(name, label)]
            assert not isinstance(got, str), f"{name} {label} rank {rank}: {got}"
            for key, value in got.items():
                torch.testing.assert_close(value, expected[key], rtol=RTOL, atol=ATOL,
                                           msg=lambda m: f"{name} {label} rank {rank}, {key}: {m}")


def run_with_experts(rank: int, world: int, jobs: list, moe_jobs: list,
                     calls: tuple = ()) -> tuple[dict, dict, list]:
    """In the same ranks: first each of `calls` (fn, args): fn(rank, world, *args), or the
    error it raised, as text; then `run_plans` of the zoo's jobs; then
    tests/test_experts.py's `run_plans` of its mixture-of-experts jobs (its own models
    and names)."""
    import test_experts

    done = []
    for fn, args in calls:
        try:
            done.append(fn(rank, world, *args))
        except Exception as error:  # noqa: BLE001 - reported by the test that checks it
            done.append(f"{type(error).__name__}: {error}")
    return run_plans(rank, world, jobs), test_experts.run_plans(rank, world, moe_jobs), done


class ZooRuns(NamedTuple):
    """What the zoo's 2-rank launch ran (`zoo_runs`)."""

    plans: dict  # (model, kind) -> its plan
    refusals: dict  # (model, kind) -> the reason the planner refused it
    results: list  # each rank's run_plans of the plans and the random plans
    models: dict  # model -> the instance planned (traced once: planner.profiled)
    experts: tuple  # tests/test_experts.py's (plans, refusals, each rank's results)
    expert_models: dict  # model -> the instance test_experts planned
    random_experts: dict  # test_experts' random plans, run in the same launch
    sparse_llama4: tuple  # test_moe_pricing's (plan, or the error planning raised; ranks')


@pytest.fixture(scope="module")
def zoo_runs() -> ZooRuns:
    """The zoo's plans (every model x KINDS) and what they ran, with tests/test_experts.py's
    plans of every mixture-of-experts model x its kinds and tests/test_moe_pricing.py's
    sparse-routed Llama 4 pipeline: one launch of 2 ranks runs all of them and the random
    plans (a rank's start is seconds of this machine)."""
    import test_experts
    import test_moe_pricing

    moe_plans, moe_refusals, moe_models = test_experts.plan_every_kind()
    # the zoo's models tests/moe_zoo.py lists too, the same entry (Mixtral): test_experts
    # plans them with the same calls in its kinds (KINDS and "ep"), so their plans and runs
    # (the same 3 steps on the same 2 ranks) serve both files' checks, instead of a second
    # trace (~5-15 s a Hugging Face model here), plans and runs of the same jobs
    shared = {name for name in ZOO if test_experts.MOE_ZOO.get(name) is ZOO[name]}
    plans, refusals, models = {}, {}, {}
    for name in ZOO:
        if name in shared:
            models[name] = moe_models[name]
            plans.update({(name, kind): moe_plans[(name, kind)] for kind in KINDS
                          if (name, kind) in moe_plans})
            refusals.update({(name, kind): moe_refusals[(name, kind)] for kind in KINDS
                             if (name, kind) in moe_refusals})
            continue
        # kept: the 4-rank test plans the same instances (traced once: planner.profiled)
        model = models[name] = ZOO[name].make()
        for kind in KINDS:
            try:
                plans[(name, kind)] = make_plan(name, kind, model=model)
            except ValueError as error:
                refusals[(name, kind)] = str(error)
    jobs = [(name, kind, plan.to_json()) for (name, kind), plan in plans.items()
            if name not in shared]
    random_moe = test_experts.plan_random(moe_models)
    moe_jobs = [(name, kind, plan.to_json())
                for (name, kind), plan in {**moe_plans, **random_moe}.items()]
    try:  # tests/test_moe_pricing.py's sparse-routed Llama 4 pipeline
        sparse = test_moe_pricing.plan_sparse_llama4()
        calls = ((test_moe_pricing._pipeline_parameters, (sparse.to_json(),)),)
    except Exception as error:  # noqa: BLE001 - raised by its test, not by every zoo test
        sparse, calls = error, ()
    # a plan the same as another of its model's runs once (zoo.run_once): on 2 ranks the
    # optimum is the DDP plan of every model here but the torch encoder, 118 runs of 143
    jobs, same = run_once(jobs + _random_jobs(models))
    moe_jobs, moe_same = run_once(moe_jobs)
    ranks = run_ranks(run_with_experts, 2, jobs, moe_jobs, calls)
    for zoo, moe, _ in ranks:
        zoo.update({key: zoo[twin] for key, twin in same.items()})
        moe.update({key: moe[twin] for key, twin in moe_same.items()})
        # the shared models' runs, under the zoo's kinds
        zoo.update({key: moe[key] for key in plans if key[0] in shared})
    return ZooRuns(plans, refusals, [zoo for zoo, _, _ in ranks], models,
                   (moe_plans, moe_refusals, [moe for _, moe, _ in ranks]), moe_models,
                   random_moe,
                   (sparse, [done[0] if done else None for _, _, done in ranks]))


def _random_jobs(models: dict) -> list:
    """A few random feasible plans (tests/random_plans.py: the real integer program under a
    random objective) of models with tied and bare parameters, run in the same launch as
    the kinds (a launch costs seconds here); benchmarks/random_plans.py draws
    hundreds. `models`: the fixture's instances of them (traced once: planner.profiled)."""
    from random_plans import random_plans

    jobs = []
    for name in RANDOM_MODELS:
        entry = ZOO[name]
        inputs, kwargs = entry.example()
        plans = random_plans(models[name], "2xcpu", inputs, 3, seed=1, kwargs=kwargs)
        jobs += [(name, f"random {i}", plan.to_json()) for i, plan in enumerate(plans)]
    return jobs


RANDOM_MODELS = ("gpt2", "vit", "albert")


def refused_as_listed(name: str, kind: str, refusals: dict, refused: dict) -> bool:
    """Whether `kind` is refused for `name`, as `refused` ({kind: {model: a word of the
    reason}}) says it must be, in one line; a refusal it does not list fails."""
    refused_word = refused.get(kind, {}).get(name)
    if refused_word is not None:
        assert (name, kind) in refusals, f"{kind} is no longer refused for {name}: update REFUSED"
        reason = refusals[(name, kind)]
        assert refused_word in reason and "\n" not in reason, reason
        return True
    assert (name, kind) not in refusals, refusals.get((name, kind))
    return False


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("name", list(ZOO))
def test_plan_trains_like_one_process(zoo_runs, name, kind):
    plans, refusals, results, *_ = zoo_runs
    if refused_as_listed(name, kind, refusals, REFUSED):
        return
    expected = reference_once(ZOO[name])
    seen: set[str] = set()
    for rank, result in enumerate(results):
        got = result[(name, kind)]
        assert not isinstance(got, str), f"rank {rank}: {got}"
        assert set(got) <= set(expected), set(got) - set(expected)
        seen |= set(got)
        for key, value in got.items():
            torch.testing.assert_close(value, expected[key], rtol=RTOL, atol=ATOL,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
    assert seen == set(expected), f"no rank holds {sorted(set(expected) - seen)}"


FOUR_RANKS = [("gpt2", "tensor"), ("gpt2", "optimum"), ("bert", "fsdp"), ("vit", "tensor"),
              ("resnet", "ddp"), ("t5", "tensor")]


@pytest.fixture(scope="module")
def four_rank_runs(zoo_runs):
    """FOUR_RANKS's jobs and each rank's results, and tests/test_experts.py's ep 2 x dp 2
    (plans, pins, results), its random plans and its 3-D plans with the EP group carved
    out of a stage's dp x tp ranks (plans, refusals, results): one launch of 4 ranks runs
    them all (a rank's start is seconds of this machine)."""
    import test_experts

    made = zoo_runs.models
    jobs = [(name, kind, make_plan(name, kind, "4xcpu", made[name]).to_json())
            for name, kind in FOUR_RANKS]
    ep_plans, pins = test_experts.plan_ep2_x_dp2(zoo_runs.expert_models)
    random_ep = test_experts.plan_random(zoo_runs.expert_models, "4xcpu", count=2,
                                         names=test_experts.RANDOM_EP_4)
    carved, not_planned = test_experts.plan_carved_3d(zoo_runs.expert_models)
    ep_jobs = [(name, kind, plan.to_json())
               for (name, kind), plan in {**ep_plans, **random_ep, **carved}.items()]
    (run, same), (ep_run, ep_same) = run_once(jobs), run_once(ep_jobs)
    ranks = run_ranks(run_with_experts, 4, run, ep_run)
    for zoo, moe, _ in ranks:
        zoo.update({key: zoo[twin] for key, twin in same.items()})
        moe.update({key: moe[twin] for key, twin in ep_same.items()})
    moe = [moe for _, moe, _ in ranks]
    return (jobs, [zoo for zoo, _, _ in ranks], (ep_plans, pins, moe), (random_ep, moe),
            (carved, not_planned, moe))


def test_four_ranks_train_like_one_process(four_rank_runs):
    """Where the split matters (a row per rank; tensor-parallel shards of a quarter; tied
    embeddings and a BatchNorm over 4 ranks), the same plans on 4 gloo ranks (of the
    models the fixture traced: a Hugging Face model's torch.export trace is ~2 s)."""
    jobs, results, *_ = four_rank_runs
    assert_runs_match(jobs, results)


def test_experts_every_plan_kind_trains_like_one_process(zoo_runs):
    """tests/test_experts.py's: every mixture-of-experts model in every plan kind, expert
    parallelism among them, trains like one process on 2 ranks (or is refused as its
    REFUSED says); run in the zoo's launch, so it is here."""
    import test_experts

    test_experts.assert_every_kind_trains_like_one_process(*zoo_runs.experts)


def test_experts_ep2_x_dp2_replicated_or_fsdp_sharded_trains_like_one_process(four_rank_runs):
    """tests/test_experts.py's: the EP group carved out of 4 data-parallel ranks (ep 2 x
    dp 2), experts replicated or FSDP2-sharded over the dp ranks, trains like one process;
    run in the zoo's 4-rank launch, so it is here."""
    import test_experts

    test_experts.assert_ep2_x_dp2_trains_like_one_process(*four_rank_runs[2])


def test_experts_3d_ep_carved_out_of_a_stages_dp_ranks_trains_like_one_process(four_rank_runs):
    """tests/test_experts.py's: 3-D plans whose experts run expert parallel over K = tp·e
    consecutive ranks of their stage (ep 2 and ep 4 on 1 x 4 x 1, replicated or FSDP2-
    sharded over the ranks holding the same experts; ep 4 on 1 x 2 x 2; ep 2 in a 2 x 2
    x 1 pipeline), from the search with the experts pinned, train like one process; run
    in the zoo's 4-rank launch, so it is here."""
    import test_experts

    test_experts.assert_carved_3d_trains_like_one_process(*four_rank_runs[4])


def test_experts_random_plans_with_expert_parallelism_train_like_one_process(zoo_runs,
                                                                            four_rank_runs):
    """tests/test_experts.py's: random feasible plans of the mixture-of-experts models, ep
    over every rank among them (2 ranks) and ep 2 carved out of dp (4 ranks), train like
    one process; run in the zoo's launches, so it is here."""
    import test_experts

    test_experts.assert_random_plans_train_like_one_process(
        zoo_runs.random_experts, zoo_runs.experts[2])
    test_experts.assert_random_plans_train_like_one_process(*four_rank_runs[3])


def test_moe_pricing_sparse_routed_llama4_plans_a_pipeline_and_trains_like_one_process(zoo_runs):
    """tests/test_moe_pricing.py's: the sparse-routed Llama 4's pipeline baseline plans two
    stages on 2 ranks and trains like one process; run in the zoo's launch, so it is here."""
    import test_moe_pricing

    plan, results = zoo_runs.sparse_llama4
    if isinstance(plan, Exception):
        raise plan
    test_moe_pricing.assert_sparse_llama4_trains_like_one_process(plan, results)


def test_random_plans_from_the_planners_options_train_like_one_process(zoo_runs):
    """The random plans of `_random_jobs`, run in the zoo's launch."""
    _, _, results, *_ = zoo_runs
    jobs = [key for key in results[0] if key[1].startswith("random")]
    assert {name for name, _ in jobs} == set(RANDOM_MODELS)
    assert_runs_match([(name, label, None) for name, label in jobs], results)


@pytest.mark.parametrize("where", [None, "cpu", "meta"])
def test_models_built_anywhere_trace_and_count_a_tied_parameter_once(where):
    """A model built plainly, or under `with torch.device("cpu" | "meta")`, plans alike; a
    tied embedding is one parameter: counted once, read by two layers, one strategy. (A
    model moved with .to("meta") afterwards is another model: torch unties its weights.)"""
    import transformers

    entry = ZOO["gpt2"]
    if where is None:
        model = entry.make()
    else:
        with torch.device(where):
            model = entry.make()
    plan = planner.optimize(model, "2xcpu", example_inputs=entry.batch(0)[:1], measure=False)
    unique = sum(p.numel() * p.element_size() for p in model.parameters())
    assert sum(l.param_bytes for l in plan.layers) == unique
    readers = [l for l in plan.layers if "transformer.wte.weight" in l.params]
    assert {l.name for l in readers} == {"transformer.wte", "lm_head"}
    assert len({l.strategy for l in readers}) == 1
    assert isinstance(model, transformers.GPT2LMHeadModel)


def test_a_model_that_computes_its_loss_from_labels_is_refused_with_the_fix():
    entry = ZOO["llama"]
    ids, targets = entry.batch(0)
    refusal = r"loss inside forward from example_kwargs\['labels'\].*loss_fn"
    with pytest.raises(ValueError, match=refusal):
        planner.baseline(entry.make(), "2xcpu", "ddp", example_inputs=(ids,),
                         example_kwargs={"labels": targets}, measure=False)
