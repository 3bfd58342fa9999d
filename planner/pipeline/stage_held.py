"""Where a 3-D plan's solution puts things on the pipeline ranks, and the memory each rank
holds in its step: the per-layer rows the stage problem sums (weights, gradients,
optimizer state, activations in flight) and what the step holds beside them
(strategies.step_memory). The search checks its plans against `peak_bytes`, so does a
1-D plan's integer program (planner.optimize), and the Plan reports the same figure
(planner.plan3d.to_plan): one price for a device's memory, whatever the plan's kind.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from planner import dp_shard
from planner.expert_degrees import sharing
from planner.pipeline import schedules
from planner.pipeline.stages import stage_ranks
from strategies.cluster import Cluster
from strategies.memory import split_name
from strategies.step_memory import (
    HeldLayer,
    loss_held_bytes,
    one_d_layer,
    output_share,
    pipeline_buffer_bytes,
    replaced_bytes,
    reshard_copy_bytes,
    step_held_bytes,
)

if TYPE_CHECKING:
    from planner.search import Built, Shape


@dataclass(frozen=True)
class Placement:
    """Where a solution puts things: each stage's rank and microbatches in flight, each
    unit's and each layer's stage, and the units where the stages start (one past the
    last at the end)."""

    ranks_of: tuple[int, ...]
    flight: tuple[int, ...]
    starts: tuple[int, ...]
    stage_of_unit: tuple[int, ...]
    stage: tuple[int, ...]

    @staticmethod
    def of(shape: Shape, solution, built) -> Placement:
        S = shape.pp * shape.chunks
        problem = built.problem
        starts = tuple(solution.starts) + (len(problem.units),)
        stage_of_unit = tuple(k for k in range(S) for _ in range(starts[k], starts[k + 1]))
        return Placement(
            stage_ranks(shape.schedule, shape.pp, shape.chunks),
            shape.flights(),
            starts, stage_of_unit, tuple(stage_of_unit[l.unit] for l in problem.layers))


def peak_bytes(built: Built, solution, shape: Shape, cluster: Cluster, optimizer: str,
               outputs_of=(), at: Placement | None = None) -> list[float]:
    """Per pipeline rank, the memory its step holds at its peak: the stage problem's rows
    without the optimizer temporaries they carry (planner.search.Built.temp_bytes), one
    recomputed block's activations live again where the rank recomputes any
    (Built.transient_bytes), and held_beside_stages; `at`: the solution's placement,
    where the caller has it."""
    at = at or Placement.of(shape, solution, built)
    problem, choice = built.problem, solution.choice
    rows = [0.0] * shape.pp
    for i, l in enumerate(problem.layers):
        c, k = choice[i], at.stage[i]
        rows[at.ranks_of[k]] += (float(l.weight_bytes[c]) - built.temp(i, c)
                                 + float(l.activation_bytes[c]) * at.flight[k])
    recomputing = {at.ranks_of[at.stage_of_unit[u]] for u in problem.recomputed_units(choice)}
    held = held_beside_stages(built, choice, at.stage, at.ranks_of, shape, cluster, optimizer,
                              outputs_of, at.flight)
    return [rows[r] + held[r] + (built.transient_bytes if r in recomputing else 0.0)
            for r in range(shape.pp)]


def held_beside_stages(built, choice, stage: list[int], ranks_of: list[int], shape: Shape,
                       cluster: Cluster, optimizer: str, outputs_of=(),
                       flight: list[int] | None = None) -> list[float]:
    """Per pipeline rank, what its step holds beyond the per-layer memory the stage problem
    sums (strategies.step_memory): its layers as the executor keeps them (_held_layers),
    the loss of one microbatch where the model's outputs are made (`outputs_of`: their
    nodes), and what is kept throughout (_kept_bytes). A plan over one group of all
    devices (Built.one_group, a 1-D plan) runs under executor.parallelize, not
    executor.pipeline: DDP's Reducer keeps its buckets for the module's life, the one
    backward frees activations as it makes gradients (its layers tell their activations:
    not_together_bytes), the loss frees the output once read, and the batch is not copied
    into microbatches (batch_held_bytes)."""
    one = built.one_group
    flight = flight or [1] * (max(stage, default=0) + 1)
    saved, replaced = _reshard_copies(built, choice, stage, ranks_of, shape, flight)
    layers = _held_layers(built, choice, stage, ranks_of, shape, cluster, replaced)
    numel = [0.0] * shape.pp
    for i, share in _outputs(built, choice, outputs_of, shape.tp,
                             cluster.levers.loss_parallel):
        numel[ranks_of[stage[i]]] += math.prod(built.layers[i].output.shape) * share
    kept = [0.0] if one else _kept_bytes(built, stage, ranks_of, shape)
    scheduled = _scheduled(built, choice, stage, ranks_of, shape, flight, replaced)
    held = [step_held_bytes(mine, optimizer, cluster.device.kind, kept_buckets=one,
                            loss_bytes=loss_held_bytes(n) if one else stage_loss_bytes(n),
                            saved_bytes=copies, kept_bytes=keep, schedule=sched)
            for mine, n, copies, keep, sched in zip(layers, numel, saved, kept, scheduled)]
    # at least 0 on a 3-D shape: the search's rows budget is a relaxation of a rank's
    # memory only while nothing beside the rows is negative (planner.search._Search.
    # rows_budget), so where the schedule's take-back is more than the rest, the rank is
    # priced at its rows; a 1-D plan's program is solved again at the true figure instead
    # (planner.optimize._solve_within_memory)
    return held if one else [max(0.0, h) for h in held]


def stage_loss_bytes(output_numel: float) -> float:
    """What the loss holds on a last pipeline stage beyond its layers' activations, for
    `output_numel` outputs of one microbatch: strategies.step_memory.loss_held_bytes (the
    saved log-softmax and two gradients, the output's bytes each), and the output itself,
    which a 1-D step frees once the loss has read it (the per-layer figure of the layer
    that makes it counts it then) and a stage keeps until that microbatch's backward
    (torch/distributed/pipelining/stage.py: `fwd_cache[fwd_chunk_id] = (output_tuple,
    ...)`, popped in `backward_one_chunk`). Measured (benchmarks/memory.py, GPT-2's ZBV
    pipeline on 2 ranks, rank 0 at its peak in the first loss backward): the [256, 4096]
    logits, the log-softmax and both gradients alive, four logits' worth."""
    return loss_held_bytes(output_numel) + 4 * output_numel if output_numel else 0.0


def _scheduled(built, choice, stage, ranks_of, shape: Shape, flight,
               replaced) -> list[tuple[float, float] | None]:
    """Per pipeline rank, (the activations the stage problem's rows price: each layer's
    per microbatch times its stage's microbatches in flight, the most gradients and
    activations the rank's schedule holds at once: together_bytes), for
    strategies.step_memory.schedule_not_together_bytes; None where the order is not
    known (one pipeline rank: a 1-D step's rule would apply, kept as the sum here)."""
    if shape.pp == 1:
        return [None]
    try:
        orders = schedules.actions(shape.schedule, shape.pp, shape.chunks, shape.microbatches)
    except ValueError:
        return [None] * shape.pp
    per_stage: dict[int, list[tuple[float, float]]] = {}
    summed = [0.0] * shape.pp
    for i, layer in enumerate(built.problem.layers[:len(built.layers)]):  # not the sink
        c, k = choice[i], stage[i]
        acts = float(layer.activation_bytes[c]) - replaced.get(i, 0.0) / max(flight[k], 1)
        per_stage.setdefault(k, []).append((float(built.local_param_bytes[i][c]), acts))
        summed[ranks_of[k]] += acts * flight[k]
    return [(summed[r], together_bytes(orders[r], per_stage)) for r in range(shape.pp)]


def together_bytes(order, per_stage: dict[int, list[tuple[float, float]]]) -> float:
    """The most gradient and activation bytes one pipeline rank holds at once, running its
    schedule's actions in `order` (planner.pipeline.schedules.actions: the order torch
    runs), each stage's layers (gradient bytes, activation bytes per microbatch) in
    execution order: a forward adds its stage's activations; the backward that makes
    weight gradients (B, or W where it is split: the weight gradient still reads the
    layer inputs, planner.pipeline.schedules) frees them, and at a stage's first one makes
    its gradients, layer by layer from the last; a full backward frees each layer's
    activations as its gradient is made (torch.autograd.backward without retain_graph: a
    node's saved tensors are released when it runs), a split one's W only when it ends
    (torch/distributed/pipelining/_backward.py: `stage_backward_input` keeps the graph
    for `stage_backward_weight`, which frees it after every weight's gradient is made;
    measured, GPT-2's ZBV pipeline on 4 ranks: at the peak, in the W of a rank's first
    stage, all 9 MiB of its gradients and 17 of the 17.7 MiB of activations its order
    has alive then). The gradients then stay, accumulated in place, until the optimizer
    step (the step zeroes them to None before the forward: executor.step.train_step). A pipeline rank
    holds every gradient beside the activations of its later forwards, which the 1-D
    rule (not_together_bytes: no gradient until the one backward) does not see: GPT-2's
    pipelines measured 7-12% under it (benchmarks/memory.py)."""
    split = {(a.stage, a.microbatch) for a in order if a.kind == "W"}
    live = grads = peak = 0.0
    made: set[int] = set()
    for a in order:
        layers = per_stage.get(a.stage, [])
        acts = sum(x for _, x in layers)
        if a.kind == "F":
            live += acts
            peak = max(peak, live + grads)
        elif a.kind == "W" or (a.kind == "B" and (a.stage, a.microbatch) not in split):
            if a.stage not in made:
                made.add(a.stage)
                new, kept, most = 0.0, acts, acts
                for g, x in reversed(layers):
                    # a split backward's W frees nothing before it ends
                    new, kept = new + g, kept - (x if a.kind == "B" else 0.0)
                    most = max(most, new + kept)
                peak = max(peak, live - acts + grads + most)
                grads += sum(g for g, _ in layers)
            live -= acts
    return max(peak, grads)


def _held_layers(built, choice, stage, ranks_of, shape: Shape, cluster: Cluster,
                 replaced=None) -> list[list[HeldLayer]]:
    """Each pipeline rank's layers as the executor keeps them: under executor.pipeline, a
    replicated layer's gradient summed in flat buckets after the backward, an FSDP layer
    gathered over dp, an HSDP one over the dp ranks of a node; on one group of all devices
    (a 1-D plan, executor.parallelize), as strategies.step_memory.one_d_layer says, each
    telling what it keeps for backward. `replaced`: per layer, its activations in flight
    that layout-change copies replace (_reshard_copies). A pipeline rank's activations are
    not told: it holds its gradients beside later microbatches' activations, which the
    1-D take-back (strategies.step_memory.not_together_bytes) measured short by 7-12%
    (benchmarks/memory.py, GPT-2 on 2 and 4 ranks); its take-back follows its schedule
    (_scheduled, together_bytes)."""
    dp, tp = shape.dp, shape.tp
    layers: list[list[HeldLayer]] = [[] for _ in range(shape.pp)]
    for i, layer in enumerate(built.layers):
        c = choice[i]
        local = float(built.local_param_bytes[i][c])
        mine = replaced.get(i, 0.0) if replaced else 0.0
        if built.one_group:
            strategy = built.strategies[i][c]
            held = one_d_layer(split_name(strategy.name)[0], layer.param_bytes,
                               strategy.model_parallel, tp,
                               float(built.problem.layers[i].activation_bytes[c]))
            layers[0].append(replace(held, replaced_bytes=mine))
            continue
        sharded = built.sharded[i][c] if built.sharded else ""
        strategy = built.strategies[i][c]
        summed = dp > 1 or (tp > 1 and not strategy.model_parallel)
        gathered = dp_shard.gathered_over(sharded, *sharing(strategy.name, dp, tp),
                                          cluster.devices_per_node)
        layers[ranks_of[stage[i]]].append(HeldLayer(
            local, local * gathered, bucketed=not sharded and summed,
            replaced_bytes=mine))
    return layers


def _outputs(built, choice, outputs_of, tp: int, loss_parallel: bool = False):
    """(layer index, the share of its output one device holds) of each layer that makes a
    model output (strategies.step_memory.output_share over tp)."""
    for i, layer in enumerate(built.layers):
        if layer.node in outputs_of:
            yield i, output_share(built.strategies[i][choice[i]].gives, tp, loss_parallel)


def _kept_bytes(built, stage, ranks_of, shape: Shape) -> list[float]:
    """Per pipeline rank, what lives beside everything else: with pipeline stages, the
    buffers of what crosses each of its stages' cuts, the activations coming in and their
    gradients going back (pipeline_buffer_bytes), at the bytes the search prices the cut
    with (planner.search: what the executor sends, not what its stages compute again).
    The last stage keeps no outputs: executor.pipeline steps its schedule with
    return_outputs=False. And on every rank, the batch (batch_held_bytes)."""
    batch = batch_held_bytes(built, shape)
    kept = [batch] * shape.pp
    if shape.pp == 1 or not built.cut_bytes:
        return kept
    S = len(ranks_of)
    starts: dict[int, int] = {}  # stage -> its first unit (layers run in unit order)
    for layer, k in zip(built.problem.layers, stage):
        starts.setdefault(k, layer.unit)
    for k in range(1, S):
        if ranks_of[k - 1] == ranks_of[k]:
            continue  # the turn of a V stays on one rank
        buffers = pipeline_buffer_bytes(built.cut_bytes[starts[k]], shape.microbatches)
        kept[ranks_of[k]] += buffers  # the activation's receive buffers
        kept[ranks_of[k - 1]] += buffers  # its gradient's
    return kept


def batch_held_bytes(built, shape: Shape) -> float:
    """The model inputs every rank of a 3-D step holds through it, whatever its stages:
    the global batch it is handed (executor.train_step's `batch`, the caller's, read by
    every rank), and the copy executor.step._microbatches makes of its replica's rows of
    every microbatch (`torch.cat(parts)`, on every rank before the schedule runs), from
    the graph's inputs, which the search scales to one microbatch's rows of one replica.
    Measured (benchmarks/memory.py, ResNet-18's GPipe on 4 ranks, the rank whose only
    stage is `flatten`): 0.78 MiB at its peak, two [8, 3, 64, 64] fp32 images tensors (a
    split of the global batch and the cat) and 16 KiB of receive buffers."""
    one = sum(l.output.nbytes for l in built.layers if l.is_input)
    return one * shape.microbatches * (shape.dp + 1)


def _reshard_copies(built, choice, stage, ranks_of, shape: Shape,
                    flight: list[int]) -> tuple[list[float], dict[int, float]]:
    """Per pipeline rank, the copies layout changes over tp make (reshard_copy_bytes), one
    per microbatch in flight on their stage; and per layer, its activations in flight
    those copies replace (strategies.step_memory.replaced_bytes). A layer of a block
    recomputed whole keeps nothing of its input, the copy no more than the rest: the block
    makes it again in backward (planner.pipeline.block_recompute)."""
    saved = [0.0] * shape.pp
    copies: dict[int, list[float]] = {}
    for e in built.problem.edges if shape.tp > 1 else ():
        # the sink (the loss reads the output itself), or a reader that keeps nothing
        if e.dst >= len(built.layers) or _recomputed(built.problem.layers[e.dst],
                                                     choice[e.dst]):
            copies.setdefault(e.src, []).append(0.0)
            continue
        k = stage[e.dst]
        copy = reshard_copy_bytes(
            built.layers[e.src].output.nbytes, built.strategies[e.src][choice[e.src]].gives,
            built.strategies[e.dst][choice[e.dst]].takes, shape.tp)
        copies.setdefault(e.src, []).append(copy)
        saved[ranks_of[k]] += flight[k] * copy
    replaced: dict[int, float] = {}
    for i, mine in copies.items():
        layer, c = built.layers[i], choice[i]
        replaced[i] = flight[stage[i]] * replaced_bytes(
            float(built.problem.layers[i].activation_bytes[c]), layer.saved_per_output,
            layer.users_saved_per_output, mine)
    return saved, replaced


def _recomputed(options, c: int) -> bool:
    """Is option `c` of a layer (LayerOptions) the recomputed variant of a block's layer?"""
    return options.recomputed is not None and bool(options.recomputed[c])
