"""Context parallelism as a degree of the 3-D search: which cp degrees a job has, the
options of a layer on a cp shape, and the ("dp", "cp") mesh such a plan runs on.

A cp shape (planner.search.Shape.cp) is one group of all N devices, as a 1-D plan is (the
shape 1 x 1 x N), split into dp = N / cp replicas of cp consecutive ranks; each replica's
rows are split by sequence over its cp ranks (executor.context_parallel's head-tail
chunks), so every layer does 1/N of the batch's per-token work. Its options
(`ContextGroup`, priced by planner.price over the group, strategies.context): an attention
block under `ContextParallel(degree=cp)`, its K/V all-gathered over the cp group, every
other layer under `TokenShard`, the model's own code on the rank's tokens; each with its
weights replicated (gradients summed over all N ranks) or, where a module holds them,
FSDP2-sharded over all N (the `+fsdp` options). The stage program picks per layer, and
per block where blocks may be recomputed; there are no layout changes between layers, so
no edges. The cp baseline (planner.context_plan) prices the same options held uniform.

The executor runs this on a ("dp", "cp") mesh with one microbatch, so cp shapes have no
pipeline, no tensor parallelism beside cp and m = 1 (a cp group's sequence chunks would
have to travel between stages, and attention's heads be split over tp inside the gathered
attention, which executor.context_parallel does not run), and none is offered for a model
it cannot split (`why_not_split`).
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.offers import OneGroup
from planner.price import group_link
from planner.plan import MeshPlan
from profiler.graph import Layer, ModelGraph
from strategies.catalog import Strategy
from strategies.cluster import Cluster
from strategies.context import (
    ContextParallel, ShardedContextParallel, ShardedTokenShard, TokenShard,
)
from strategies.gpu_compute import attention_dims


def is_attention(layer: Layer) -> bool:
    """An attention block the executor splits by sequence: a leaf with heads and weights,
    [batch, seq, hidden] out (strategies.gpu_compute.attention_dims)."""
    return not layer.is_input and attention_dims(layer) is not None


def sequence_length(graph: ModelGraph) -> int:
    """The tokens per sequence: the attention blocks' output dim 1. Raises for a model
    with no attention to split."""
    lengths = {layer.output.shape[1] for layer in graph.layers if is_attention(layer)}
    if not lengths:
        raise ValueError(f"baseline: 'cp' splits the sequence inside attention blocks, and "
                         f"{graph.model_name} has none (a leaf module with heads, "
                         f"(batch, seq, hidden) out; register your own with "
                         f"strategies.register_attention); use 'ddp' or 'fsdp'")
    if len(lengths) > 1:
        raise ValueError(f"baseline: 'cp' needs one sequence length, {graph.model_name}'s "
                         f"attention blocks see {sorted(lengths)}")
    return lengths.pop()


def degrees(devices: int, batch: int, seq: int) -> list[int]:
    """The cp degrees of N devices: cp dividing N whose 2·cp chunks split the sequence,
    with the batch's rows split evenly over dp = N / cp. cp 1 is the family's plain end,
    every sequence whole on one device (data parallelism with these options, as
    torchtitan's "FSDP 8, CP 1" long-context run)."""
    return [cp for cp in range(1, devices + 1)
            if devices % cp == 0 and seq % (2 * cp) == 0 and batch % (devices // cp) == 0]


def why_not_split(graph: ModelGraph) -> str:
    """Why executor.context_parallel cannot run `graph` split by sequence, or "": an
    attention that is not plainly causal (an encoder's, a sliding window: its module's
    `is_causal`, `sliding_window`), or a padding mask among the inputs (a split sequence
    has no mask here)."""
    for layer in graph.layers:
        if is_attention(layer) and (layer.attrs.get("is_causal") is False
                                    or layer.attrs.get("sliding_window")):
            return f"{layer.name} is not plainly causal attention"
    if graph.example_kwargs.get("attention_mask") is not None:
        return "the batch has an attention_mask (padding)"
    return ""


def search_degrees(graph: ModelGraph, cluster: Cluster) -> list[int]:
    """The cp degrees above 1 the 3-D search offers for `graph` on `cluster` (module
    docstring): none for a model without one sequence length in its attention, or one the
    executor cannot split (`why_not_split`)."""
    try:
        seq = sequence_length(graph)
    except ValueError:
        return []
    if why_not_split(graph):
        return []
    return [cp for cp in degrees(cluster.num_devices, graph.batch_size, seq) if cp > 1]


def layer_options(layer: Layer, cp: int, sharded: bool | None = None) -> list[Strategy]:
    """A layer's options on one group of all devices split into dp x cp: attention under
    ContextParallel (its K/V gathered over the cp group), every other layer (an input too)
    on the rank's tokens; replicated (DDP over the group), FSDP2-sharded over it where a
    module has weights (`sharded` True), or both for the program to pick (None)."""
    if layer.is_input:
        return [TokenShard()]
    plain, fsdp = ((ContextParallel(degree=cp), ShardedContextParallel(degree=cp))
                   if is_attention(layer) else (TokenShard(), ShardedTokenShard()))
    can_shard = layer.param_bytes > 0 and layer.op == "call_module"
    if sharded is None:
        return [plain, fsdp] if can_shard else [plain]
    return [fsdp if sharded and can_shard else plain]


@dataclass(frozen=True)
class ContextGroup(OneGroup):
    """What one group of all devices offers under context parallelism of degree `cp`
    (`layer_options`, every layer: a tied embedding and head too, which run on the rank's
    tokens like any other layer); no layout changes between layers, so no edges."""

    cp: int = 2
    sharded: bool | None = None
    levers: bool = False
    layouts: bool = False

    def allowed(self, layer: Layer, options: list[Strategy], tied: bool) -> list[Strategy]:
        # a shared weight replicated (planner.ties): FSDP2 shards a module's own weights
        return layer_options(layer, self.cp, False if tied else self.sharded)


def all_sharded(layers) -> bool:
    """Whether a cp plan's `layers` (LayerPlans) shard every weight they hold (the plan's
    `ContextParallelPlan.sharded`, FSDP2 over the whole mesh); else executor.context_parallel
    shards those whose strategy or `dp_shard` says so (LayerPlan.shards_weights) and
    replicates the rest."""
    return all(l.shards_weights for l in layers if l.param_bytes > 0)


def mesh_plan(cluster: Cluster, cp: int) -> MeshPlan:
    """The ("dp", "cp") mesh: cp groups of consecutive ranks (inside a node where cp fits
    one), dp groups across them; executor.context_parallel builds it with these names."""
    n = cluster.num_devices
    dp = n // cp
    groups = {"cp": [list(range(d * cp, (d + 1) * cp)) for d in range(dp)],
              "dp": [list(range(c, n, cp)) for c in range(cp)]}
    links = {"cp": group_link(cluster, cp).name}
    if dp > 1:
        links["dp"] = group_link(cluster, n).name
    return MeshPlan(shape=[dp, cp], dim_names=["dp", "cp"], device_type=cluster.device.kind,
                    nodes=cluster.nodes, devices_per_node=cluster.devices_per_node,
                    groups=groups, group_links=links)
