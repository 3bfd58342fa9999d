"""FSDP and HSDP over the data-parallel group as per-layer options of the 3-D search.

A layer that runs strategy s over its tp group is normally replicated over the dp group:
every dp replica keeps the whole tp shard of its weights, gradients and optimizer state and
the gradients are all-reduced over dp once per step. Its sharded variant ("s+fsdp") is FSDP2
`fully_shard` of the layer's module over the dp sub-mesh (beside DTensor tensor parallelism
over the tp sub-mesh: a 2-D (dp, tp) mesh, as torchtitan runs Llama): weights, gradients
and optimizer state are 1/dp of the tp shard.

Its price, as executor.pipeline runs it: FSDP2 with reshard_after_forward=True gathers the
weights before each microbatch's forward and again before its backward, and a backward
reduce-scatters the gradient at once (inside a pipeline schedule or the microbatch loop,
no `no_sync` is in force), so per microbatch: 2 all-gathers + 1 reduce-scatter + the
flat-buffer copies (strategies.memory.fsdp_copies_s); per step only the optimizer on the
shard. The all-reduce over dp is gone. On a GPU the gathers and the scatter run beside
compute (strategies.overlap): a microbatch waits only for what they take beyond it. The
gathered weights of one layer live only while it runs: the transient is one layer's, not
in the per-layer sum (as strategies.memory).

Offered where fully_shard can run it: a module (call_module) with weights, not sharing a
parameter, dp > 1, and not for strategies whose gradients are summed over dp x tp (data or
sequence parallel inside a tp group larger than one: their weights are replicated over tp
too, which a dp-only shard does not cover). In a torch.export graph the layer must be one
module of the model, named by its path, whose weights are all its own (executor.hf_stages
shards that module of the stage it builds; a layer that also reads a bare parameter, or a
second call of a module, is not offered).

HSDP ("s+hsdp") is the same shard kept inside a node: when the dp group spans nodes and a
node holds more than one of its ranks, the weights are sharded over the dp ranks of one
node (shard size = dp ranks per node) and replicated across nodes, as FSDP2 runs it on a
2-D (replicate, shard) mesh. The per-microbatch all-gathers and reduce-scatters then travel
the intra-node link, and the gradient shard is all-reduced across nodes once per step
(executor.pipeline asks FSDP2 for that all-reduce on the last microbatch only). It keeps
more memory than fsdp (1/shard of the tp shard, not 1/dp) and moves fewer bytes over the
slow link per microbatch: the trade a node boundary makes worth pricing.
"""

from __future__ import annotations

from dataclasses import dataclass

from profiler.graph import Layer
from strategies.catalog import CostContext, update_s, weights_memory
from strategies.collectives import all_reduce_s, fsdp_layer_s
from strategies.context import TOKEN_SPLIT
from strategies.devices import LinkSpec
from strategies.memory import fsdp_copies_s
from strategies.overlap import exposed_s, fsdp_exposed_s

SUFFIX = "+fsdp"
HSDP_SUFFIX = "+hsdp"
# a pin (planner.search.build), not a suffix: every option replicated over dp, none of
# its sharded variants (DDP over dp, the strategy over tp left free)
REPLICATED = "+replicated"
SUMMED_OVER_TP = ("data_parallel", "sequence_parallel", *TOKEN_SPLIT)


@dataclass(frozen=True)
class ShardedPrice:
    """One layer's sharded variant: per-microbatch and per-step seconds, bytes per device."""

    microbatch_s: float  # the base option's per-microbatch time + gathers and scatter
    step_s: float  # the optimizer on the shard (no all-reduce)
    weight_bytes: float  # weights, gradients, optimizer state: 1/dp of the tp shard
    local_param_bytes: float
    gather_s: float  # both all-gathers of one microbatch
    scatter_s: float  # the reduce-scatter of one microbatch


def offered(layer: Layer, strategy: str, dp: int, tp: int, tracer: str, tied: bool) -> bool:
    """Whether the search offers `strategy`+fsdp for `layer` (module docstring)."""
    return (dp > 1 and layer.param_bytes > 0 and layer.op == "call_module" and not tied
            and not layer.is_input and (tracer != "export" or _own_module(layer))
            and not (tp > 1 and strategy in SUMMED_OVER_TP))


def hsdp_split(dp: int, tp: int, devices_per_node: int) -> tuple[int, int] | None:
    """(replicate, shard) sizes of a dp group whose ranks are dp·tp consecutive ranks
    (planner.search.rank_groups): shard = the dp ranks of one node. None where HSDP does
    not apply: the group fits in a node, a node holds one dp rank, or nodes do not hold
    whole tp groups."""
    if dp * tp <= devices_per_node or devices_per_node % tp:
        return None
    shard = devices_per_node // tp
    if shard < 2 or dp % shard:
        return None
    return dp // shard, shard


def gathered_over(suffix: str, dp: int, tp: int, devices_per_node: int) -> int:
    """How many shards an option with `suffix` gathers in its forward and backward: 0
    where it is not sharded, dp for FSDP, a node's dp ranks for HSDP."""
    if suffix == SUFFIX:
        return dp
    if suffix == HSDP_SUFFIX:
        split = hsdp_split(dp, tp, devices_per_node)
        return split[1] if split else dp
    return 0


def variants(layer: Layer, strategy: str, dp: int, tp: int, tracer: str, tied: bool,
             devices_per_node: int) -> list[str]:
    """The suffixes of the sharded variants the search offers for `strategy` on `layer`:
    "+fsdp" where `offered`, and "+hsdp" too where the dp group also spans nodes."""
    if not offered(layer, strategy, dp, tp, tracer, tied):
        return []
    return [SUFFIX] + ([HSDP_SUFFIX] if hsdp_split(dp, tp, devices_per_node) else [])


def _own_module(layer: Layer) -> bool:
    """An export layer that is one module's call whose parameters are all that module's:
    its name is the module path (a second call is "path#2")."""
    return "#" not in layer.name and all(p.startswith(layer.name + ".") for p in layer.params)


def price(param_local_bytes: float, base_microbatch_s: float, dp: int, link: LinkSpec,
          ctx: CostContext, compute_s: float, share: float) -> ShardedPrice:
    """The sharded variant of an option whose tp shard holds `param_local_bytes` of
    weights and costs `base_microbatch_s` per microbatch, `compute_s` of it compute
    (`share` forward: what runs beside the gathers and the scatter on a GPU,
    strategies.overlap), over a dp group on `link`."""
    precision = ctx.precision
    gather, scatter = fsdp_layer_s(precision.gather_bytes(param_local_bytes),
                                   precision.reduce_bytes(param_local_bytes), dp, link)
    copies = fsdp_copies_s(param_local_bytes, dp, link, ctx)
    shard = param_local_bytes / dp
    waited = fsdp_exposed_s(gather, scatter, compute_s, share, ctx.cluster.overlap_cover)
    return ShardedPrice(microbatch_s=base_microbatch_s + waited + copies,
                        step_s=update_s(shard, ctx),
                        weight_bytes=weights_memory(shard, ctx, sharded=True),
                        local_param_bytes=shard, gather_s=gather, scatter_s=scatter)


def price_hsdp(param_local_bytes: float, base_microbatch_s: float, dp: int, tp: int,
               ctx: CostContext, compute_s: float, share: float) -> ShardedPrice:
    """The HSDP variant of an option (module docstring): per microbatch the gathers and the
    scatter over the shard group on the intra-node link, per step the optimizer on the
    shard and one all-reduce of the gradient shard over the replicas on the inter-node link
    (on a GPU each beside the layer's compute as `price` says; the all-reduce beside one
    microbatch's backward, the last)."""
    cluster, precision = ctx.cluster, ctx.precision
    replicas, shard_ranks = hsdp_split(dp, tp, cluster.devices_per_node)
    inside, across = cluster.intra_node, cluster.inter_node
    gather, scatter = fsdp_layer_s(precision.gather_bytes(param_local_bytes),
                                   precision.reduce_bytes(param_local_bytes), shard_ranks, inside)
    copies = fsdp_copies_s(param_local_bytes, shard_ranks, inside, ctx)
    shard = param_local_bytes / shard_ranks
    sync = all_reduce_s(precision.reduce_bytes(shard), replicas, across)
    cover = cluster.overlap_cover
    waited = fsdp_exposed_s(gather, scatter, compute_s, share, cover)
    return ShardedPrice(microbatch_s=base_microbatch_s + waited + copies,
                        step_s=update_s(shard, ctx) + exposed_s(0.0, sync, compute_s, share,
                                                                cover),
                        weight_bytes=weights_memory(shard, ctx, sharded=True),
                        local_param_bytes=shard, gather_s=gather, scatter_s=scatter)


def price_variant(suffix: str, param_local_bytes: float, base_microbatch_s: float, dp: int,
                  tp: int, link: LinkSpec, ctx: CostContext, compute_s: float,
                  share: float) -> ShardedPrice:
    """`price` for "+fsdp" (over a dp group on `link`), `price_hsdp` for "+hsdp"."""
    if suffix == HSDP_SUFFIX:
        return price_hsdp(param_local_bytes, base_microbatch_s, dp, tp, ctx, compute_s, share)
    return price(param_local_bytes, base_microbatch_s, dp, link, ctx, compute_s, share)


def split(option: str) -> tuple[str, str]:
    """("column_parallel", "+fsdp") for "column_parallel+fsdp", ("replicate", "") for
    "replicate"."""
    for suffix in (SUFFIX, HSDP_SUFFIX):
        if option.endswith(suffix):
            return option[: -len(suffix)], suffix
    return option, ""
