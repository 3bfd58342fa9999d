"""Expert parallelism: a mixture-of-experts block's experts split over the ranks.

transformers 5.x writes every mixture-of-experts family (Mixtral, Qwen2/3-MoE, DeepSeek-V3,
gpt-oss) with one experts module: weights stacked per expert (experts x out x in), called
`experts(hidden_states, top_k_index, top_k_weights)` (profiler.export_trace.routes_tokens
finds it by that shape). Its tokens are independent of each other, so it is one row-wise
unit (data parallel, FSDP, replicated like any layer); and it may run expert parallel, as
GShard and torchtitan do: rank r holds experts [r·E/P, (r+1)·E/P), each rank sends every
(token, chosen expert) pair to the rank holding that expert (an all-to-all), the experts
run on what they received, and a second all-to-all brings the outputs back to the token's
rank, which weights and sums them (executor.experts).

A user with an experts block of their own (an fx model, say) offers the same with

    register(MyExperts, ExpertParallel(), rowwise=True, leaf=True)

where `MyExperts.forward(hidden_states, top_k_index, top_k_weights)` runs whichever
experts it holds (`num_experts` of them, its weights' dim 0) on the pairs it is handed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from torch import nn

from profiler.export_trace import experts_units
from profiler.graph import Layer
from strategies.catalog import (
    CostContext, Cost, Strategy, compute_s, find_units, register, update_s, weights_memory,
)
from strategies.collectives import all_reduce_s, all_to_all_s, collective_bytes, fsdp_layer_s
from strategies.layouts import Layout

INDEX_BYTES = 8  # an int64 expert id per dispatched pair


@dataclass(frozen=True)
class ExpertParallel(Strategy):
    """The experts split over an EP group, tokens dispatched to the ranks holding their
    experts and combined back by all-to-all. Takes and gives each rank's rows, like data
    parallelism.

    `ep` 0 (the default): the EP group is the whole group, and no gradient sync follows
    (each expert's gradient is complete on its one rank, every token that used it having
    come there). `ep` d below the world's ranks: the EP group is carved out of the
    data-parallel ranks as torchtitan does, a (dp, ep) mesh of world/d x d ranks, EP groups
    of d consecutive ranks; each expert is held by the dp = world/d ranks of one column,
    whose gradients are summed over them, or, with `shard`, FSDP2-sharded over them
    (weights gathered in forward and backward, gradients reduce-scattered).

        ExpertParallel()                   # ep = every rank
        ExpertParallel(ep=2)               # ep 2 x dp world/2, experts replicated over dp
        ExpertParallel(ep=2, shard=True)   # ... and FSDP-sharded over dp
    """

    ep: int = 0
    shard: bool = False
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.BATCH
    gives: Layout = Layout.BATCH

    def __post_init__(self):
        if self.ep < 0 or self.ep == 1 or (self.shard and not self.ep):
            raise ValueError(f"ExpertParallel: ep={self.ep}, shard={self.shard}: ep is 0 (every "
                             f"rank) or a degree of 2 or more, and shard needs a degree")

    @property
    def name(self) -> str:  # type: ignore[override]
        return strategy_name(self.ep, self.shard)

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        experts, ep = _experts(layer), self.ep or ctx.ranks
        carved = not self.ep or (
            # carved out of the whole world's data-parallel ranks: a 1-D plan's group
            ctx.ranks == ctx.cluster.num_devices and ep < ctx.ranks and ctx.ranks % ep == 0)
        return (ctx.ranks > 1 and carved and experts > 0 and experts % ep == 0
                and ctx.batch % ctx.ranks == 0 and layer.output.has_rows(ctx.batch))

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        ep = self.ep or ctx.ranks
        dp = ctx.ranks // ep
        link = ctx.cluster.link(ep)  # ep consecutive ranks
        top_k = layer.attrs.get("top_k", 1)
        tokens = (layer.output.shape[0] if layer.output.shape else 0) / dp
        # every (token, expert) pair of the EP group's rows, hidden-sized: what it dispatches
        dispatched = layer.output.nbytes * top_k / dp
        ids = tokens * top_k * INDEX_BYTES
        # dispatch and combine in forward, their gradients in backward; the expert ids and
        # the per-rank counts ahead of the dispatch
        moves = 4 * all_to_all_s(dispatched, ep, link)
        index = all_to_all_s(ids, ep, link) + all_to_all_s(INDEX_BYTES * ep * ep, ep, link)
        # uniform routing: each rank runs tokens·k/world pairs over its E/ep experts, 1/world
        # of the layer's work, and casts only the weights it holds (a "shard" split: on a
        # GPU, DeepSeek-V3's 45 GB of experts cast per microbatch was 0.09 s of 0.11)
        compute = compute_s(layer, 1 / ctx.ranks, ctx, split="shard")
        local = layer.param_bytes / ep
        sync, sync_sent, held = self._over_dp(local, dp, ctx)
        # the pairs it receives (input and output) beside its own rows' output
        activations = layer.output.nbytes / ctx.ranks * (1 + 2 * top_k)
        sent = (4 * collective_bytes("all_to_all", dispatched, ep)
                + collective_bytes("all_to_all", ids, ep) + sync_sent)
        return Cost(compute, moves + index + sync,
                    weights_memory(held, ctx, sharded=self.shard) + activations,
                    update_s(held, ctx),
                    {"all_to_all_s": moves + index, "dispatched_bytes": dispatched,
                     "expert_sync_s": sync, "ep": ep, "expert_dp": dp,
                     "all_to_all_priced_by": _priced_by(link),
                     "communication_bytes": sent, "experts_per_rank": _experts(layer) // ep})

    def _over_dp(self, local: float, dp: int, ctx: CostContext) -> tuple[float, float, float]:
        """(seconds, bytes sent, bytes held) of one rank's expert shard over the dp ranks
        that share it (strided over the whole world): an all-reduce of its gradient, or
        with `shard` FSDP2's two gathers and reduce-scatter of 1/dp of it held."""
        if dp <= 1:
            return 0.0, 0.0, local
        link, precision = ctx.cluster.link(ctx.ranks), ctx.precision
        if not self.shard:
            grads = precision.reduce_bytes(local)
            return (all_reduce_s(grads, dp, link),
                    collective_bytes("all_reduce", grads, dp), local)
        gather, reduce = precision.gather_bytes(local), precision.reduce_bytes(local)
        gathers, scatter = fsdp_layer_s(gather, reduce, dp, link)
        sent = (2 * collective_bytes("all_gather", gather, dp)
                + collective_bytes("reduce_scatter", reduce, dp))
        return gathers + scatter, sent, local / dp


def strategy_name(ep: int = 0, shard: bool = False) -> str:
    """The plan's name of an expert-parallel strategy, which the executor reads its degree
    from: "expert_parallel" (ep = every rank), "expert_parallel:ep2", "expert_parallel:ep2:fsdp"."""
    return NAME + (f":ep{ep}" if ep else "") + (":fsdp" if shard else "")


def parse_name(name: str) -> tuple[int, bool] | None:
    """(ep, shard) of an expert-parallel strategy's name (ep 0: every rank), None for
    another strategy's."""
    base, *options = name.split(":")
    if base != NAME:
        return None
    ep = next((int(o[2:]) for o in options if o.startswith("ep")), 0)
    return ep, "fsdp" in options


def is_expert_parallel(name: str) -> bool:
    return parse_name(name) is not None


NAME = "expert_parallel"
# the degrees carved out of the data-parallel ranks that are offered beside ep = every
# rank, each replicated or FSDP-sharded over the dp ranks left over
DEGREES = (2, 4, 8, 16, 32, 64)
OFFERED = (ExpertParallel(),) + tuple(ExpertParallel(ep=d, shard=s)
                                      for d in DEGREES for s in (False, True))


def _priced_by(link) -> str:
    """Where the all-to-all's price comes from, for explain(): a fit `hyplan calibrate`
    measured (or nccl-tests published, strategies.devices) for this link, or the link's own
    latency and bandwidth."""
    if "all_to_all" in link.collectives:
        return "all-to-all fit of the link"
    return "link latency and bandwidth (no all-to-all fit)"


def _experts(layer: Layer) -> int:
    """How many experts the layer holds: its weights' dim 0 (profiler.export_trace), or
    the module's own `num_experts` (an fx block registered by its user)."""
    return layer.attrs.get("experts") or layer.attrs.get("num_experts", 0)


def register_experts(model: nn.Module) -> None:
    """Register the experts modules of `model` (and the blocks around dense-routed ones,
    Llama 4's) as row-wise units, the routed ones with expert parallelism: called by
    strategies.catalog.unit_types before the tracer keeps them whole."""
    routed, blocks = experts_units(model)
    for module_type in set(routed) - _FOUND:
        register(module_type, *OFFERED, rowwise=True)
    for module_type in set(blocks) - _FOUND:
        register(module_type, rowwise=True)
    _FOUND.update(routed + blocks)


_FOUND: set[type] = set()  # registered once, however many models are planned


find_units(register_experts)
