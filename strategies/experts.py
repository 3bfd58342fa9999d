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
from strategies.collectives import all_to_all_s, collective_bytes
from strategies.layouts import Layout

INDEX_BYTES = 8  # an int64 expert id per dispatched pair


@dataclass(frozen=True)
class ExpertParallel(Strategy):
    """The experts split over the group (ep = its ranks), tokens dispatched to the ranks
    holding their experts and combined back by all-to-all. Takes and gives each rank's
    rows, like data parallelism; no gradient sync (each expert's gradient is complete on
    its one rank, every token that used it having come there)."""

    name: ClassVar[str] = "expert_parallel"
    model_parallel: ClassVar[bool] = True
    takes: Layout = Layout.BATCH
    gives: Layout = Layout.BATCH

    def applies(self, layer: Layer, ctx: CostContext) -> bool:
        experts = _experts(layer)
        return (ctx.ranks > 1 and experts > 0 and experts % ctx.ranks == 0
                and ctx.batch % ctx.ranks == 0 and layer.output.has_rows(ctx.batch))

    def cost(self, layer: Layer, ctx: CostContext) -> Cost:
        ep = ctx.ranks
        top_k = layer.attrs.get("top_k", 1)
        tokens = layer.output.shape[0] if layer.output.shape else 0
        # every (token, expert) pair of the whole batch, hidden-sized: what is dispatched
        dispatched = layer.output.nbytes * top_k
        ids = tokens * top_k * INDEX_BYTES
        # dispatch and combine in forward, their gradients in backward; the expert ids and
        # the per-rank counts ahead of the dispatch
        moves = 4 * all_to_all_s(dispatched, ep, ctx.link)
        index = all_to_all_s(ids, ep, ctx.link) + all_to_all_s(INDEX_BYTES * ep * ep, ep, ctx.link)
        # uniform routing: each rank runs tokens·k/ep pairs over its E/ep experts, 1/ep of
        # the layer's work
        compute = compute_s(layer, 1 / ep, ctx)
        local = layer.param_bytes / ep
        # the pairs it receives (input and output) beside its own rows' output
        activations = layer.output.nbytes / ep * (1 + 2 * top_k)
        sent = (4 * collective_bytes("all_to_all", dispatched, ep)
                + collective_bytes("all_to_all", ids, ep))
        return Cost(compute, moves + index, weights_memory(local, ctx) + activations,
                    update_s(local, ctx),
                    {"all_to_all_s": moves + index, "dispatched_bytes": dispatched,
                     "all_to_all_priced_by": _priced_by(ctx),
                     "communication_bytes": sent, "experts_per_rank": _experts(layer) // ep})


def _priced_by(ctx: CostContext) -> str:
    """Where the all-to-all's price comes from, for explain(): a fit `hyplan calibrate`
    measured on this link, or the link's own latency and bandwidth (as an uncalibrated
    all-gather is priced: GPU links until nccl-tests figures are added)."""
    if "all_to_all" in ctx.link.collectives:
        return "calibrated all-to-all fit"
    return "link latency and bandwidth (no calibrated all-to-all)"


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
        register(module_type, ExpertParallel(), rowwise=True)
    for module_type in set(blocks) - _FOUND:
        register(module_type, rowwise=True)
    _FOUND.update(routed + blocks)


_FOUND: set[type] = set()  # registered once, however many models are planned


find_units(register_experts)
