"""`price_job`: a user's torchtitan or Megatron-LM configuration priced with hyplan's price
list, as the Plan that configuration runs.

A JobConfig (planner.export.config) names a few integers and switches for the whole model;
hyplan's 3-D search (planner.search) restricted to that one shape prices it: the mesh
(pp, dp_replicate x dp_shard, tp), the schedule with its chunks per rank, the microbatches,
and every layer with weights pinned to the data-parallel wrapping the job asks for (FSDP2
"+fsdp" where dp_shard > 1, HSDP "+hsdp" where both dp degrees are, DDP's replicated
data-parallel where the job has neither and no tensor parallelism), as planner.baseline's
"fsdp_tp" pins torchtitan's 2-D plan; with expert parallelism (ep > 1) every experts layer
pinned to its EP group of ep ranks carved out of the stage's dp·tp ranks (expert_pin).
The search still picks what the job leaves to the framework's recipe: each layer's split
over tp (column, row, vocabulary) and which blocks
the activation checkpointing mode recomputes ("full": every block, as the frameworks run it;
"selective": whole blocks where memory needs them, hyplan having no op-level selective
checkpointing). So a job's price and hyplan's own plan
come from one function, and `hyplan compare --torchtitan` can put them side by side.

    job = read_torchtitan(Path("llama3_8b.toml").read_text(), devices=8)
    plan = planner.price_job(model, "8xH100", job, example_inputs=(ids,))
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from torch import nn

from planner import dp_shard, expert_degrees
from planner.export.config import JobConfig
from planner.once import plan_once
from planner.pipeline import block_recompute
from planner.pipeline.schedules import refusal
from planner.plan import Plan
from planner.plan3d import plan_3d, refuse_unsplittable
from planner.profiled import PlanDoesNotFit, profiled_graph
from planner.search import (
    DEFAULT_SEARCH_TIME_S,
    CostCache,
    Shape,
    shapes,
    tp_whole_rows,
)
from strategies.cluster import Cluster
from strategies.experts import _experts as experts_of
from strategies.experts import strategy_name
from strategies.kernel_levers import Levers
from strategies.parse import parse_devices

UNBOUNDED_BYTES = 1e15  # the budget a configuration that does not fit is priced under
# halvings of log(needed / budget) to find the least memory a job that checkpoints fits
# in: from 20x over the budget, to within 10% (each a solve: a minute on 405 B)
BISECTIONS = 5
# degrees the price list has no term for yet: field, torchtitan's and Megatron-LM's names
UNPRICED = {"cp": "context_parallel_degree / --context-parallel-size"}
EP_FIELD = "expert_parallel_degree / --expert-model-parallel-size"


@plan_once
def price_job(model: nn.Module, devices, job: JobConfig, example_inputs: Sequence | None = None,
              example_kwargs: dict | None = None, *, optimizer: str = "adam",
              leaf_modules=(), measure: bool | None = None, tracer: str = "auto",
              memory_limit_bytes: float | None = None, time_limit_s: float = 60.0,
              search_time_s: float | None = DEFAULT_SEARCH_TIME_S) -> Plan:
    """The Plan `job` runs for `model` on `devices` (example inputs: the job's global
    batch), priced as hyplan's own plans are (module docstring). A configuration that does
    not fit the devices' memory (or `memory_limit_bytes`) is still priced, and its plan
    says it does not fit. Raises ValueError naming the field where the job asks for what
    hyplan cannot price (cp; ep that is no EP group of its stage) or does not match the
    model and devices."""
    started = time.perf_counter()
    refuse_unpriced(job)
    devices = parse_devices(devices)
    devices = devices.model_copy(update={"levers": job_levers(job, devices)})
    graph, cluster = profiled_graph(model, devices, example_inputs, example_kwargs,
                                    leaf_modules, measure, tracer, precision=job.precision)
    if job.pp > 1:
        refuse_unsplittable(graph)
    _check_matches(job, cluster.num_devices, graph.batch_size, example_inputs)
    shape = job_shape(job, cluster.num_devices, graph.batch_size)
    _check_runs(job, shape, graph, cluster)
    recompute = job.recompute != "none" and block_recompute.offered(graph)
    shape = replace(shape, recompute=recompute, recompute_all=recompute and every_block(job))
    pin = job_pin(job, graph, cluster, optimizer, shape.rows(graph.batch_size))
    pin.update(expert_pin(job, graph, cluster, optimizer, shape.rows(graph.batch_size)))
    budget = memory_limit_bytes or cluster.device.memory_bytes
    kw = {"time_limit_s": time_limit_s, "only": [shape], "pin": pin,
          "search_time_s": search_time_s}
    try:
        plan = plan_3d(graph, cluster, optimizer, budget, started, **kw)
    except PlanDoesNotFit:  # priced anyway: the plan says it does not fit
        # each solve its own search_time_s: a bisection solves the shape several times
        plan = _least_memory(lambda b: plan_3d(graph, cluster, optimizer, b,
                                               time.perf_counter(), **kw), budget,
                             recompute and not shape.recompute_all)
        predicted = plan.predicted.model_copy(update={"memory_limit_bytes": budget})
        plan = plan.model_copy(update={"predicted": predicted})
        return _noted(plan, job, recompute, f"does not fit {budget / 1e9:.1f} GB per device: "
                      f"priced at the least memory found for it")
    return _noted(plan, job, recompute)


def job_levers(job: JobConfig, cluster: Cluster) -> Levers:
    """The kernel levers the job turns (strategies.kernel_levers), priced as it runs them:
    torch.compile, async TP, float8 where the devices have float8 tensor cores (else left
    eager and said: `_noted`), its TP sequence parallel where the job runs it so
    (torchtitan's always; Megatron-LM's --sequence-parallel), and over tp the loss on the
    head's vocabulary shards (both frameworks': torchtitan's loss_parallel, Megatron-LM's
    vocab-parallel cross-entropy)."""
    float8 = job.float8 or None
    if float8 and "float8" not in cluster.device.peak_flops:
        float8 = None
    return cluster.levers.model_copy(update={
        "compile": cluster.levers.compile or job.compile,
        "float8": cluster.levers.float8 or float8,
        "async_tp": cluster.levers.async_tp or (job.async_tp and job.tp > 1),
        "sequence_parallel": cluster.levers.sequence_parallel or (
            job.tp > 1 and job.sequence_parallel),
        "loss_parallel": cluster.levers.loss_parallel or job.tp > 1})


def every_block(job: JobConfig) -> bool:
    """Whether the job checkpoints every block whatever memory needs: torchtitan's "full"
    mode (Megatron-LM's full granularity, uniform method), not every k-th block nor its
    op-level "selective" mode, which hyplan prices as the blocks memory needs."""
    return job.recompute == "full" and job.recompute_every == 1


def _least_memory(plan_within, budget: float, recompute: bool) -> Plan:
    """A job that does not fit `budget`, priced: with no memory limit, or where the search
    picks the checkpointed blocks (`recompute`), at about the least memory it fits in
    (bisected between the budget and the unlimited plan's memory), so that it recomputes
    what memory makes it, not nothing (the search checkpoints a block only where memory
    needs it). A job that recomputes every block is priced once, unlimited: its memory is
    what it holds."""
    best = plan_within(UNBOUNDED_BYTES)
    if not recompute:
        return best
    low, high = budget, max(best.predicted.memory_bytes)
    for _ in range(BISECTIONS):
        middle = (low * high) ** 0.5
        try:
            best, high = plan_within(middle), middle
        except PlanDoesNotFit:
            low = middle
    return best


def refuse_unpriced(job: JobConfig) -> None:
    """A degree the price list has no term for, or an expert parallel degree that is no EP
    group of a stage (expert_pin), stops here, named, before the model is traced."""
    for name, fields in UNPRICED.items():
        if getattr(job, name) > 1:
            raise ValueError(f"price_job: {name} {getattr(job, name)} ({fields}) is not "
                             f"priced by hyplan yet; price the job with {name} = 1 (its "
                             f"devices moved to data_parallel_shard_degree)")
    if job.ep > 1 and (job.ep % job.tp or (job.dp * job.tp) % job.ep):
        raise ValueError(f"price_job: expert parallel degree {job.ep} ({EP_FIELD}) is not an "
                         f"EP group of a stage's data x tensor parallel ranks (dp {job.dp} x "
                         f"tp {job.tp}): hyplan prices ep a multiple of tp that divides "
                         f"dp x tp (expert tensor parallel size 1: each expert whole on "
                         f"one rank)")


def _check_matches(job: JobConfig, devices: int, batch: int, inputs) -> None:
    if job.devices != devices:
        raise ValueError(f"price_job: the job's degrees multiply to {job.devices} devices "
                         f"({job.describe()}), the cluster has {devices}; fix --devices or "
                         f"a degree")
    if job.global_batch != batch:
        raise ValueError(f"price_job: the job's global batch is {job.global_batch} "
                         f"(local batch x data-parallel degree x accumulation), the example "
                         f"inputs hold {batch}; build the inputs with batch "
                         f"{job.global_batch}")
    ids = inputs[0] if inputs else None
    seq = ids.shape[1] if getattr(ids, "ndim", 0) == 2 else 0
    if job.seq_len and seq and job.seq_len != seq:
        raise ValueError(f"price_job: the job's seq_len is {job.seq_len}, the example "
                         f"inputs' sequence is {seq}; build the inputs with seq "
                         f"{job.seq_len}")


def _check_runs(job: JobConfig, shape: Shape, graph, cluster) -> None:
    """The shape is one the search keeps for this model (planner.search._shapes_to_try):
    say why not, with the nearest that is, rather than find no plan."""
    batch = graph.batch_size
    if shape.pp > 1 and graph.tied_groups() and graph.tracer != "export":
        raise ValueError(f"price_job: pipeline_parallel_degree {job.pp}: {graph.model_name} "
                         f"shares a parameter between layers (tied weights), which hyplan "
                         f"keeps in one stage; price it with pp 1")
    if graph.tracer == "export" and shape.tp > 1 and not tp_whole_rows(shape, batch, cluster):
        runs = [m for m in range(1, batch // shape.dp + 1)
                if (batch // shape.dp) % m == 0
                and tp_whole_rows(replace(shape, microbatches=m), batch, cluster)]
        raise ValueError(
            f"price_job: tensor_parallel_degree {job.tp} with microbatches of "
            f"{shape.rows(batch)} rows: hyplan runs a torch.export graph tensor parallel "
            f"only inside a node and on microbatches whose rows tp does not divide "
            f"(planner.search.tp_whole_rows); "
            + (f"price it with {runs[0]} microbatches ({batch // shape.dp // runs[0]} rows)"
               if runs else "no microbatch count does here; change tp"))


def job_shape(job: JobConfig, devices: int, batch: int) -> Shape:
    """The search's one shape for the job (one the executor and torch run), or ValueError
    saying why the job's schedule, chunks and microbatches are not one."""
    dp = job.dp
    schedule = job.schedule if job.pp > 1 else None
    for s in shapes(devices, batch):
        if ((s.pp, s.dp, s.tp, s.microbatches) == (job.pp, dp, job.tp, job.microbatches)
                and (schedule is None or (s.schedule, s.chunks) == (schedule, job.chunks))):
            return s
    why = refusal(job.schedule, job.pp, job.chunks, job.microbatches) if job.pp > 1 else None
    raise ValueError(f"price_job: hyplan does not run {job.describe()}: "
                     + (why or f"{job.chunks} chunks per rank for {job.schedule}, or "
                        f"{job.microbatches} microbatches of the batch {batch}")
                     + "; change pipeline_parallel_schedule, its stages per rank or the "
                       "microbatch size")


def job_pin(job: JobConfig, graph, cluster, optimizer: str, rows: int) -> dict[str, str]:
    """Each layer's option as the job fixes it: its data-parallel wrapping (dp_wrapping),
    and over tp > 1 the frameworks' recipe, which splits every layer with weights
    (torchtitan's plan and Megatron-LM split each Linear by column or row, the embedding
    by vocabulary): a layer with one model-parallel option runs it; of two (a Linear's
    column or row split) the search picks; norms stay free (sequence parallel or whole)."""
    suffix = dp_wrapping(job, cluster.devices_per_node)
    pin = {layer.name: suffix for layer in graph.layers} if suffix else {}
    if job.tp == 1:
        return pin
    cache = CostCache(graph, cluster, optimizer)
    shard = suffix if suffix in (dp_shard.SUFFIX, dp_shard.HSDP_SUFFIX) else ""
    for layer in graph.layers:
        if not layer.param_bytes or "norm" in layer.kind.lower():
            continue
        split = [s.name for s in cache.layer(layer, job.tp, rows).strategies
                 if s.model_parallel]
        if len(split) == 1:
            pin[layer.name] = split[0] + shard
    return pin


def expert_pin(job: JobConfig, graph, cluster, optimizer: str, rows: int) -> dict[str, str]:
    """Each experts layer's option where the job runs expert parallelism (ep > 1): its
    experts over ep consecutive ranks of its stage, tp·e of them (the tp groups of e dp
    replicas: planner.expert_degrees), as Megatron-Core carves --expert-model-parallel-size
    out of the data-parallel and tensor-parallel ranks with --expert-tensor-parallel-size 1
    and torchtitan expert_parallel_degree out of dp_shard (x tp): "expert_parallel" where
    ep = tp, else "expert_parallel:ep{ep}". Over the dp/e ranks holding the same experts it
    is wrapped as the job wraps the rest (dp_wrapping): FSDP-sharded ("+fsdp") where the job
    runs FSDP2 (HSDP too, the carved group having no HSDP variant), else replicated, its
    gradient all-reduced once a step, which is how Megatron-LM's distributed optimizer
    moves it (reduce-scatter and all-gather: the same bytes), the optimizer state it
    shards not priced as sharded, as job_pin prices the other layers of such a job. The
    job's expert count and top-k, where its arguments give them, must be the model's."""
    if job.ep == 1:
        return {}
    layers = _experts_layers(job, graph)
    e = job.ep // job.tp
    _check_offered(CostCache(graph, cluster, optimizer), layers[0], job, rows)
    wrap = dp_wrapping(job, cluster.devices_per_node)
    if e == 1:
        name = strategy_name() + (wrap if wrap in (dp_shard.SUFFIX, dp_shard.HSDP_SUFFIX)
                                  else "")
    else:
        sharded = wrap in (dp_shard.SUFFIX, dp_shard.HSDP_SUFFIX) and job.dp // e > 1
        name = strategy_name(job.ep) + (dp_shard.SUFFIX if sharded else "")
    return {layer.name: name for layer in layers}


def _experts_layers(job: JobConfig, graph) -> list:
    """The model's experts layers, checked against the job: some there are, each holding a
    multiple of ep experts, as many (and as many per token) as the job's arguments say."""
    layers = [layer for layer in graph.layers if experts_of(layer)]
    if not layers:
        raise ValueError(f"price_job: expert parallel degree {job.ep} ({EP_FIELD}): "
                         f"{graph.model_name} has no experts layer (a mixture-of-experts "
                         f"block hyplan finds by shape: strategies.experts); set it to 1")
    for layer in layers:
        experts, top_k = experts_of(layer), layer.attrs.get("top_k", 0)
        if experts % job.ep:
            raise ValueError(f"price_job: expert parallel degree {job.ep} ({EP_FIELD}): "
                             f"{layer.name} holds {experts} experts, which do not split "
                             f"evenly over {job.ep} ranks")
        if job.experts and job.experts != experts:
            raise ValueError(f"price_job: the job's --num-experts {job.experts} is not the "
                             f"model's {experts} ({layer.name})")
        if job.router_topk and top_k and job.router_topk != top_k:
            raise ValueError(f"price_job: the job's --moe-router-topk {job.router_topk} is "
                             f"not the model's {top_k} experts per token ({layer.name})")
    return layers


def _check_offered(cache: CostCache, layer, job: JobConfig, rows: int) -> None:
    """The catalog offers `layer` expert parallelism over the job's EP group of tp·e ranks
    holding the e replicas' microbatches of `rows` rows (planner.expert_degrees.carved; for
    e = 1 its own "expert_parallel" over tp), or ValueError saying so before any search."""
    e = job.ep // job.tp
    wide = cache.layer(layer, job.ep, rows * e).strategies
    if expert_degrees.carved(wide, job.tp, e) is None:
        raise ValueError(f"price_job: expert parallel degree {job.ep} ({EP_FIELD}): hyplan "
                         f"does not offer {layer.name} expert parallelism over {job.ep} ranks "
                         f"on microbatches of {rows} row(s): its EP group splits each "
                         f"microbatch's rows (not its tokens) over the tp ranks; change the "
                         f"microbatch size (--micro-batch-size)")


def dp_wrapping(job: JobConfig, devices_per_node: int) -> str:
    """The pin of every layer over dp: "+fsdp" (dp_shard > 1), "+hsdp" (both dp degrees),
    "data_parallel" (DDP without tp), dp_shard.REPLICATED (DDP beside tp: Megatron-LM's
    replicas without its distributed optimizer), or "" where the search picks per layer
    (Megatron-LM's distributed optimizer shards the optimizer state, which the search
    prices as FSDP or replicated per layer)."""
    if job.dp == 1:
        return ""
    if job.dp_shard > 1 and job.dp_replicate > 1:
        split = dp_shard.hsdp_split(job.dp, job.tp, devices_per_node)
        if split != (job.dp_replicate, job.dp_shard):
            raise ValueError(
                f"price_job: data_parallel_shard_degree {job.dp_shard} x replicate "
                f"{job.dp_replicate}: hyplan prices HSDP with the shard over the dp ranks "
                f"of one node ({'none here' if split is None else f'shard {split[1]}'}); "
                f"set data_parallel_shard_degree to that, or replicate to 1")
        return dp_shard.HSDP_SUFFIX
    if job.dp_shard > 1:
        return dp_shard.SUFFIX
    if job.tp == 1:
        return "data_parallel"
    return "" if job.sharded_optimizer else dp_shard.REPLICATED


def _noted(plan: Plan, job: JobConfig, recompute: bool, over: str = "") -> Plan:
    """The plan, its mesh choice naming the job, and what of the job is not priced (and
    `over`: why it is priced over the memory budget)."""
    levers = plan.cluster.levers
    unpriced = [f"float8 {job.float8}"] if job.float8 and not levers.float8 else []
    notes = [over] if over else []
    if levers.any:
        notes.append(f"kernel levers priced: {levers.describe()}")
    if unpriced:
        notes.append(f"priced without {', '.join(unpriced)}: {plan.cluster.device.name} has "
                     f"no float8 tensor cores")
    if job.recompute != "none":
        notes.append(f"activation checkpointing {job.recompute!r} priced as "
                     + ("every block recomputed" if every_block(job) else
                        "whole-block recompute where memory needs it") if recompute else
                     f"activation checkpointing {job.recompute!r} not priced: hyplan "
                     f"checkpoints only the blocks of a decoder torch.export traced")
    note = "; ".join(notes + ([plan.solver.note] if plan.solver.note else []))
    solver = plan.solver.model_copy(update={"note": note})
    return plan.model_copy(update={"solver": solver,
                                   "mesh_choice": f"the job's own: {job.describe()}"})
