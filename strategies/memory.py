"""Memory levers: sharded data parallelism (ZeRO-3 / FSDP2) and activation recomputation.

Both trade time for memory, and both are offered to the integer program as extra options
of a layer, priced like every other option, so the solver takes them only where memory
binds and they are the cheapest way to fit:

- `ShardedDataParallel` ("fsdp"): like data parallelism it takes and gives the batch split
  by rows, but the weights, their gradients and the optimizer state are split over the
  ranks (1/P each). The price: the weights are all-gathered before forward and again
  before backward (FSDP2 reshards after forward), and the gradients are reduce-scattered
  instead of all-reduced: 3(P-1)/P of the weights' bytes sent per rank against DDP's
  2(P-1)/P, 1.5x. On a GPU they run beside compute (strategies.overlap). The gathered
  weights of one layer (and its unsharded gradient before the reduce-scatter) live only
  while it runs; that transient is not in the per-layer sum (it is one layer's weights,
  not the model's).
- `Recompute(inner)`: the layer runs `inner` under `torch.utils.checkpoint`: it keeps only
  its input for backward instead of its own activations, and runs its forward once more
  in backward. Memory: `inner`'s activation bytes are replaced by its input's bytes;
  time: one more forward (FLOP share of forward in forward + backward).

`with_memory_levers` adds them to a layer's candidates (strategies.catalog.candidates
stays as it is); planner.offers calls it for a 1-D plan.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import ClassVar

from profiler.graph import Layer
from strategies.catalog import (
    Cost, CostContext, DataParallel, Strategy, compute_s, memory_s, update_s, weights_memory,
)
from strategies.collectives import all_reduce_s, collective_bytes, fsdp_layer_s
from strategies.layouts import Layout
from strategies.overlap import exposed_s, forward_share, fsdp_exposed_s

RECOMPUTE_SUFFIX = "+recompute"


@dataclass(frozen=True)
class ShardedDataParallel(DataParallel):
    """ZeRO-3 / FSDP2 `fully_shard` on this layer over the data-parallel group."""

    name: ClassVar[str] = "fsdp"
    shards_weights: ClassVar[bool] = True

    def applies(self, layer, ctx):
        # fully_shard wraps a module: a bare parameter read by an op has none to wrap
        return (layer.param_bytes > 0 and layer.op == "call_module" and ctx.ranks > 1
                and super().applies(layer, ctx))

    def cost(self, layer, ctx):
        p, precision = layer.param_bytes, ctx.precision
        # weights gathered in the param dtype, gradients reduced in the reduce dtype
        gathers, scatter = fsdp_layer_s(precision.gather_bytes(p), precision.reduce_bytes(p),
                                        ctx.ranks, ctx.link)
        copies = fsdp_copies_s(p, ctx.ranks, ctx.link, ctx)
        sent = (2 * collective_bytes("all_gather", precision.gather_bytes(p), ctx.ranks)
                + collective_bytes("reduce_scatter", precision.reduce_bytes(p), ctx.ranks))
        local = p / ctx.ranks
        memory = weights_memory(local, ctx, sharded=True) + layer.activation_bytes / ctx.ranks
        compute = compute_s(layer, 1 / ctx.ranks, ctx)
        # on a GPU a step waits only for what they take beyond the compute beside them
        share, cover = forward_share(layer.fwd_flops, layer.bwd_flops), ctx.cluster.overlap_cover
        waited = fsdp_exposed_s(gathers, scatter, compute, share, cover)
        reduce = exposed_s(0.0, all_reduce_s(precision.reduce_bytes(p), ctx.ranks, ctx.link),
                           compute, share, cover)
        return Cost(compute, waited + copies, memory, update_s(local, ctx),
                    {"param_all_gather_s": gathers, "gradient_reduce_scatter_s": scatter,
                     "beside_compute_s": gathers + scatter - waited,
                     "buffer_copies_s": copies, "communication_bytes": sent,
                     "saved_bytes": weights_memory(p, ctx)
                     - weights_memory(local, ctx, sharded=True),
                     "lever_s": waited + copies - reduce})


def fsdp_copies_s(param_bytes: float, ranks: int, link, ctx: CostContext) -> float:
    """FSDP2's copies around one layer's collectives for one microbatch: the gathered
    weights copied out of the all-gather's flat buffer (in forward and again in backward)
    and the gradients copied into the reduce-scatter's, a read and a write each. An older
    calibration's per-byte figure stands for them; a link where `hyplan calibrate` timed
    whole FSDP layers ("fsdp_layer") holds them in its fit."""
    if ranks <= 1 or param_bytes <= 0:
        return 0.0
    if ctx.cluster.fsdp_overhead_s_per_byte:
        return ctx.cluster.fsdp_overhead_s_per_byte * param_bytes
    if "fsdp_layer" in link.collectives:
        return 0.0
    p = ctx.precision
    return memory_s(2 * (2 * p.gather_bytes(param_bytes) + p.reduce_bytes(param_bytes)), ctx)


def weights_part(inner: Strategy, layer: Layer, ctx: CostContext) -> float:
    """The part of `inner`'s memory that is weights, gradients and optimizer state."""
    sharded = inner.shards_weights
    split = inner.model_parallel or sharded
    return weights_memory(layer.param_bytes / (ctx.ranks if split else 1), ctx, sharded)


def activation_part(strategy: Strategy, layer: Layer, cost: Cost, ctx: CostContext) -> float:
    """What `cost` (of `strategy` on `layer`) prices as kept for backward: its memory less
    its weights, gradients and optimizer state (weights_part; a Recompute's, its inner
    strategy's)."""
    inner = getattr(strategy, "inner", strategy)
    return cost.memory_bytes - weights_part(inner, layer, ctx)


def input_bytes(layer: Layer, inner: Strategy, ctx: CostContext) -> float:
    """Bytes of the input a checkpointed layer keeps on each rank: its output's size scaled
    by in/out features for a Linear-like layer, split when it takes rows (or tokens)."""
    out_features = layer.attrs.get("out_features", layer.attrs.get("nf"))
    in_features = layer.attrs.get("in_features", layer.attrs.get("nx"))
    whole = layer.output.nbytes
    if out_features and in_features:
        whole = whole * in_features / out_features
    return whole / ctx.ranks if inner.takes in (Layout.BATCH, Layout.SEQUENCE) else whole


def recompute_s(layer: Layer, compute_s: float) -> float:
    """The extra forward a checkpointed layer runs in backward: its forward's FLOP share
    of `compute_s` (forward + backward), a third when the layer records no FLOPs."""
    total = layer.fwd_flops + layer.bwd_flops
    return compute_s * (layer.fwd_flops / total if total else 1 / 3)


@dataclass(frozen=True)
class Recompute(Strategy):
    """`inner` under activation checkpointing (torch.utils.checkpoint around the module)."""

    inner: Strategy = DataParallel()

    def __post_init__(self):
        object.__setattr__(self, "takes", self.inner.takes)
        object.__setattr__(self, "gives", self.inner.gives)

    @property
    def name(self) -> str:  # type: ignore[override]
        return self.inner.name + RECOMPUTE_SUFFIX

    @property
    def model_parallel(self) -> bool:  # type: ignore[override]
        return self.inner.model_parallel

    @property
    def shards_weights(self) -> bool:  # type: ignore[override]
        return self.inner.shards_weights

    def applies(self, layer, ctx):
        return layer.op == "call_module" and self.inner.applies(layer, ctx)

    def cost(self, layer, ctx):
        base = self.inner.cost(layer, ctx)
        activations = activation_part(self.inner, layer, base, ctx)
        kept = input_bytes(layer, self.inner, ctx)
        extra = recompute_s(layer, base.compute_s)
        notes = dict(base.notes, recompute_saved_bytes=activations - kept, recompute_s=extra,
                     saved_bytes=base.notes.get("saved_bytes", 0.0) + activations - kept,
                     lever_s=base.notes.get("lever_s", 0.0) + extra)
        return replace(base, compute_s=base.compute_s + extra,
                       memory_bytes=base.memory_bytes - activations + kept, notes=notes)


def with_memory_levers(layer: Layer, options: list[Strategy], ctx: CostContext,
                       recompute: bool = True) -> list[Strategy]:
    """`options` plus fsdp (where the layer has weights and is data-parallel) and, when
    `recompute`, each option under recomputation where that saves memory. An option under
    recomputation that saves nothing is always worse, so it is not offered."""
    if layer.is_input or ctx.ranks == 1:
        return options
    out = list(options)
    if any(s.name == "data_parallel" for s in options):
        sharded = ShardedDataParallel()
        if sharded.applies(layer, ctx):
            out.append(sharded)
    if recompute and layer.op == "call_module":
        for s in list(out):
            if s.name == "replicate" or isinstance(s, Recompute):
                continue
            r = Recompute(inner=s)
            if r.applies(layer, ctx) and r.cost(layer, ctx).notes["recompute_saved_bytes"] > 0:
                out.append(r)
    return out


def split_name(strategy: str) -> tuple[str, bool]:
    """("fsdp", True) for "fsdp+recompute": the strategy the executor applies and whether
    the layer is checkpointed."""
    if strategy.endswith(RECOMPUTE_SUFFIX):
        return strategy[: -len(RECOMPUTE_SUFFIX)], True
    return strategy, False


def pinned_recompute(layer: Layer, options: list[Strategy], wanted: str,
                     ctx: CostContext) -> list[Strategy]:
    """A pin may ask for recomputation where the cost model sees no saving (it is then
    never chosen on its own): [Recompute(inner)] when `wanted` is "inner+recompute"."""
    inner, recompute = split_name(wanted)
    found = [Recompute(inner=s) for s in options if s.name == inner and recompute]
    return [r for r in found if r.applies(layer, ctx)]
