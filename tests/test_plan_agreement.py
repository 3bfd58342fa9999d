"""All ranks run the same plan. On 2 gloo ranks: ranks handed different plans all raise
PlanMismatch within seconds, instead of deadlocking in their first mismatched collective;
ranks that each call planner.optimize get rank 0's plan, and only rank 0 traces and
measures; an error rank 0 meets while planning is raised on rank 1 as the same error."""

import time

import pytest
import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_pre_hook

import executor
import models
import planner
from distributed import run_ranks
from planner.once import PlanningFailed, from_portable, to_portable
from profiler.trace import TraceError

ROWS = 8


# --- ranks holding different plans ----------------------------------------------------------

def _parallelize_own_plan(rank, world, plans_json):
    plan = planner.Plan.from_json(plans_json[rank])
    started = time.perf_counter()
    try:
        executor.parallelize(models.build("mlp"), plan)
    except executor.PlanMismatch as error:
        return time.perf_counter() - started, str(error)
    return time.perf_counter() - started, None


def test_ranks_with_different_plans_all_raise_plan_mismatch_within_seconds():
    x = models.batch("mlp", ROWS, 0)[0]
    plans = [planner.baseline(models.build("mlp"), "2xcpu", kind, example_inputs=(x,),
                             measure=False)
             for kind in ("ddp", "tensor")]
    digests = [executor.agree.plan_digest(p)[:16] for p in plans]
    assert digests[0] != digests[1]

    started = time.perf_counter()
    results = run_ranks(_parallelize_own_plan, 2, [p.to_json() for p in plans], timeout_s=120)
    wall_s = time.perf_counter() - started

    for rank, (seconds, message) in enumerate(results):
        assert message is not None, f"rank {rank} ran a plan the other rank does not hold"
        assert seconds < 30, f"rank {rank} took {seconds:.1f} s to refuse"
        assert f"rank 0 holds plan {digests[0]}" in message, message
        assert f"rank 1 holds plan {digests[1]}" in message, message
        assert f"this is rank {rank}" in message
        assert "planner.optimize under the process group" in message
        assert "Plan.load the same file" in message
    print(f"\nmismatched plans refused on every rank: per rank {[round(s, 3) for s, _ in results]}"
          f" s in parallelize, {wall_s:.1f} s for the whole 2-process run\n{results[0][1]}")


# --- ranks calling planner.optimize themselves ----------------------------------------------

class Counted(nn.Module):
    """An MLP that counts its own forward calls: tracing calls forward, running it too."""

    def __init__(self):
        super().__init__()
        self.forward_calls = 0
        self.body = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x):
        self.forward_calls += 1
        return self.body(x)


class DataDependent(nn.Module):
    """fx cannot trace Python control flow on tensor values: a TraceError."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 8)

    def forward(self, x):
        return self.fc(x) if x.sum() > 0 else -self.fc(x)


def _error(call) -> tuple[str, str, list[str]] | None:
    try:
        call()
    except Exception as error:
        return type(error).__name__, str(error), getattr(error, "__notes__", [])
    return None


def _plan_on_every_rank(rank, world):
    x = models.batch("mlp", ROWS, 0)[0]
    torch.manual_seed(0)
    model = Counted()
    module_calls = [0]  # every nn.Module call in this process: layer timing runs modules

    def count(module, args):
        module_calls[0] += 1

    hook = register_module_forward_pre_hook(count)
    plan = planner.optimize(model, "2xcpu", example_inputs=(x,))
    hook.remove()
    out = {"plan": plan.to_json(), "forward_calls": model.forward_calls,
           "module_calls": module_calls[0]}
    executor.parallelize(model, plan)  # the agreement check passes: one plan on both ranks

    # rank 0 alone plans: rank 1's model would trace, rank 0's cannot
    failing = DataDependent() if rank == 0 else Counted()
    out["trace_error"] = _error(lambda: planner.optimize(failing, "2xV100",
                                                         example_inputs=(x,), tracer="fx"))
    out["does_not_fit"] = _error(lambda: planner.optimize(
        Counted(), "2xV100", example_inputs=(x,), memory_limit_bytes=1))
    out["planned_after_errors"] = planner.optimize(Counted(), "2xV100",
                                                   example_inputs=(x,)).to_json()
    return out


@pytest.fixture(scope="module")
def planned_on_two_ranks():
    return run_ranks(_plan_on_every_rank, 2, timeout_s=300)


def test_every_rank_gets_rank_0s_plan_and_only_rank_0_measures(planned_on_two_ranks):
    rank0, rank1 = planned_on_two_ranks
    assert rank0["plan"] == rank1["plan"]
    assert rank0["planned_after_errors"] == rank1["planned_after_errors"]
    assert rank0["forward_calls"] > 0 and rank0["module_calls"] > 0  # the observable works
    assert rank1["forward_calls"] == 0 and rank1["module_calls"] == 0


def test_a_planning_error_on_rank_0_is_raised_on_every_rank(planned_on_two_ranks):
    rank0, rank1 = planned_on_two_ranks
    for case, kind in (("trace_error", "TraceError"), ("does_not_fit", "PlanDoesNotFit")):
        assert rank0[case] is not None and rank0[case][0] == kind, rank0[case]
        assert rank1[case][:2] == rank0[case][:2]
        assert any("raised on rank 0 while planning" in n for n in rank1[case][2])
    assert "DataDependent" in rank1["trace_error"][1]  # rank 0's model, not rank 1's


def test_an_error_that_does_not_pickle_arrives_as_its_type_name_and_message():
    class Unpicklable(ValueError):  # a local class: pickle cannot find it by name
        pass

    error = from_portable(to_portable(Unpicklable("the solver said no")))
    assert isinstance(error, PlanningFailed)
    assert "Unpicklable: the solver said no" in str(error)
    rebuilt = from_portable(to_portable(TraceError("module 'fc' (Linear): cannot trace")))
    assert type(rebuilt) is TraceError and str(rebuilt) == "module 'fc' (Linear): cannot trace"


# --- one rank planning alone ----------------------------------------------------------------

def _rank_0_plans_alone(rank, world, path):
    """The torchrun habit: rank 0 plans and saves, the others wait for the file."""
    import os
    x = models.batch("mlp", ROWS, 0)[0]
    started = time.perf_counter()
    if rank == 0:
        plan = planner.optimize(Counted(), "2xV100", example_inputs=(x,))
        planner.baseline(Counted(), "2xV100", "ddp", example_inputs=(x,))
        plan.save(path)
    else:
        while not os.path.exists(path):
            time.sleep(0.05)
        plan = planner.Plan.load(path)
    return time.perf_counter() - started, plan.to_json()


def test_rank_0_planning_alone_plans_alone_and_the_others_read_its_file(tmp_path):
    results = run_ranks(_rank_0_plans_alone, 2, str(tmp_path / "plan.json"), timeout_s=120)
    (seconds0, plan0), (seconds1, plan1) = results
    assert plan0 == plan1
    assert seconds0 < 30, f"rank 0 took {seconds0:.1f} s to plan a 3-layer MLP alone"
    print(f"\nrank 0 planned alone (optimize + baseline) in {seconds0:.2f} s")


def _rank_1_asks_alone(rank, world):
    import planner.once
    planner.once.ARRIVAL_WAIT_S = 2.0
    x = models.batch("mlp", ROWS, 0)[0]
    started = time.perf_counter()
    error = None
    if rank == 1:
        error = _error(lambda: planner.optimize(Counted(), "2xV100", example_inputs=(x,)))
    return time.perf_counter() - started, error


def test_a_rank_whose_rank_0_never_plans_raises_naming_the_fix():
    _, (seconds, error) = run_ranks(_rank_1_asks_alone, 2, timeout_s=120)
    assert error is not None and error[0] == "RankZeroDidNotPlan", error
    assert "rank 0 did not start planning within 2 s" in error[1]
    assert "on every rank" in error[1] and "Plan.load" in error[1]
    assert seconds < 10
