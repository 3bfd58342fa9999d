"""`optimize`: model, example batch and devices in, a Plan out. Nothing runs on the devices.

The flow, one plain function each: trace → profile → candidate strategies and their costs
→ integer program → Plan, with two baselines costed by the same model (pure data
parallelism on the same devices, and one device) so the plan can say what it gains.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import replace

from torch import nn

from planner.baseline import LABELS, ONE_D_KINDS, available, solve_baseline, summarize
from planner.choices import Choices, layer_choices
from planner.context_plan import or_context_parallel
from planner.ilp import solve
from planner.once import plan_once
from planner.pipeline.stage_held import peak_bytes
from planner.pipeline.stages import StageSolution
from planner.plan import Plan
from planner.plan3d import choose_mesh, one_d_plan
from planner.price import step_overhead_s
from planner.problem import Infeasible, Solution
from planner.profiled import GB, PlanDoesNotFit, check_arguments, profiled_graph
from planner.search import DEFAULT_SEARCH_TIME_S, CostCache
from planner.ties import expand, merge_ties
from strategies.cluster import Cluster

# Where the optimum beats the best standard plan by less than this, optimize() keeps the
# standard plan. On this project's CPU fidelity benchmark single plans' predictions err by
# up to 10-30% and plans predicted within 2-4% of each other measured either way round.
PREFER_STANDARD = 0.03


@plan_once
def optimize(
    model: nn.Module,
    devices,
    example_inputs: Sequence | None = None,
    example_kwargs: dict | None = None,
    *,
    optimizer: str = "adam",
    memory_limit_bytes: float | None = None,
    leaf_modules: Iterable[type | str] = (),
    pin: dict[str, str] | None = None,
    measure: bool | None = None,
    time_limit_s: float = 60.0,
    tracer: str = "auto",
    mesh: str = "1d",
    prefer_standard: float = PREFER_STANDARD,
    precision: str | None = None,
    search_time_s: float | None = DEFAULT_SEARCH_TIME_S,
) -> Plan:
    """Choose, layer by layer, how to spread `model` over `devices` for one training step on
    `example_inputs` (their dim 0 is the global batch).

    devices: "8xV100", "2x8xH100" (nodes x devices), "4xcpu", an int (local devices), a
    list of torch devices, or a strategies.Cluster. optimizer: "sgd", "sgd_momentum",
    "adam" or "adamw" (its state counts in memory). memory_limit_bytes: per device, default
    the device's memory. measure: time layers on this machine (default: when the devices
    are this machine's CPU). leaf_modules: module types or paths fx should not trace into.
    pin: {layer name: strategy} to fix some layers' strategies; the rest are optimized.
    tracer: "fx", "export" (torch.export, for models fx cannot follow, such as Hugging Face
    transformers), "auto": fx, and torch.export where fx fails, or "blocks": torch.export
    of three of the model's `config.num_hidden_layers` alike blocks, repeated to all of
    them (profiler.repeat_blocks; the same graph in a fraction of the time, for LLMs).
    mesh: "1d" (one group of all devices, each layer data- or model-parallel), "3d" (search
    pipeline x data x tensor meshes, stage cuts, microbatches and schedules:
    planner.plan3d), or "auto" (both; the 1-D plan unless a 3-D one is predicted at least
    1% faster or the 1-D one does not fit; `Plan.mesh_choice` says which and why).
    The 3-D search ("3d", "auto") offers context parallelism (each sequence split over cp
    ranks, planner.context_degrees) beside pipeline, data and tensor parallelism; under
    "1d", with no pin and fewer sequences in the batch than devices (long context), the
    best context-parallel plan (planner.baseline's "cp") is returned where the 1-D plan
    does not fit (mesh_choice says so).
    prefer_standard: keep the best standard plan (DDP, tensor parallel or FSDP) when it is
    predicted within this fraction of the optimum and fits: a hybrid whose predicted gain
    is below the cost model's own error is a guess, and the standard plan is the one
    people know how to run and debug. 0 always returns the solver's optimum; either way
    `Plan.standard_choice` and explain() give both times. Not applied with `pin`.
    precision: "bf16-mixed", "fp16-mixed" or "fp32" (strategies.precision): priced as the
    executor runs it (compute rate, memory, bytes sent). Default: the Cluster's, else the
    device's usual one (bf16-mixed on A100/H100, fp16-mixed on V100, fp32 on K20 and CPU).
    search_time_s: with mesh "3d" or "auto", the seconds from this call's start after
    which the 3-D search stops (planner.search.DEFAULT_SEARCH_TIME_S by default): the best
    plan found, "optimal" where the search settled every candidate in time, else
    "feasible" with its gap (`Plan.solver.gap`; explain() shows both); a search with no
    plan by then hands back the best quick plan of what is left. None runs the search to
    its end (the proof, which on a 70 B Llama over 256 H100s took about 20 minutes).
    time_limit_s bounds each integer program alone.
    Under an initialized process group, call it on every rank: rank 0 plans and every rank
    returns its plan, or raises its error (planner.once).
    """
    started = time.perf_counter()
    check_arguments(optimizer, example_inputs, memory_limit_bytes)
    if not 0 <= prefer_standard < 1:
        raise ValueError(f"prefer_standard: a fraction in [0, 1), got {prefer_standard}")
    if mesh not in ("1d", "3d", "auto"):
        raise ValueError(f"mesh: {mesh!r} is not one of '1d', '3d', 'auto'")
    graph, cluster = profiled_graph(model, devices, example_inputs, example_kwargs,
                                    leaf_modules, measure, tracer, precision)

    budget = memory_limit_bytes or cluster.device.memory_bytes

    def chosen() -> Plan:
        if mesh == "1d":
            return _plan_1d(graph, cluster, optimizer, budget, pin, time_limit_s, started,
                            prefer_standard)
        return choose_mesh(mesh, graph, cluster, optimizer, budget, started,
                           lambda: _plan_1d(graph, cluster, optimizer, budget, pin,
                                            time_limit_s, started, prefer_standard),
                           pin=pin, time_limit_s=time_limit_s, search_time_s=search_time_s)

    if mesh == "1d" and not pin:  # long context: a context-parallel plan where it must
        return or_context_parallel(chosen, graph, cluster, optimizer, budget, started)
    return chosen()


def _plan_1d(graph, cluster: Cluster, optimizer: str, budget: float, pin, time_limit_s: float,
             started: float, prefer_standard: float = 0.0) -> Plan:
    """The integer program over one mesh dim of all devices, and its baselines, all priced
    from one planner.search.CostCache."""
    cache = CostCache(graph, cluster, optimizer)
    choices = layer_choices(graph, cluster, optimizer, budget, pin=pin, cache=cache)
    solution, staged, peak = _solve_within_memory(choices, budget, time_limit_s, optimizer,
                                                  cluster, graph.outputs)
    dp_choices = layer_choices(graph, cluster, optimizer, None, only={"data_parallel"},
                               cache=cache)
    data_parallel = solve(dp_choices.problem, time_limit_s)
    single = solve(layer_choices(graph, cluster.with_devices(1, 1), optimizer, None).problem,
                   time_limit_s)
    dp = (data_parallel.objective_s + step_overhead_s(cluster),
          dp_choices.problem.memory_of(data_parallel.choice))
    plan = one_d_plan(graph, cluster, optimizer, choices, solution, budget, dp[0],
                      single.objective_s, time.perf_counter() - started, dp[1],
                      staged=(staged, peak))
    if cluster.num_devices == 1:
        return plan
    solved = _baselines(cache, time_limit_s)
    plan = _with_baselines(plan, solved, cluster, budget)
    if pin:
        return plan
    return _prefer_standard(plan, solved, graph, cluster, optimizer, budget, prefer_standard,
                            dp, single.objective_s, started)


def _prefer_standard(plan: Plan, solved: dict, graph, cluster: Cluster, optimizer: str,
                     budget: float, tolerance: float, dp: tuple[float, float],
                     single_s: float, started: float) -> Plan:
    """The optimum, or the fastest standard plan that fits when it is within `tolerance`
    of it (ties at the model's resolution go to the plan people know). `dp`: pure data
    parallelism's (step time, memory per device)."""
    best_s = plan.predicted.step_time_s
    baselines = plan.predicted.baselines
    times = {kind: b.step_time_s for kind, b in baselines.items() if b.fits is not False}
    for kind in sorted(times, key=times.get):
        if times[kind] > best_s * (1 + tolerance):
            break
        choices, solution = solved[kind]
        standard = one_d_plan(graph, cluster, optimizer, choices, solution, budget, dp[0],
                              single_s, time.perf_counter() - started, dp[1])
        if [l.strategy for l in standard.layers] == [l.strategy for l in plan.layers]:
            return plan.model_copy(update={"standard_choice": f"the optimum is the "
                                           f"{LABELS[kind]} plan"})
        gap = times[kind] / best_s - 1
        note = (f"kept the {LABELS[kind]} plan: predicted {times[kind] * 1e3:.4g} ms, "
                f"{gap:.1%} slower than the optimum ({best_s * 1e3:.4g} ms), within the "
                f"{tolerance:.0%} the cost model cannot resolve (prefer_standard=0 keeps "
                f"the optimum)")
        predicted = standard.predicted.model_copy(update={"baselines": baselines})
        return standard.model_copy(update={"predicted": predicted, "standard_choice": note})
    return plan


def _baselines(cache: CostCache, time_limit_s: float) -> dict:
    """{kind: (choices, solution)} of every available 1-D baseline, priced from `cache`."""
    solved = {}
    for kind in available(ONE_D_KINDS):
        try:
            solved[kind] = solve_baseline(cache.graph, cache.cluster, cache.optimizer, kind,
                                          time_limit_s, cache)
        except Infeasible:  # this model has no plan of that kind: nothing to compare
            continue
    return solved


def _with_baselines(plan: Plan, solved: dict, cluster: Cluster, budget: float) -> Plan:
    """The plan, its prediction carrying each baseline's step time, communication and
    memory, and whether it fits `budget`."""
    records = {kind: summarize(choices, solution, cluster, budget)
               for kind, (choices, solution) in solved.items()}
    predicted = plan.predicted.model_copy(update={"baselines": records})
    return plan.model_copy(update={"predicted": predicted})


def _solve_within_memory(choices: Choices, budget: float, time_limit_s: float,
                         optimizer: str, cluster: Cluster, outputs=()
                         ) -> tuple[Solution, StageSolution, list[float]]:
    """The optimum whose memory, as the step holds it (planner.pipeline.stage_held.
    peak_bytes: the per-layer sum the integer program sees and what the step holds beside
    it), fits the budget, with it as the one stage and that peak (which one_d_plan reads
    rather than compute again). The second part depends on the assignment (DDP's buckets,
    the largest FSDP layer), so where a solution's exceeds what the program left, the
    program is solved again with the budget lowered by it: a plan never promises to fit
    what does not."""
    problem = choices.problem
    try:
        for _ in range(4):
            solution = solve(problem, time_limit_s)
            staged, peak = _staged_peak(choices, solution, cluster, optimizer, outputs)
            if peak[0] <= budget:
                return solution, staged, peak
            held = peak[0] - problem.memory_of(solution.choice)
            problem = replace(problem, memory_budget_bytes=budget - held)
        raise Infeasible("the step's buffers leave no assignment within memory",
                         family="memory")
    except Infeasible as error:
        if error.family != "memory":
            raise
        need = least_need_bytes(choices, cluster, optimizer, outputs)
        raise PlanDoesNotFit(
            f"plan does not fit: needs at least {need / GB:.1f} GB on each of "
            f"{choices.context.ranks} devices, has {budget / GB:.1f} GB; add devices, "
            f"lower the batch, use a lighter optimizer (optimizer='sgd'), or raise "
            f"memory_limit_bytes"
        ) from None


def _staged_peak(choices: Choices, solution: Solution, cluster: Cluster, optimizer: str,
                 outputs=()) -> tuple[StageSolution, list[float]]:
    """`solution` as the one stage of the 1-D problem and the memory its step holds at its
    peak (planner.pipeline.stage_held.peak_bytes), by the rule every plan's memory reads."""
    staged = choices.staged(solution)
    return staged, peak_bytes(choices.built, staged, choices.shape, cluster, optimizer,
                              set(outputs))


def least_need_bytes(choices: Choices, cluster: Cluster, optimizer: str, outputs=()) -> float:
    """What a step of the 1-D problem needs at least per device by our own rule: the
    least-memory assignment (each tie group on one strategy) with what the step holds
    beside its layers (DDP's buckets, the loss, optimizer temporaries), so a
    PlanDoesNotFit's figure is one a plan could meet."""
    problem = choices.problem
    merged, picks = merge_ties(problem)
    least = tuple(min(range(len(node.options)), key=lambda k: node.options[k].memory_bytes)
                  for node in merged.nodes)
    choice = expand(least, picks, len(problem.nodes))
    solution = Solution(choice, problem.cost_of(choice), 0.0, "feasible", 0.0, "least memory")
    return _staged_peak(choices, solution, cluster, optimizer, outputs)[1][0]
