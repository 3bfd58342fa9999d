"""Where a 3-D plan's solution puts things on the pipeline ranks, and the memory each rank
holds in its step: the per-layer rows the stage problem sums (weights, gradients,
optimizer state, activations in flight) and what the step holds beside them
(strategies.step_memory). The search checks its plans against `peak_bytes` and the Plan
reports the same figure (planner.plan3d.to_plan): one price for a rank's memory.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner import dp_shard
from planner.pipeline.stages import in_flight, stage_ranks
from strategies.cluster import Cluster
from strategies.step_memory import (
    HeldLayer, loss_held_bytes, output_share, pipeline_buffer_bytes, reshard_copy_bytes,
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
            tuple(in_flight(shape.schedule, shape.pp, shape.microbatches, k, shape.chunks)
                  for k in range(S)),
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
    sums (strategies.step_memory, the rule 1-D plans follow too): its layers as the
    executor keeps them (_held_layers), the loss of one microbatch where the model's
    outputs are made (`outputs_of`: their nodes), and what is kept throughout
    (_kept_bytes)."""
    flight = flight or [1] * (max(stage, default=0) + 1)
    layers = _held_layers(built, choice, stage, ranks_of, shape, cluster)
    numel = [0.0] * shape.pp
    for i, share in _outputs(built, choice, outputs_of, shape.tp):
        numel[ranks_of[stage[i]]] += math.prod(built.layers[i].output.shape) * share
    kept = _kept_bytes(built, stage, ranks_of, shape)
    saved = _reshard_copies(built, choice, stage, ranks_of, shape, flight)
    return [step_held_bytes(mine, optimizer, cluster.device.kind, kept_buckets=False,
                            loss_bytes=loss_held_bytes(n), saved_bytes=copies,
                            kept_bytes=keep)
            for mine, n, copies, keep in zip(layers, numel, saved, kept)]


def _held_layers(built, choice, stage, ranks_of, shape: Shape,
                 cluster: Cluster) -> list[list[HeldLayer]]:
    """Each pipeline rank's layers as executor.pipeline keeps them: a replicated layer's
    gradient summed in flat buckets after the backward, an FSDP layer gathered over dp, an
    HSDP one over the dp ranks of a node. Their activations are not told: 1-D plans take
    back what the sum counts of gradients beside activations
    (strategies.step_memory.not_together_bytes), which a pipeline's ranks measured short
    by 7-12% (benchmarks/memory.py, GPT-2 on 2 and 4 ranks), so the sum stands here."""
    dp, tp = shape.dp, shape.tp
    split = dp_shard.hsdp_split(dp, tp, cluster.devices_per_node)
    gather = {"": 0, dp_shard.SUFFIX: dp, dp_shard.HSDP_SUFFIX: split[1] if split else dp}
    layers: list[list[HeldLayer]] = [[] for _ in range(shape.pp)]
    for i in range(len(built.layers)):
        c = choice[i]
        local = float(built.local_param_bytes[i][c])
        sharded = built.sharded[i][c] if built.sharded else ""
        summed = dp > 1 or (tp > 1 and not built.strategies[i][c].model_parallel)
        layers[ranks_of[stage[i]]].append(HeldLayer(local, local * gather[sharded],
                                                    bucketed=not sharded and summed))
    return layers


def _outputs(built, choice, outputs_of, tp: int):
    """(layer index, the share of its output one device holds) of each layer that makes a
    model output (strategies.step_memory.output_share over tp)."""
    for i, layer in enumerate(built.layers):
        if layer.node in outputs_of:
            yield i, output_share(built.strategies[i][choice[i]].gives, tp)


def _kept_bytes(built, stage, ranks_of, shape: Shape) -> list[float]:
    """Per pipeline rank, what lives beside everything else: with pipeline stages, the
    buffers of what crosses each of its stages' cuts, the activations coming in and their
    gradients going back (pipeline_buffer_bytes), at the bytes the search prices the cut
    with (planner.search: what the executor sends, not what its stages compute again).
    The last stage keeps no outputs: executor.pipeline steps its schedule with
    return_outputs=False."""
    kept = [0.0] * shape.pp
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


def _reshard_copies(built, choice, stage, ranks_of, shape: Shape,
                    flight: list[int]) -> list[float]:
    """Per pipeline rank, the copies layout changes over tp make (reshard_copy_bytes), one
    per microbatch in flight on their stage."""
    saved = [0.0] * shape.pp
    for e in built.problem.edges if shape.tp > 1 else ():
        if e.dst >= len(built.layers):  # the sink
            continue
        k = stage[e.dst]
        saved[ranks_of[k]] += flight[k] * reshard_copy_bytes(
            built.layers[e.src].output.nbytes, built.strategies[e.src][choice[e.src]].gives,
            built.strategies[e.dst][choice[e.dst]].takes, shape.tp)
    return saved
