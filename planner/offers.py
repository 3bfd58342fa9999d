"""Which of a layer's candidate strategies a plan offers (planner.search.build reads them).

Every shape offers what the executor runs: for a torch.export graph, only what the module
executor can run (`module_executor_options`). A plan over one group of all devices (the
shape pp = dp = 1, tp = N: planner.choices) offers more and less beside that, as `OneGroup`
says: the memory levers over the group (strategies.memory: fsdp, "+recompute"), a tie
group's common strategy chosen by the solver (or fixed, for a baseline), a baseline's
rule, and pins by exact name.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from planner import dp_shard, expert_degrees
from planner.pipeline.block_recompute import SUFFIX
from planner.ties import tied_allowed
from profiler.graph import Layer
from strategies.catalog import CostContext, Strategy
from strategies.layouts import Layout
from strategies.memory import pinned_recompute, with_memory_levers

OUTPUT = "(output)"  # the sink node: the model's outputs as the user gets them back


def module_executor_options(layer: Layer, options: list[Strategy],
                            sequence: bool = False) -> list[Strategy]:
    """For a graph from torch.export the executor runs the module's own forward, so the ops
    outside unit modules run on whatever each rank holds: the inputs come split by rows,
    and such an op is row-split wherever it can be; whole only when it does not see the
    batch at all (a constant such as a position table). `sequence`: keep the token splits
    too, for pricing a configuration that runs them (torchtitan's TP, whose blocks hand
    each other sequence shards: strategies.kernel_levers.Levers.sequence_parallel)."""
    # the model's own code holds module outputs split by rows: no token split survives it
    options = sequence_parallel_only(options) if sequence else [
        s for s in options if Layout.SEQUENCE not in (s.takes, s.gives)]
    if layer.is_input:
        return [s for s in options if s.name == "data_parallel"] or options
    if layer.op == "call_module":
        return options
    # feature-split only element-wise ops between modules (Llama's act(gate) * up, on the
    # local shards of its colwise Linears as torchtitan runs it): the model's own code may
    # view or permute any other tensor by its global sizes (a head count, a channels-last
    # permute), which a split breaks silently
    options = [s for s in options if s.name != "feature_parallel" or (
        layer.attrs.get("between_modules") and layer.kind != "flatten")] or options
    if not any(s.name == "data_parallel" for s in options):
        return options  # it does not see the batch: whole it is
    # rows split: a feature split would show the model's code whole rows
    return [s for s in options if s.name not in ("replicate", "feature_parallel")]


def sequence_parallel_only(options: list[Strategy]) -> list[Strategy]:
    """`options` as torchtitan's TP runs a Llama block (its apply_tp: SequenceParallel
    norms, RowwiseParallel with output_layouts Shard(1), the embedding's output Shard(1)):
    where a strategy has a variant that takes or gives the sequence layout, that variant
    only, and a norm or element-wise op that can run on the sequence shard does (not
    whole). A priced configuration, not a choice of the search."""
    def base(s: Strategy) -> str:
        return s.name.split("+")[0]
    split = {base(s) for s in options if Layout.SEQUENCE in (s.takes, s.gives)}
    if "sequence_parallel" in split:
        split.add("replicate")
    return [s for s in options
            if Layout.SEQUENCE in (s.takes, s.gives) or base(s) not in split]


@dataclass(frozen=True)
class OneGroup:
    """What a plan over one group of all devices offers. `levers`: the memory levers of
    strategies.memory too. `only`: just the strategies named in it (and `replicate` where
    none of them applies): how pure data parallelism is costed. `keep(layer, options)`:
    the options a baseline allows for a layer (planner.baseline). Neither applies to the
    layers of a shared parameter, held whole in every plan kind: the program picks which
    way for each tie group, or with `fixed_ties` runs planner.ties.tied_strategy's (a
    baseline that holds shared parameters as DDP does)."""

    levers: bool = True
    only: frozenset[str] | None = None
    keep: Callable[[Layer, list[Strategy]], list[Strategy]] | None = None
    fixed_ties: bool = False
    # layout changes between layers priced (edges); a context-parallel group has none:
    # each rank runs the model's code on its tokens (planner.context_degrees)
    layouts: bool = True

    def candidates(self, layer: Layer, options: list[Strategy], ctx: CostContext,
                   tracer: str, tied: bool) -> list[Strategy]:
        """The options of `layer` whatever its name (what planner.search.CostCache keeps
        per distinct layer): the levers, the module executor's rule (first: no baseline's
        rule may undo what it keeps), a shared parameter's rule."""
        if self.levers:
            options = with_memory_levers(layer, options, ctx)
        if tracer == "export":
            options = module_executor_options(layer, options,
                                              ctx.cluster.levers.sequence_parallel)
        return tied_allowed(options) if tied else options

    def allowed(self, layer: Layer, options: list[Strategy], tied: bool) -> list[Strategy]:
        """`options` kept to the baseline's rules (`only`, `keep`)."""
        if tied:
            return options
        if self.only is not None:
            kept = [s for s in options if s.name in self.only]
            options = kept or [s for s in options if s.name == "replicate"]
        if self.keep is not None:
            options = self.keep(layer, options)
        return options


def pinned(layer: Layer, options: list[Strategy], wanted: str, ctx: CostContext
           ) -> list[Strategy]:
    """The option of `options` named `wanted` (or its recomputed form where the cost model
    sees no saving: strategies.memory.pinned_recompute), or ValueError naming the rest."""
    kept = [s for s in options if s.name == wanted] or pinned_recompute(
        layer, options, wanted, ctx)
    if not kept:
        raise ValueError(f"pin: layer {layer.name!r} cannot use {wanted!r} on "
                         f"{ctx.ranks} devices; it can use "
                         f"{sorted({s.name for s in options})}")
    return kept


def missing_pins(layer_names, option_names, pin: dict[str, str] | None, tp: int) -> list[str]:
    """The exact pins ("layer: option") a shape of the 3-D search does not offer, its
    layers `layer_names` having the options `option_names` (a shape's Built): a shape
    that cannot run what the user pinned is no candidate, where before the pin was
    dropped on it and the plan ran something else. A class pin ("+fsdp", "+replicated")
    keeps what it finds; a recomputed option ("name+recompute") counts as its option."""
    if not pin:
        return []
    index = {name: i for i, name in enumerate(layer_names)}
    out = []
    for name, want in pin.items():
        want = expert_degrees.canonical(want, tp)
        if want.startswith("+") or want == dp_shard.REPLICATED or name not in index:
            continue
        offered = option_names[index[name]]
        if want not in offered and want + SUFFIX not in offered:
            out.append(f"{name}: {want}")
    return out
