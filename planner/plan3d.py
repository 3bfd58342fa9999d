"""`optimize_3d`: model, example batch and devices in, a pipelined 3-D Plan out; and
`plan_of`, the one function that turns a solution of any plan kind into a Plan.

trace → profile → the 3-D search (planner.search) → Plan, with the mesh's groups, each
layer's stage, the pipeline section and memory per device split by what holds it. A 1-D
plan is the shape 1 x 1 x N (planner.choices), made into a Plan by the same `plan_of`
(`one_d_plan`). Nothing runs on the devices.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Sequence

from torch import nn

from planner import context_degrees, dp_shard, volume
from planner.block_cuts import recorded_module, why_no_blocks
from planner.choices import Choices
from planner.once import plan_once
from planner.plan import (
    CandidateReport, ContextParallelPlan, InputPlan, LayerPlan, MemoryBreakdown, MeshPlan,
    PipelinePlan, Plan,
    Predicted, SearchReport, SolverReport, StagePlan,
)
from planner.price import group_link, step_overhead_s
from planner.problem import Solution
from planner.profiled import GB, PlanDoesNotFit, check_arguments, profiled_graph
from planner.reasons import lever_fields, of_built, reasons
from planner.pipeline.schedules import LABELS, SPLIT_BACKWARD
from planner.search import (
    DEFAULT_SEARCH_TIME_S, SearchResult, Shape, build, mesh_words, rank_groups, search,
    time_left,
)
from planner.pipeline.stage_held import Placement, peak_bytes
from planner.pipeline.stages import StageSolution, evaluate
from strategies.catalog import OPTIMIZER_STATE_FACTOR, CostContext, update_s
from strategies.cluster import Cluster
from strategies.memory import split_name


@plan_once
def optimize_3d(
    model: nn.Module,
    devices,
    example_inputs: Sequence | None = None,
    example_kwargs: dict | None = None,
    *,
    optimizer: str = "adam",
    memory_limit_bytes: float | None = None,
    leaf_modules: Iterable[type | str] = (),
    measure: bool | None = None,
    precision: str | None = None,
    max_microbatches: int | None = None,
    time_limit_s: float = 60.0,
    relative_gap: float = 1e-6,
    only: list[Shape] | None = None,
    pin: dict[str, str] | None = None,
    tracer: str = "auto",
    search_time_s: float | None = DEFAULT_SEARCH_TIME_S,
) -> Plan:
    """Choose the mesh (pipeline x data x tensor), the stage cut, the microbatches, the
    schedule and each layer's strategy for one training step on `example_inputs` (dim 0:
    the global batch). Arguments as planner.optimize; `max_microbatches` caps m; `only`
    restricts the search to the given shapes (e.g. to compare one shape with the best);
    `search_time_s` bounds the call, the search's last (planner.optimize; None: prove it);
    `pin` {layer: strategy} fixes a layer's strategy on shapes where it applies. A model
    torch.fx cannot trace (`tracer` "auto" or "export") is cut only between its
    transformer blocks (planner.block_cuts), its tp groups inside a node."""
    started = time.perf_counter()
    check_arguments(optimizer, example_inputs, memory_limit_bytes)
    graph, cluster = profiled_graph(model, devices, example_inputs, example_kwargs,
                                    leaf_modules, measure, tracer=tracer, precision=precision)
    refuse_unsplittable(graph)
    budget = memory_limit_bytes or cluster.device.memory_bytes
    return plan_3d(graph, cluster, optimizer, budget, started,
                   max_microbatches=max_microbatches, time_limit_s=time_limit_s,
                   relative_gap=relative_gap, only=only, pin=pin,
                   search_time_s=search_time_s)


def refuse_unsplittable(graph) -> None:
    """A torch.export graph is pipelined only at its blocks: refuse one without them."""
    why = why_no_blocks(graph) if graph.tracer == "export" else ""
    if why:
        raise ValueError(f"mesh: '3d' cuts a model torch.export traced only between its "
                         f"transformer blocks, and {why}; use mesh='1d'")


def normalizes_over_batch(layer) -> bool:
    """A BatchNorm (module or F.batch_norm): its output depends on every row it is given."""
    return ((layer.module_type is not None
             and issubclass(layer.module_type, nn.modules.batchnorm._BatchNorm))
            or layer.kind == "batch_norm")


def plan_3d(graph, cluster: Cluster, optimizer: str, budget: float, started: float, *,
            max_microbatches: int | None = None, time_limit_s: float = 60.0,
            relative_gap: float = 1e-6, only: list[Shape] | None = None,
            pin: dict[str, str] | None = None,
            search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> Plan:
    """The 3-D search on a traced, profiled graph (what optimize_3d and
    planner.optimize(mesh="3d" or "auto") share); `started`: perf_counter at the call,
    from which `search_time_s` counts (None: no limit). A model that normalizes over the
    batch (BatchNorm) gets one microbatch: split into microbatches, each would normalize
    with its own statistics, which changes the math (torchvision's ResNet-18 and
    DenseNet-121 pipelines trained 1.6 apart from one process in 3 steps)."""
    if any(normalizes_over_batch(layer) for layer in graph.layers):
        max_microbatches = 1
        only = None if only is None else [s for s in only if s.microbatches == 1]
    kw = {"max_microbatches": max_microbatches, "time_limit_s": time_limit_s,
          "relative_gap": relative_gap, "only": only, "pin": pin,
          "search_time_s": search_time_s}
    result = _search(graph, cluster, optimizer, budget, started, **kw)
    plan = to_plan(graph, cluster, optimizer, budget, result, time.perf_counter() - started)
    return plan if max(plan.predicted.memory_bytes) <= budget else _over_budget(plan, budget)


def _over_budget(plan: Plan, budget: float) -> Plan:
    """A plan over the budget (the search fits every plan it keeps to what its step holds,
    planner.search._Search.refit; this guards the figure the Plan reports): handed back
    as it is, the memory it predicts over the limit (explain says "does not fit") and the
    solver's note saying why."""
    over = max(plan.predicted.memory_bytes) - budget
    note = (f"does not fit by {over / GB:.1f} GB with what the step holds beside the layers "
            f"(strategies.step_memory): raise memory_limit_bytes, add devices or lower the "
            f"batch")
    solver = plan.solver.model_copy(update={
        "note": note + (f"; {plan.solver.note}" if plan.solver.note else "")})
    return plan.model_copy(update={"solver": solver})


def _search(graph, cluster: Cluster, optimizer: str, budget: float, started: float, *,
            max_microbatches, time_limit_s, relative_gap, only, pin,
            search_time_s) -> SearchResult:
    """The 3-D search within `budget`, or PlanDoesNotFit naming it."""
    result = search(graph, cluster, optimizer, budget, max_microbatches=max_microbatches,
                    time_limit_s=time_limit_s, relative_gap=relative_gap, only=only,
                    pin=pin, search_time_s=time_left(search_time_s, started))
    if result.best is None and result.stats.get("out_of_time"):
        raise PlanDoesNotFit(
            f"no plan found within the time budget (search_time_s={search_time_s:g} s from "
            f"the call's start), not even a quick one: pass search_time_s=None "
            f"(--search-time prove) to search until a plan is found or ruled out")
    pinned_out = [c for c in result.candidates if c.note.startswith("pin not offered")]
    if result.best is None and pinned_out and not any(
            c.outcome == "does_not_fit" for c in result.candidates):
        raise ValueError(f"pin: no mesh shape offers what is pinned ({pinned_out[0].note} on "
                         f"{len(pinned_out)} shapes, e.g. pp {pinned_out[0].shape.pp} x dp "
                         f"{pinned_out[0].shape.dp} x tp {pinned_out[0].shape.tp}); pin an "
                         f"option the layer has on some shape (explain() of an unpinned plan "
                         f"lists them) or leave it to the search")
    if result.best is None:
        fits = [c for c in result.candidates if c.outcome == "does_not_fit"]
        smallest = min((c.note for c in fits), default="")
        raise PlanDoesNotFit(
            f"plan does not fit: no mesh shape, stage cut and strategies fit "
            f"{budget / GB:.1f} GB per device on {cluster.num_devices} devices "
            f"({smallest}); add devices, lower the batch, use optimizer='sgd', or raise "
            f"memory_limit_bytes")
    return result


def to_plan(graph, cluster: Cluster, optimizer: str, budget: float, result: SearchResult,
            seconds: float) -> Plan:
    """The Plan of the 3-D search's best candidate (plan_of), with how sure the search is,
    why its schedule won, and the pure data-parallel and one-device steps beside it."""
    best, fixed = result.best, step_overhead_s(cluster)
    times = best.solution.times
    why = (why_context(result, best.shape, times) if best.shape.cp > 1
           else why_schedule(result, best.shape, times))
    return plan_of(graph, cluster, optimizer, budget, result.built, best.shape, best.solution,
                   _solver_report(result, best.solution, times.step_s, seconds),
                   baselines=_baselines(result, graph, cluster, optimizer), why=why,
                   search=SearchReport(candidates=len(result.candidates),
                                       solved=result.solved, pruned=result.pruned,
                                       seconds=result.seconds,
                                       best_per_shape=_best_per_shape(result, fixed)))


def one_d_plan(graph, cluster: Cluster, optimizer: str, choices: Choices, solution: Solution,
               budget: float, data_parallel_s: float | None, single_s: float | None,
               seconds: float, data_parallel_memory_bytes: float | None = None, *,
               staged: tuple[StageSolution, list[float]] | None = None) -> Plan:
    """The Plan of a solution of the 1-D integer program (planner.choices: the shape
    1 x 1 x N) by plan_of, with the pure data-parallel and one-device step times it is
    compared against (None: not costed) and the bytes each device sends (planner.volume,
    which prices the edges into the output as the user gets it). `staged`: the solution
    as the one stage (Choices.staged) and its peak_bytes, where the caller has them (its
    memory check made them)."""
    report = SolverReport(
        status=solution.status, objective_s=solution.objective_s, bound_s=solution.bound_s,
        seconds=solution.seconds, backend=solution.backend,
        num_variables=solution.num_variables, num_constraints=solution.num_constraints,
        planning_seconds=seconds)
    stage, peak = staged or (choices.staged(solution), None)
    return plan_of(graph, cluster, optimizer, budget, choices.built, choices.shape, stage,
                   report, baselines=((data_parallel_s, data_parallel_memory_bytes), single_s),
                   communication_bytes=volume.communication_bytes(choices, solution.choice),
                   peak=peak)


def plan_of(graph, cluster: Cluster, optimizer: str, budget: float, built, shape: Shape,
            solution, solver: SolverReport, *, baselines, why: str = "",
            search: SearchReport | None = None,
            communication_bytes: float | None = None, peak: list[float] | None = None
            ) -> Plan:
    """The Plan of one solution of any plan kind: a 3-D shape's or one group of all
    devices' (Built.one_group, a 1-D plan): its layers, stages and mesh, the step's split
    and memory per device (peak_bytes: the layers and what the step holds beside them).
    `solver`, `search`, `why` (the schedule's, or a cp shape's degree's): how the caller
    found it; `baselines`: ((step time, memory) of pure data parallelism, one device's
    step time); `peak`: its peak_bytes, where the caller has them. A cp shape (Shape.cp)
    is one group of all devices on the ("dp", "cp") mesh executor.context_parallel runs."""
    problem, choice, times = built.problem, solution.choice, solution.times
    pp, dp, tp, m, v = shape.pp, shape.dp, shape.tp, shape.microbatches, shape.chunks
    at = Placement.of(shape, solution, built)
    layers, inputs, memory, stage_memory, compute, stage_compute, update = _layer_plans(
        graph, cluster, optimizer, built, choice, at, shape)
    compute, stage_compute = _as_run(problem, shape, at, compute, stage_compute)
    recomputed = [problem.units[u] for u in problem.recomputed_units(choice)]
    if recomputed:  # one block's activations, live again in its backward
        for r in {at.ranks_of[at.stage_of_unit[u]] for u in problem.recomputed_units(choice)}:
            memory[r]["activations_bytes"] += built.transient_bytes
    breakdown = [MemoryBreakdown(**b) for b in memory]
    # the step split: the busiest rank's microbatches, the bubble (its idle time in the
    # simulated schedule, planner.pipeline.schedules), the per-step part of the slowest rank
    load = [sum(times.microbatch_s[k] for k in range(pp * v) if at.ranks_of[k] == r)
            for r in range(pp)]
    once_rank = [sum(times.once_s[k] for k in range(pp * v) if at.ranks_of[k] == r)
                 for r in range(pp)]
    slow = max(range(pp), key=lambda r: load[r])
    once = max(range(pp), key=lambda r: once_rank[r])
    step, compute_s = times.step_s, m * compute[slow]
    other_s, bubble_s = update[once], times.bubble_s
    pipeline = None
    if pp > 1:
        busy = m * load[slow]
        stages = _stage_plans(graph, at, times, shape, stage_compute, stage_memory,
                              problem.units)
        pipeline = PipelinePlan(schedule=shape.schedule, chunks=v, microbatches=m,
                                forward_share=problem.forward_share,
                                microbatch_rows=shape.rows(graph.batch_size),
                                bubble_fraction=bubble_s / (bubble_s + busy) if busy else 0.0,
                                stages=stages, why=why)
    peak = peak or peak_bytes(built, solution, shape, cluster, optimizer, set(graph.outputs),
                              at)
    (data_parallel, data_parallel_memory), single = baselines
    fixed = step_overhead_s(cluster)  # outside every choice
    predicted = Predicted(
        step_time_s=step + fixed, compute_s=compute_s, other_s=other_s, bubble_s=bubble_s,
        communication_s=step - compute_s - other_s - bubble_s, fixed_s=fixed,
        memory_bytes=[peak[r // (dp * tp)] for r in range(pp * dp * tp)],
        memory_limit_bytes=budget, communication_bytes=communication_bytes,
        # a 1-D plan reports one total per device: this split counts the autocast copy of
        # every weight not sharded over dp, which its group-sharded "fsdp" layers do not
        # keep (planner.report.plot splits its total by the cost model instead)
        memory_breakdown=None if built.one_group else [
            breakdown[r // (dp * tp)] for r in range(pp * dp * tp)],
        data_parallel_step_time_s=data_parallel,
        data_parallel_memory_bytes=data_parallel_memory, single_device_step_time_s=single)
    context = mesh = None
    if shape.cp > 1:
        mesh = context_degrees.mesh_plan(cluster, shape.cp)
        context = ContextParallelPlan(degree=shape.cp,
                                      sharded=context_degrees.all_sharded(layers), why=why)
    return Plan(model=graph.model_name, fingerprint=graph.fingerprint,
                global_batch=graph.batch_size, optimizer=optimizer, cluster=cluster,
                mesh=mesh or _mesh_plan(cluster, shape, layers, built.one_group),
                inputs=inputs, layers=layers, predicted=predicted, solver=solver,
                pipeline=pipeline, microbatches=m, search=search, tracer=graph.tracer,
                outputs=list(graph.outputs), recompute_blocks=recomputed,
                context_parallel=context)


def _as_run(problem, shape: Shape, at: "Placement", compute, stage_compute):
    """Per rank and per stage compute as the schedule runs it: the backward split in two
    where the schedule splits it (StageProblem.for_schedule), and each later stage
    rerunning what depends on positions alone."""
    if shape.schedule in SPLIT_BACKWARD:
        compute = [c * problem.split_backward for c in compute]
        stage_compute = [c * problem.split_backward for c in stage_compute]
    for k in range(1, len(at.ranks_of)):
        compute[at.ranks_of[k]] += problem.replay_s
        stage_compute[k] += problem.replay_s
    return compute, stage_compute


def _layer_plans(graph, cluster: Cluster, optimizer: str, built, choice, at: Placement,
                 shape: Shape):
    """(LayerPlans, InputPlans, per-rank and per-stage memory breakdowns as dicts, per-rank
    and per-stage compute, per-rank update time) of the chosen options."""
    problem = built.problem
    pp, S, m, tp = shape.pp, len(at.ranks_of), shape.microbatches, shape.tp
    state = OPTIMIZER_STATE_FACTOR[optimizer]
    precision = cluster.training_precision
    rows = shape.rows(graph.batch_size)
    # an edge into the sink (the outputs as the user gets them back) is its producer's
    edge_in = [0.0] * len(problem.layers)
    for e in problem.edges:
        edge_in[e.dst if e.dst < len(graph.layers) else e.src] += float(
            e.cost_s[choice[e.src], choice[e.dst]])
    memory = [dict(parameters_bytes=0.0, gradients_bytes=0.0, optimizer_state_bytes=0.0,
                   activations_bytes=0.0,
                   microbatches_in_flight=max(at.flight[k] for k in range(S)
                                              if at.ranks_of[k] == r))
              for r in range(pp)]
    stage_memory = [dict(memory[at.ranks_of[k]], parameters_bytes=0.0, gradients_bytes=0.0,
                         optimizer_state_bytes=0.0, activations_bytes=0.0,
                         microbatches_in_flight=at.flight[k]) for k in range(S)]
    compute, stage_compute, update = [0.0] * pp, [0.0] * S, [0.0] * pp
    weighed = of_built(built, m, shape.dp, at.stage if S > 1 else None)
    why = reasons(weighed, choice)
    layers, inputs = [], []
    for i, layer in enumerate(graph.layers):
        c, k = choice[i], at.stage[i]
        r = at.ranks_of[k]
        strategy, cost, opts = built.strategies[i][c], built.costs[i][c], problem.layers[i]
        local = float(built.local_param_bytes[i][c])
        sharded = bool(built.sharded and built.sharded[i][c])
        for mem in (memory[r], stage_memory[k]):
            # fp32 masters and autocast's low-precision copy (strategies.precision), which
            # FSDP2 does not keep
            copy = 0.0 if sharded else precision.weight_copy_bytes(local)
            mem["parameters_bytes"] += local + copy
            mem["gradients_bytes"] += local
            mem["optimizer_state_bytes"] += state * local
            mem["activations_bytes"] += float(opts.activation_bytes[c]) * at.flight[k]
        # the optimizer steps this device's weights: a sharded option's shard only
        upd = (update_s(local, CostContext(cluster=cluster, ranks=tp, batch=rows,
                                           optimizer=optimizer))
               if sharded else cost.update_s)
        compute[r] += cost.compute_s
        stage_compute[k] += cost.compute_s
        update[r] += upd
        if layer.is_input:
            inputs.append(InputPlan(name=layer.node, layout=strategy.gives.value,
                                    shape=list(layer.output.shape),
                                    keyword=layer.node in graph.example_kwargs))
            continue
        per_mb_comm = float(opts.microbatch_s[c]) - cost.compute_s
        # the gradient sync as run alone (planner.price.Price.sync_serial_s), none of it
        # hidden beside compute: what its collectives take, the figure executor.monitor's
        # refit rescales (the step's split keeps the hidden part out: Predicted)
        sync = float(opts.step_s[c]) - upd + (
            float(built.sync_serial_s[i][c] - built.sync_s[i][c]) if built.sync_s else 0.0)
        layers.append(LayerPlan(
            name=layer.name, node=layer.node, kind=layer.kind,
            output_shape=list(layer.output.shape),
            row_factor=layer.output.row_factor, strategy=split_name(strategy.name)[0],
            input_layout=strategy.takes.value, output_layout=strategy.gives.value,
            model_parallel=strategy.model_parallel, compute_s=cost.compute_s * m,
            communication_s=per_mb_comm * m + sync, update_s=upd,
            reshard_in_s=edge_in[i] * m,
            memory_bytes=float(opts.weight_bytes[c]) - built.temp(i, c)
            + float(opts.activation_bytes[c]) * at.flight[k],
            param_bytes=layer.param_bytes, params=list(layer.params), stage=k,
            inputs=list(layer.inputs),
            reason=why[i],
            **lever_fields(weighed.layers[i], opts.plain_index(c), cost, opts, sharded)))
    return layers, inputs, memory, stage_memory, compute, stage_compute, update


def _stage_plans(graph, at: Placement, times, shape: Shape, stage_compute, stage_memory,
                 unit_names) -> list[StagePlan]:
    """One StagePlan per stage: its rank, layers, modules, ranks, times and memory."""
    groups = rank_groups(shape.pp, shape.dp, shape.tp)
    dp = shape.dp
    stages = []
    for k in range(len(at.ranks_of)):
        r = at.ranks_of[k]
        stages.append(StagePlan(
            index=k, pipeline_rank=r,
            layers=[l.name for l, s in zip(graph.layers, at.stage) if s == k and not l.is_input],
            modules=_stage_modules(graph, list(at.stage), k,
                                   unit_names[at.starts[k]:at.starts[k + 1]]),
            ranks=sorted(q for g in groups["tp"][r * dp:(r + 1) * dp] for q in g),
            microbatch_s=times.microbatch_s[k], send_s=times.send_s[k],
            compute_s=min(stage_compute[k], times.microbatch_s[k]),
            step_s=times.once_s[k], memory=MemoryBreakdown(**stage_memory[k])))
    return stages


def _mesh_plan(cluster: Cluster, shape: Shape, layers, one_group: bool = False) -> MeshPlan:
    """The (pp, dp, tp) mesh, its groups and links; HSDP layers split the dp dim into
    replicas across nodes and shards inside one. One group of all devices (a 1-D plan) is
    the one dim "devices", which executor.parallelize runs whole, not as stages."""
    pp, dp, tp = shape.pp, shape.dp, shape.tp
    if one_group:
        return MeshPlan(shape=[tp], dim_names=["devices"], device_type=cluster.device.kind,
                        nodes=cluster.nodes, devices_per_node=cluster.devices_per_node)
    links = {"tp": group_link(cluster, tp).name}
    if dp > 1:
        links["dp"] = group_link(cluster, dp * tp).name
    if pp > 1:
        links["pp"] = group_link(cluster, 2 * dp * tp).name
    split = dp_shard.hsdp_split(dp, tp, cluster.devices_per_node)
    shard_ranks = split[1] if any(l.hsdp for l in layers) else 1
    return MeshPlan(shape=[pp, dp, tp], dim_names=["pp", "dp", "tp"],
                    device_type=cluster.device.kind, nodes=cluster.nodes,
                    devices_per_node=cluster.devices_per_node, groups=rank_groups(pp, dp, tp),
                    group_links=links, dp_shard_ranks=shard_ranks)


def _solver_report(result: SearchResult, solution, step: float, seconds: float) -> SolverReport:
    """How sure the search is: a candidate left open (time limit, skipped, unproven)
    matters only while its bound is below the chosen plan."""
    open_bound = result.open_bound_s()
    # the best shape's own bound: its solve's, or the search's for the shape where higher
    # (the memory rows' Lagrangian bound, the relaxed schedule: planner.search._LoadBounds)
    own = max(solution.bound_s, result.best.bound_s or 0.0)
    bound = min(own, open_bound if open_bound is not None else math.inf)
    status = "optimal" if open_bound is None else "feasible"
    if result.interrupted:
        status = "interrupted"
    return SolverReport(
        status=status, objective_s=step, bound_s=bound,
        seconds=result.stats["solve_seconds"], backend="SCIP (stage MIP) + search",
        num_variables=solution.num_variables, num_constraints=solution.num_constraints,
        planning_seconds=seconds, note=result.stop_note() if status == "feasible" else "")


def _stage_modules(graph, stage: list[int], k: int, units) -> list[str]:
    """The module paths stage k runs: its units (fx), or for an export graph its blocks
    and the modules around them (the embeddings first, the final norm and head last),
    which the executor builds the stage from."""
    if graph.tracer != "export":
        return list(units)
    found = (recorded_module(graph, l.node) for l, s in zip(graph.layers, stage) if s == k)
    return list(dict.fromkeys(p for p in found if p is not None))


def why_schedule(result: SearchResult, shape: Shape, times) -> str:
    """One line on why this schedule won at this mesh: its bubble and memory beside the
    best solved candidate of every other schedule on the same (pp, dp, tp)."""
    def share(t) -> str:
        busy = t.step_s - t.bubble_s
        return f"{t.bubble_s / (t.bubble_s + busy):.0%}" if busy > 0 else "0%"

    def label(s: Shape) -> str:
        extra = f", v={s.chunks}" if s.chunks > 1 else ""
        return f"{LABELS[s.schedule]} (m={s.microbatches}{extra})"

    others: dict[str, tuple] = {}
    for c in result.candidates:
        s = c.shape
        if (s.pp, s.dp, s.tp, s.cp) != (shape.pp, shape.dp, shape.tp, shape.cp) or s == shape:
            continue
        if s.schedule == shape.schedule and s.chunks == shape.chunks:
            continue
        if c.solution is not None:
            t = c.solution.times
            old = others.get(s.schedule)
            if old is None or old[0] != "solved" or t.step_s < old[2].step_s:
                others[s.schedule] = ("solved", s, t)
        elif c.bound_s is not None and (s.schedule not in others or (
                others[s.schedule][0] != "solved" and c.bound_s < others[s.schedule][2])):
            others[s.schedule] = (c.outcome, s, c.bound_s)  # the least bound of its kind
    mem = max(times.memory_bytes)
    head = (f"{label(shape)}: step {times.step_s:.4g} s, bubble {share(times)}, "
            f"peak memory {mem / 1e9:.3g} GB")
    parts = []
    for name in sorted(others, key=lambda n: (others[n][0] != "solved", n)):
        kind, s, t = others[name]
        if kind == "solved":
            same = abs(max(t.memory_bytes) - mem) <= 0.02 * mem
            memory = "same memory" if same else f"{max(t.memory_bytes) / 1e9:.3g} GB"
            parts.append(f"{label(s)} {t.step_s:.4g} s, bubble {share(t)}, {memory}")
        else:
            parts.append(f"{label(s)} >= {t:.4g} s ({kind.replace('_', ' ')})")
    split = result.built.problem.split_backward if result.built is not None else 1.0
    note = (f" (zero-bubble schedules priced with torch's split backward, measured "
            f"{split:.2f}x a plain one on this model)" if split > 1.0 else "")
    return head + ("; vs " + "; ".join(parts) if parts else "") + note


def why_context(result: SearchResult, shape: Shape, times) -> str:
    """Why this cp degree: its step and memory beside the best candidate of every other
    cp degree (with or without recomputed blocks) and the best shape without cp, solved or
    bounded, or why it lost (does not fit)."""
    def best_of(candidates) -> str:
        solved = [c for c in candidates if c.solution is not None]
        if solved:
            c = min(solved, key=lambda c: c.solution.times.step_s)
            t = c.solution.times
            return (f"{_words_of(c.shape)} {_seconds(t.step_s)}, "
                    f"{max(t.memory_bytes) / 1e9:.3g} GB")
        c = min(candidates, key=lambda c: (_UNSOLVED.get(c.outcome, 0), c.bound_s
                                           if c.bound_s is not None else math.inf))
        bound = (f" >= {_seconds(c.bound_s)}" if c.bound_s is not None
                 and math.isfinite(c.bound_s) else "")
        note = f": {c.note}" if c.note and c.outcome != "pruned_by_bound" else ""
        return f"{_words_of(c.shape)}{bound} ({c.outcome.replace('_', ' ')}{note})"

    head = (f"{_words_of(shape)}: step {_seconds(times.step_s)}, layers' memory "
            f"{max(times.memory_bytes) / 1e9:.3g} GB")
    others = {}
    for c in result.candidates:
        if c.shape.cp != shape.cp:
            others.setdefault(c.shape.cp, []).append(c)
    parts = [best_of(others[cp]) for cp in sorted(others, key=lambda cp: (cp == 1, cp))]
    return head + ("; vs " + "; ".join(parts) if parts else "")


# an unsolved candidate's outcome, the most telling first: bounded, then too large
_UNSOLVED = {"does_not_fit": 1, "infeasible": 2, "dominated": 3}


def _seconds(t: float) -> str:
    return f"{t:.4g} s" if t >= 1 else f"{t * 1e3:.4g} ms"


def _words_of(shape: Shape) -> str:
    return mesh_words(shape) + (" + recompute" if shape.recompute else "")


def _baselines(result: SearchResult, graph, cluster: Cluster, optimizer: str):
    """((step time, memory per device) of pure data parallelism over all devices, one
    microbatch; or (None, None) where the batch does not split), and one device's step
    time on the same batch."""
    from planner.search import CostCache

    cache = CostCache(graph, cluster, optimizer)
    n, batch = cluster.num_devices, graph.batch_size
    out = []
    for dp in (n, 1):
        if batch % dp:
            out.append((None, None))
            continue
        b = build(cache, 1, dp, 1, batch // dp)
        choice = tuple(0 for _ in b.problem.layers)
        times = evaluate(b.problem, (0,), choice, 1, "1F1B")
        fixed = step_overhead_s(cluster) if dp > 1 else 0.0
        out.append((times.step_s + fixed, max(times.memory_bytes)))
    return out[0], out[1][0]


def _best_per_shape(result: SearchResult, fixed_s: float) -> list[CandidateReport]:
    """Per mesh shape (pp, dp, tp), its best solved candidate, else its best bound, each
    with the fixed step overhead `fixed_s` as the plan's step has it."""
    by_shape: dict[tuple, object] = {}
    rank = {"best": 0, "solved": 1, "pruned_by_bound": 2, "time_limit": 2, "skipped": 2,
            "infeasible": 3,
            "does_not_fit": 4, "dominated": 5}
    for c in result.candidates:
        key = (c.shape.pp, c.shape.dp, c.shape.tp, c.shape.cp)
        value = c.solution.times.step_s if c.solution else (c.bound_s or float("inf"))
        old = by_shape.get(key)
        if old is None or (rank[c.outcome], value) < old[0]:
            by_shape[key] = ((rank[c.outcome], value), c)
    out = []
    for (_, c) in sorted(by_shape.values(), key=lambda t: t[0]):
        s = c.shape
        pp, dp, tp = s.degrees()  # a cp shape's as the user reads them: dp x cp
        out.append(CandidateReport(
            pp=pp, dp=dp, tp=tp, cp=s.cp, microbatches=s.microbatches, schedule=s.schedule,
            chunks=s.chunks, outcome=c.outcome,
            step_time_s=c.solution.times.step_s + fixed_s if c.solution else None,
            bound_s=(None if c.bound_s is None or math.isinf(c.bound_s)
                     else c.bound_s + fixed_s), note=c.note))
    return out


MESHES = ("1d", "3d", "auto")
AS_GOOD = 0.01  # "auto" keeps the 1-D plan unless a 3-D one is predicted this much faster


def choose_mesh(mesh: str, graph, cluster: Cluster, optimizer: str, budget: float,
                started: float, plan_1d, *, pin: dict[str, str] | None = None,
                time_limit_s: float = 60.0,
                search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> Plan:
    """planner.optimize(mesh="3d"): the 3-D search's plan. mesh="auto": the 1-D plan
    (`plan_1d()`, one group of all devices, each layer data- or model-parallel) unless the
    3-D search predicts a step at least AS_GOOD faster, or the 1-D plan does not fit; the
    plan returned says which won in `mesh_choice`. 1-D plans are simpler to run (no
    stages, the user's loop unchanged), so a tie goes to them."""
    why = why_no_blocks(graph) if graph.tracer == "export" else ""
    if why:
        if mesh == "3d":
            refuse_unsplittable(graph)
        return plan_1d().model_copy(update={
            "mesh_choice": f"auto: 1-D (pipeline stages of a torch.export graph cut between "
                           f"transformer blocks; {why})"})
    if mesh == "3d":
        return plan_3d(graph, cluster, optimizer, budget, started, pin=pin,
                       time_limit_s=time_limit_s, search_time_s=search_time_s)
    try:
        one = plan_1d()
    except PlanDoesNotFit:
        one = None
    try:
        three = plan_3d(graph, cluster, optimizer, budget, started, pin=pin,
                        time_limit_s=time_limit_s, search_time_s=search_time_s)
    except PlanDoesNotFit:
        if one is None:
            raise
        return one.model_copy(update={"mesh_choice": "auto: 1-D (no 3-D plan fits)"})
    seconds = time.perf_counter() - started
    shape = " x ".join(f"{name} {size}" for name, size in zip(three.mesh.dim_names,
                                                             three.mesh.shape))
    if one is None:
        why = f"auto: 3-D {shape} (the 1-D plan does not fit)"
        return stamped(three, why, seconds)
    t1, t3 = one.predicted.step_time_s, three.predicted.step_time_s
    if t3 < (1 - AS_GOOD) * t1:
        why = (f"auto: 3-D {shape} ({t3 * 1e3:.1f} ms) beats the 1-D plan "
               f"({t1 * 1e3:.1f} ms) by {t1 / t3:.2f}x")
        return stamped(three, why, seconds)
    why = (f"auto: 1-D ({t1 * 1e3:.1f} ms); the best 3-D plan, {shape}, predicts "
           f"{t3 * 1e3:.1f} ms, not {AS_GOOD:.0%} faster")
    return stamped(_with_search_gap(one, three), why, seconds, search=three.search)


def _with_search_gap(one: Plan, three: Plan) -> Plan:
    """The 1-D plan `auto` keeps, its bound lowered to what the 3-D search left open: where
    that search stopped with a gap, a 3-D plan may still beat the 1-D one, and the plan
    says "feasible" with that gap (the bounds compared as predicted step times)."""
    if three.solver.status == "optimal":
        return one
    own = one.predicted.step_time_s - one.solver.objective_s  # outside the objective
    open_s = three.solver.bound_s + three.predicted.step_time_s - three.solver.objective_s
    if open_s - own >= one.solver.bound_s:
        return one
    solver = one.solver.model_copy(update={
        "status": "feasible" if one.solver.status == "optimal" else one.solver.status,
        "bound_s": open_s - own, "note": three.solver.note})
    return one.model_copy(update={"solver": solver})


def stamped(plan: Plan, why: str, seconds: float, search=None) -> Plan:
    """`plan` as the mesh choice that won (`why`), planned in `seconds` from the call's start
    (optimize's choice of mesh and of a context-parallel plan, planner.context_plan)."""
    solver = plan.solver.model_copy(update={"planning_seconds": seconds})
    update = {"mesh_choice": why, "solver": solver}
    if search is not None:
        update["search"] = search
    return plan.model_copy(update=update)
