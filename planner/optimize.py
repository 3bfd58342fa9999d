"""`optimize`: model, example batch and devices in, a Plan out. Nothing runs on the devices.

The flow, one plain function each: trace → profile → candidate strategies and their costs
→ integer program → Plan, with two baselines costed by the same model (pure data
parallelism on the same devices, and one device) so the plan can say what it gains.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from torch import nn

from planner.choices import OUTPUT, Choices, layer_choices
from strategies.memory import lever_fields, split_name
from planner.ilp import solve
from planner.once import plan_once
from planner.plan import (
    InputPlan, LayerPlan, MeshPlan, Plan, Predicted, SolverReport,
)
from planner.problem import Infeasible, Solution
from planner.reasons import reasons
from planner.volume import communication_bytes
from profiler import profile, trace
from profiler.export_trace import export_trace
from profiler.trace import TraceError
from strategies.catalog import OPTIMIZER_STATE_FACTOR, leaf_types, unit_types
from strategies.cluster import Cluster, cpu_threads_per_device, parse_devices
from strategies.precision import at_precision

GB = 1e9


class PlanDoesNotFit(ValueError):
    """No assignment of strategies fits the devices' memory."""


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
    transformers), or "auto": fx, and torch.export where fx fails.
    mesh: "1d" (one group of all devices, each layer data- or model-parallel), "3d" (search
    pipeline x data x tensor meshes, stage cuts, microbatches and schedules:
    planner.plan3d), or "auto" (both; the 1-D plan unless a 3-D one is predicted at least
    1% faster or the 1-D one does not fit; `Plan.mesh_choice` says which and why).
    prefer_standard: keep the best standard plan (DDP, tensor parallel or FSDP) when it is
    predicted within this fraction of the optimum and fits: a hybrid whose predicted gain
    is below the cost model's own error is a guess, and the standard plan is the one
    people know how to run and debug. 0 always returns the solver's optimum; either way
    `Plan.standard_choice` and explain() give both times. Not applied with `pin`.
    precision: "bf16-mixed", "fp16-mixed" or "fp32" (strategies.precision): priced as the
    executor runs it (compute rate, memory, bytes sent). Default: the Cluster's, else the
    device's usual one (bf16-mixed on A100/H100, fp16-mixed on V100, fp32 on K20 and CPU).
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
    if mesh != "1d":
        from planner.plan3d import choose_mesh

        return choose_mesh(mesh, graph, cluster, optimizer, budget, started,
                           lambda: _plan_1d(graph, cluster, optimizer, budget, pin,
                                            time_limit_s, started, prefer_standard),
                           pin=pin, time_limit_s=time_limit_s)
    return _plan_1d(graph, cluster, optimizer, budget, pin, time_limit_s, started,
                    prefer_standard)


def _plan_1d(graph, cluster: Cluster, optimizer: str, budget: float, pin, time_limit_s: float,
             started: float, prefer_standard: float = 0.0) -> Plan:
    """The integer program over one mesh dim of all devices, and its two baselines."""
    choices = layer_choices(graph, cluster, optimizer, budget, pin=pin)
    solution = _solve_within_memory(choices, budget, time_limit_s)
    dp_choices = layer_choices(graph, cluster, optimizer, None, only={"data_parallel"})
    data_parallel = solve(dp_choices.problem, time_limit_s)
    single = solve(layer_choices(graph, cluster.with_devices(1, 1), optimizer, None).problem,
                   time_limit_s)
    dp = (data_parallel.objective_s + cluster.step_overhead_s,
          dp_choices.problem.memory_of(data_parallel.choice))
    plan = _plan(graph, cluster, optimizer, choices, solution, budget, dp[0],
                 single.objective_s, time.perf_counter() - started, dp[1])
    if cluster.num_devices == 1:
        return plan
    solved = _baselines(graph, cluster, optimizer, time_limit_s)
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
    from planner.baseline import LABELS

    best_s = plan.predicted.step_time_s
    baselines = plan.predicted.baselines
    times = {kind: b.step_time_s for kind, b in baselines.items() if b.fits is not False}
    for kind in sorted(times, key=times.get):
        if times[kind] > best_s * (1 + tolerance):
            break
        choices, solution = solved[kind]
        standard = _plan(graph, cluster, optimizer, choices, solution, budget, dp[0], single_s,
                         time.perf_counter() - started, dp[1])
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


def _baselines(graph, cluster: Cluster, optimizer: str, time_limit_s: float) -> dict:
    """{kind: (choices, solution)} of every available 1-D baseline."""
    from planner.baseline import ONE_D_KINDS, available, solve_baseline

    solved = {}
    for kind in available(ONE_D_KINDS):
        try:
            solved[kind] = solve_baseline(graph, cluster, optimizer, kind, time_limit_s)
        except Infeasible:  # this model has no plan of that kind: nothing to compare
            continue
    return solved


def _with_baselines(plan: Plan, solved: dict, cluster: Cluster, budget: float) -> Plan:
    """The plan, its prediction carrying each baseline's step time, communication and
    memory, and whether it fits `budget`."""
    from planner.baseline import summarize

    records = {kind: summarize(choices, solution, cluster, budget)
               for kind, (choices, solution) in solved.items()}
    predicted = plan.predicted.model_copy(update={"baselines": records})
    return plan.model_copy(update={"predicted": predicted})


def check_arguments(optimizer: str, example_inputs, memory_limit_bytes: float | None) -> None:
    """The checks every planning entry point makes before it traces anything."""
    if optimizer not in OPTIMIZER_STATE_FACTOR:
        raise ValueError(f"optimizer: {optimizer!r} is not one of {sorted(OPTIMIZER_STATE_FACTOR)}")
    if example_inputs is None:
        raise ValueError("example_inputs: pass an example batch, e.g. example_inputs=(images,)")
    if memory_limit_bytes is not None and memory_limit_bytes <= 0:
        raise ValueError(f"memory_limit_bytes: must be positive, got {memory_limit_bytes}")


def profiled_graph(model: nn.Module, devices, example_inputs, example_kwargs=None,
                   leaf_modules=(), measure: bool | None = None, tracer: str = "auto",
                   precision: str | None = None):
    """(traced and profiled graph, Cluster): the first two steps of the flow, shared by
    optimize() and the baselines (layer timings are cached by shape, so a second call on
    the same model costs no measuring). The Cluster records `precision` (None: its own or
    the device's default) and the graph's activations are sized in it."""
    cluster = parse_devices(devices).at_precision(precision)
    ranks = cluster.num_devices
    graph = trace_model(model, example_inputs, example_kwargs, leaf_modules, tracer)
    if measure is None:
        measure = cluster.device.kind == "cpu"
    graph = profile(graph, measure=measure, measure_batch=max(1, graph.batch_size // ranks),
                    threads=cpu_threads_per_device(ranks) if cluster.device.kind == "cpu" else None,
                    ranks=ranks, model=model, example_inputs=example_inputs)
    return at_precision(graph, cluster.training_precision), cluster


def trace_model(model: nn.Module, example_inputs, example_kwargs=None, leaf_modules=(),
                tracer: str = "auto"):
    """The model's ModelGraph by torch.fx, or by torch.export where fx cannot follow it."""
    if tracer not in ("auto", "fx", "export"):
        raise ValueError(f"tracer: {tracer!r} is not one of 'auto', 'fx', 'export'")
    if tracer != "export":
        try:
            return trace(model, example_inputs, example_kwargs,
                         tuple(leaf_modules) + leaf_types(model))
        except TraceError as fx_error:
            if tracer == "fx":
                raise
            first = fx_error
    else:
        first = None
    try:
        return export_trace(model, example_inputs, example_kwargs, unit_types(model))
    except TraceError as error:
        if first is None:
            raise
        raise TraceError(f"{first} -- and {error}") from error


def _solve_within_memory(choices: Choices, budget: float, time_limit_s: float) -> Solution:
    try:
        return solve(choices.problem, time_limit_s)
    except Infeasible as error:
        if error.family != "memory":
            raise
        need = sum(min(c.memory_bytes for c in row.costs) for row in choices.layers)
        raise PlanDoesNotFit(
            f"plan does not fit: needs at least {need / GB:.1f} GB on each of "
            f"{choices.context.ranks} devices, has {budget / GB:.1f} GB; add devices, "
            f"lower the batch, use a lighter optimizer (optimizer='sgd'), or raise "
            f"memory_limit_bytes"
        ) from None


def _plan(graph, cluster: Cluster, optimizer: str, choices: Choices, solution: Solution,
          budget: float, data_parallel_s: float, single_s: float, seconds: float,
          data_parallel_memory_bytes: float | None = None) -> Plan:
    problem, choice = choices.problem, list(solution.choice)
    reshard_in = [0.0] * len(problem.nodes)
    reshard_out = [0.0] * len(problem.nodes)
    for e in problem.edges:
        cost = float(e.cost_s[choice[e.src], choice[e.dst]])
        if problem.nodes[e.dst].name == OUTPUT:
            reshard_out[e.src] += cost
        else:
            reshard_in[e.dst] += cost
    why = reasons(choices, choice)

    layers, inputs = [], []
    for i, row in enumerate(choices.layers):
        strategy, cost, layer = row.strategies[choice[i]], row.costs[choice[i]], row.layer
        if layer.is_input:
            inputs.append(InputPlan(name=layer.node, layout=strategy.gives.value,
                                    shape=list(layer.output.shape)))
            continue
        layers.append(LayerPlan(
            name=layer.name, node=layer.node, kind=layer.kind,
            output_shape=list(layer.output.shape), strategy=split_name(strategy.name)[0],
            input_layout=strategy.takes.value, output_layout=strategy.gives.value,
            model_parallel=strategy.model_parallel, compute_s=cost.compute_s,
            communication_s=cost.communication_s, update_s=cost.update_s,
            reshard_in_s=reshard_in[i] + reshard_out[i], memory_bytes=cost.memory_bytes,
            param_bytes=layer.param_bytes, params=list(layer.params), reason=why[i], inputs=list(layer.inputs),
            **lever_fields(strategy, cost)))

    compute = sum(l.compute_s for l in layers)
    update = sum(l.update_s for l in layers)
    memory = problem.memory_of(choice)
    ranks = cluster.num_devices
    # what every distributed step costs whatever the plan (calibrated; the same for every
    # choice, so outside the integer program's objective)
    fixed = cluster.step_overhead_s if ranks > 1 else 0.0
    predicted = Predicted(
        step_time_s=solution.objective_s + fixed, compute_s=compute, other_s=update,
        communication_s=solution.objective_s - compute - update, fixed_s=fixed,
        memory_bytes=[memory] * ranks, memory_limit_bytes=budget,
        communication_bytes=communication_bytes(choices, choice),
        data_parallel_step_time_s=data_parallel_s,
        data_parallel_memory_bytes=data_parallel_memory_bytes,
        single_device_step_time_s=single_s)
    mesh = MeshPlan(shape=[ranks], dim_names=["devices"], device_type=cluster.device.kind,
                    nodes=cluster.nodes, devices_per_node=cluster.devices_per_node)
    report = SolverReport(
        status=solution.status, objective_s=solution.objective_s, bound_s=solution.bound_s,
        seconds=solution.seconds, backend=solution.backend,
        num_variables=solution.num_variables, num_constraints=solution.num_constraints,
        planning_seconds=seconds)
    return Plan(model=graph.model_name, fingerprint=graph.fingerprint,
                global_batch=graph.batch_size, optimizer=optimizer, cluster=cluster,
                mesh=mesh, inputs=inputs, layers=layers, predicted=predicted, solver=report,
                tracer=graph.tracer, outputs=list(graph.outputs))
