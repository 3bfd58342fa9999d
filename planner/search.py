"""The 3-D search: pipeline x data x tensor x context parallel, microbatches and schedule.

For every factorization of the device count into pp x dp x tp, every microbatch count m
that splits each replica's rows evenly, and both schedules, `planner.pipeline.stages` cuts the
layers into pp contiguous stages and picks each layer's strategy over its tp group. For a
model with causal attention, every context-parallel degree cp is a shape too (Shape.cp:
one group of all devices split into dp x cp, each sequence over cp ranks; its program
picks each layer's weights, replicated or FSDP2-sharded, and each block's recomputation;
planner.context_degrees), ranked, bounded and solved with the rest. Ranks
are laid out (pp, dp, tp) with tp innermost, so a tp group is consecutive devices and stays
inside a node whenever tp divides the devices per node; dp and pp groups span more devices
and take the inter-node link when they cross nodes. Costs follow from that placement: a
tp group that spans nodes pays the inter-node link on every collective.

Keeping it fast as the space widens:
- per-layer costs are computed once per (tp, rows per microbatch) and shared by identical
  layers (a transformer's blocks), edge matrices likewise;
- GPipe is never faster than 1F1B (their simulations: the same bubble with balanced
  stages, less with unbalanced ones for 1F1B) and keeps more activations: it is dominated
  and never solved where 1F1B runs (1F1B needs m >= pp);
- the schedules with chunks per rank (interleaved, zero-bubble, DualPipeV) are candidates
  of their own, each priced by simulating its action list (planner.pipeline.schedules), which is
  done only for those a bound does not rule out; they come after every one-chunk shape,
  each with a quick plan (planner.pipeline.stages.quick_plan, not a proof), and only the best of
  those gets a short stage MIP (their MIPs are the hardest, and rarely better in seconds);
  before its quick plan, and again at the end for those still open (least bound first),
  each meets the busiest rank's work over contiguous cuts of whole units
  (planner.pipeline.stage_loads), which settles those it lifts to the best and narrows the gap
  (on a 48-block GPT over 64 A100s, with the pigeonhole bound on whole units in the
  chunked bound itself: 8.6%, where sharing the work evenly said 24%);
- a shape whose smallest possible memory exceeds the budget is dropped unsolved;
- the rest are solved one-stage shapes first (their solvers are the fastest, and their
  best cuts off every pipelined shape), then in order of a lower bound, each with the
  incumbent as cutoff, and a shape whose bound is no better than the incumbent is pruned
  unsolved; each gets a few seconds first, and only what is still open and could beat the
  best gets the full time limit afterwards, cut off at the best (so a hard shape met early
  costs seconds); `search_time_s` ends it early with the gap to what is left, and
  shares it: the first pass stops at half of it (what it did not reach comes first in the
  second), so that the chunked schedules' quick plans and bounds come in any case.

Every search ends: by default within DEFAULT_SEARCH_TIME_S, the whole search, not only the
solves after a first plan. A search that has no plan when its time runs out takes the
quick plans of the candidates left, best bound first (stages.quick_plan: a fraction of a
second each), for at most FALLBACK_S, and hands back the best with its gap (none found:
no plan, and the caller says so). `search_time_s=None` runs the search to its end, however
long it takes: the proof, but for chunked candidates dropped on their estimate.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field, replace

import numpy as np

from planner import context_degrees, dp_shard, expert_degrees
from planner.pipeline import block_recompute, schedules
from planner.block_cuts import (
    BEFORE, block_units, carries_weights, tied_heads, why_no_blocks,
)
from planner.cycle_collector import older_objects_frozen
from planner.offers import OUTPUT, OneGroup, missing_pins, module_executor_options, pinned
from planner.price import (
    EdgeKind, Price, edge_cost, edge_kind, group_link, in_rhythm, layer_compute_s,
    output_kind, price, tp_context, with_tied_copy,
)
from planner.problem import Edge
from planner.progress import Progress, listened, report
from planner.pipeline.schedules import SCHEDULES, V_SHAPED, chunks_allowed, refusal
from planner.pipeline.stage_held import peak_bytes
from planner.pipeline.stage_loads import busiest_rank_bound, memory_bound
from planner.pipeline.stage_paths import HELD_MIP_S, path_bound, relaxed_path_bound
from planner.pipeline.stages import (
    LayerOptions, StageProblem, StageSolution, TimeLimit, estimate, in_flight, lower_bound,
    min_memory_bytes, quick_plan, solve_stages,
)
from planner.per_object import once_per_object
from planner.ties import tie_groups, tied_allowed, tied_strategy
from profiler.graph import Layer, ModelGraph
from profiler.traffic import scaled_rows
from strategies.catalog import CostContext, candidates
from strategies.cluster import Cluster
from strategies.collectives import send_recv_s
from strategies.layouts import Layout
from strategies.step_memory import pipeline_buffer_bytes, summed_temp_bytes

FIRST_PASS_S = 5.0  # seconds per candidate in the search's first pass
# ... and at most this share of a budgeted search's time each, so that the chunked
# schedules' quick plans and bounds come before the budget ends (a 70 B Llama over 256
# H100s: nine one-chunk shapes at 5 s each left none for them, and the best plan was 22%
# slower than the one they find)
FIRST_PASS_SHARE = 1 / 30
CHUNKED_PASS_S = 2.0  # seconds for a chunked stage MIP (one pass only): started from its
# quick plan, it improved none of those on the 48-block GPT and GPT-2 XL in 5 s, and small
# problems prove in well under it
CHUNKED_TRIES = 1  # chunked candidates whose stage MIP runs: the best quick plans
QUICK_PASS_S = 3.0  # seconds for quick plans of chunked candidates (stages.quick_plan),
# or half of what a budgeted search has left where that is more
# seconds for the stage MIP of an open chunked candidate with no plan (_refine_chunked)
PROOF_S = 5.0
REFINE = 5e-3  # relative width to which open chunked bounds are refined at the end
# of a search's budget, kept for that refining: a 405 B Llama over 512 H100s needs some 9 s
# of its 60 for the five V-shaped pipelines its gap is made of (their memory MIPs)
REFINE_SHARE = 0.25
# actions (stages x microbatches x 3) up to which a chunked candidate's bound is raised by
# stage_paths.relaxed_path_bound: 0.1 s at 1,536 (pp 8 x 2 chunks x 16 microbatches on a
# 70 B Llama), 3 s at 6,144
RELAXED_ACTIONS = 2048
# ... and at the end, on the open candidates that the gap is made of, least bound first,
# while the budget lasts (a linear program of 6,144 actions takes some 2.5 s)
REFINE_ACTIONS = 8192
# ... its second memory row's MIP run to this at most, half of what is left (a 405 B Llama's
# pp 16 ZBV: 74.9 s after 1 s, 81.5 s proven in 5.4 s)
REFINE_MIP_S = 6.0
ACTIONS_PER_S = 2000  # what that program's size takes at most, on this count
# A search's default budget in seconds (planner.optimize's search_time_s): the 70 B and
# 405 B Llama presets on 32 and 64 nodes of 8 H100 plan in about a minute on 2 cores with
# it; proving their optimum took about 20 minutes. None asks for the proof.
DEFAULT_SEARCH_TIME_S = 60.0
FALLBACK_S = 10.0  # at most this long for quick plans when the budget ends with none
# solves of a shape again in less room where its plan holds more than the budget beside
# the stage rows (_Search.refit)
REFITS = 3
REFIT_MARGIN = 0.002  # of the budget, beside the excess, taken off a shape refit solves again


@dataclass(frozen=True)
class Shape:
    """One candidate: the mesh (pp, dp, tp), microbatches, schedule and its chunks (virtual
    stages) per pipeline rank."""

    pp: int
    dp: int
    tp: int
    microbatches: int
    schedule: str
    chunks: int = 1
    # blocks may be checkpointed, the solve picks which (planner.pipeline.block_recompute)
    recompute: bool = False
    # with recompute: every block checkpointed, not the solve's pick (a job's "full"
    # activation checkpointing: planner.price_job)
    recompute_all: bool = False
    # context parallelism: the one group of all devices (pp = dp = 1, tp = N, as a 1-D
    # plan) split into N/cp replicas of cp ranks, each sequence over cp of them
    # (planner.context_degrees); 1: none
    cp: int = 1

    def degrees(self) -> tuple[int, int, int]:
        """(pp, dp, tp) as a user reads them: a cp shape's dp is N / cp, and it has no
        tensor parallelism (its tp field is the one group of all N devices)."""
        if self.cp > 1:
            return self.pp, self.tp // self.cp, 1
        return self.pp, self.dp, self.tp

    def rows(self, batch: int) -> int:
        """Rows per microbatch per dp replica."""
        return batch // (self.dp * self.microbatches)

    def flights(self) -> tuple[int, ...]:
        """Per global stage, the microbatches whose activations it holds at once
        (planner.pipeline.stages.in_flight)."""
        return tuple(in_flight(self.schedule, self.pp, self.microbatches, k, self.chunks)
                     for k in range(self.pp * self.chunks))


@dataclass
class Candidate:
    shape: Shape
    # best | solved | pruned_by_bound | does_not_fit | dominated | infeasible | time_limit
    # | skipped (not solved and not ruled out by a bound: chunked estimates, an interrupt)
    outcome: str
    bound_s: float | None = None
    solution: StageSolution | None = None
    note: str = ""
    seconds: float = 0.0  # spent solving it


@dataclass
class SearchResult:
    best: Candidate | None
    built: "Built | None"  # the best candidate's problem and what its indices mean
    candidates: list[Candidate]
    seconds: float
    stats: dict = field(default_factory=dict)

    @property
    def solved(self) -> int:
        return sum(c.seconds > 0 for c in self.candidates)

    @property
    def pruned(self) -> int:
        return len(self.candidates) - self.solved

    @property
    def interrupted(self) -> bool:
        return bool(self.stats.get("interrupted"))

    def stop_note(self) -> str:
        """Why the best plan is not proven the fastest, and how to prove it."""
        best = self.best.solution.times.step_s if self.best else None
        left = sum(_open(c) and c.bound_s is not None and c is not self.best
                   and (best is None or c.bound_s < best * (1 - 1e-9))
                   for c in self.candidates)
        prove = "search_time_s=None (--search-time prove) runs the search to its end"
        if self.stats.get("fallback"):
            return (f"the time budget (search_time_s) ran out before any solve found a plan: "
                    f"this is a quick plan, {left} candidates left open; {prove}")
        mine = ("" if left else "the best shape's own solve stopped at its time limit, "
                "below its plan: ")
        if self.stats.get("out_of_time"):
            return (f"the time budget (search_time_s) ran out with {left} candidates open "
                    f"below this plan; {mine}{prove}")
        if not left:
            return mine + "a longer time_limit_s may prove it"
        return (f"{left} candidates left open below this plan (solves at their time limit, "
                f"chunked schedules dropped on their estimate)")

    def open_bound_s(self) -> float | None:
        """The least lower bound of a candidate not settled (time limit, skipped, or
        solved without proof) that could still beat the best: the search's gap is to it."""
        best = self.best.solution.times.step_s if self.best else None
        bounds = [c.bound_s for c in self.candidates if _open(c) and c.bound_s is not None
                  and (best is None or c.bound_s < best * (1 - 1e-9))]
        return min(bounds, default=None)


def _open(c: "Candidate") -> bool:
    """Not settled: cut short, skipped, or solved without a proof of its simulated step
    (StageSolution.settles: a proven stand-in objective is not one)."""
    return c.outcome in ("time_limit", "skipped") or (
        c.solution is not None and not c.solution.settles)


def _unvisited(c: "Candidate") -> bool:
    """Ranked but not yet looked at (a visit leaves an outcome or a note)."""
    return c.outcome == "pruned_by_bound" and not c.note


def mesh_words(shape: "Shape") -> str:
    """"pp 2 x dp 4 x tp 1", or a cp shape's "cp 4 x dp 2"."""
    pp, dp, tp = shape.degrees()
    if shape.cp > 1:
        return f"cp {shape.cp} x dp {dp}"
    return f"pp {pp} x dp {dp} x tp {tp}"


def _words(shape: "Shape") -> str:
    chunks = f" v={shape.chunks}" if shape.chunks > 1 else ""
    return (f"{mesh_words(shape)}, m {shape.microbatches} "
            f"{shape.schedule}{chunks}{' recompute' if shape.recompute else ''}"
            f"{' every block' if shape.recompute_all else ''}")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def shapes(num_devices: int, batch: int, max_microbatches: int | None = None,
           schedules: tuple[str, ...] = SCHEDULES) -> list[Shape]:
    """Every (pp, dp, tp) with pp·dp·tp = devices, every m with dp·m dividing the batch,
    every schedule with the chunks per rank it allows (planner.pipeline.schedules.chunks_allowed),
    where torch.distributed.pipelining runs it (schedules.refusal: e.g. 1F1B needs at
    least as many microbatches as stages, DualPipeV as many as pp·2 chunks)."""
    out = []
    for pp in _divisors(num_devices):
        for tp in _divisors(num_devices // pp):
            dp = num_devices // (pp * tp)
            if batch % dp:
                continue
            for m in _divisors(batch // dp):
                if max_microbatches is not None and m > max_microbatches:
                    continue
                for schedule in schedules:
                    for v in chunks_allowed(schedule, pp):
                        if refusal(schedule, pp, v, m) is None:
                            out.append(Shape(pp, dp, tp, m, schedule, v))
    return out


def rank_groups(pp: int, dp: int, tp: int) -> dict[str, list[list[int]]]:
    """The global ranks of every group along each dim; rank = (p·dp + d)·tp + t."""
    def rank(p, d, t):
        return (p * dp + d) * tp + t
    return {
        "pp": [[rank(p, d, t) for p in range(pp)] for d in range(dp) for t in range(tp)],
        "dp": [[rank(p, d, t) for d in range(dp)] for p in range(pp) for t in range(tp)],
        "tp": [[rank(p, d, t) for t in range(tp)] for p in range(pp) for d in range(dp)],
    }


# --- units: what a stage cut may not split ------------------------------------------------


def units(graph: ModelGraph) -> list[str]:
    """Per layer, its unit: the outermost module that owns it (a transformer block, an
    embedding), or its own node for top-level functions. Inputs join the next layer's unit.
    A unit is a maximal run of layers with one owner, so cuts fall on module boundaries.
    A torch.export graph is cut between its transformer blocks only (planner.block_cuts);
    one without a block list is one unit, never cut."""
    if graph.tracer == "export":
        return block_units(graph) or ["model"] * len(graph.layers)
    stacks = {}
    if graph.module is not None:
        for node in graph.module.graph.nodes:
            stack = node.meta.get("nn_module_stack")
            if stack:
                stacks[node.name] = next(iter(stack.values()))[0]
    keys = [stacks.get(l.node, l.node) for l in graph.layers]
    for i in range(len(keys) - 2, -1, -1):
        if graph.layers[i].is_input:
            keys[i] = keys[i + 1]
    return keys


# --- per-shape costs ---------------------------------------------------------------------


def _signature(layer: Layer) -> tuple:
    # attrs hold lists and dicts (a call's arguments, input shapes): their repr is the key
    return (layer.op, layer.kind, layer.module_type, layer.output,
            repr(sorted(layer.attrs.items())), layer.param_bytes, bool(layer.params),
            layer.fwd_flops,
            layer.bwd_flops, layer.measured_s, layer.measured_batch)


def _scaled(layer: Layer, batch: int, rows: int) -> Layer:
    """The layer on `rows` of the batch: shapes, bytes and FLOPs of outputs that hold the
    batch in dim 0 scale (dim 0 to `rows` times its row factor)."""
    out = layer.output
    if not out.has_rows(batch) or rows == batch:
        return layer
    f = rows / batch
    output = replace(out, shape=(out.shape[0] * rows // batch, *out.shape[1:]),
                     nbytes=int(out.nbytes * f))
    attrs = layer.attrs
    if "traffic" in attrs:  # the batch's bytes scale, the weights' do not
        attrs = {**attrs, "traffic": {p: scaled_rows(t, f) for p, t in attrs["traffic"].items()}}
    return replace(layer, output=output, fwd_flops=int(layer.fwd_flops * f),
                   bwd_flops=int(layer.bwd_flops * f), attrs=attrs)


@dataclass
class LayerEntry:
    """A distinct layer on one tp group and microbatch: its options and their prices."""

    layer: Layer  # scaled to the microbatch
    strategies: tuple
    ctx: CostContext
    prices: dict = field(default_factory=dict)  # (strategy, dp, sharded) -> Price


class CostCache:
    """Per-layer and per-edge costs, computed once per distinct layer and shared by every
    shape that needs them (the reuse that keeps the search interactive)."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, optimizer: str):
        self.graph, self.cluster, self.optimizer = graph, cluster, optimizer
        self.unit_keys = units(graph)
        self.tie_groups = graph.tied_groups()
        self.tied = {node for group in self.tie_groups for node in group}
        self._layer: dict = {}
        self._edge: dict = {}
        self._rhythm: dict = {}  # (tp, rows): the cluster at that rhythm (in_rhythm)
        self._compute: dict = {}  # tp: the layers' compute in_rhythm reads
        self._signatures: dict = {}  # per node: _signature(layer), a repr of its attrs
        # build()'s per-layer options and per-edge costs, keyed by the entries they price
        # (which this cache keeps alive, so their ids stay theirs)
        self.options: dict = {}
        self.edges: dict = {}
        self._edge_plan: list | None = None  # edge_plan()
        self._kinds: tuple | None = None  # kinds()
        # _cut_times: (the units and what is sent, the values each cut sends), once
        self.crossing: tuple | None = None
        self.hits = self.misses = 0

    def layer(self, layer: Layer, tp: int, rows: int, computing: float | None = None,
              group: OneGroup | None = None):
        """`layer` scaled to `rows` rows, its options over a tp group and their context,
        while `computing` of a node's processes compute at once (None: all of them);
        `group`: what a plan over one group of all devices offers (planner.offers)."""
        tied = layer.node in self.tied
        sig = self._signatures.get(layer.node)
        if sig is None:
            sig = self._signatures[layer.node] = _signature(layer)
        key = (sig, tp, rows, computing, tied, None if group is None else group.levers)
        hit = self._layer.get(key)
        if hit is not None:
            self.hits += 1
            return hit
        self.misses += 1
        scaled = _scaled(layer, self.graph.batch_size, rows)
        cluster = self.rhythm(tp, rows)
        if computing is not None:
            cluster = cluster.computing_at_once(computing)
        ctx = tp_context(cluster, tp, rows, self.optimizer)
        options = candidates(scaled, ctx)
        if group is not None:
            options = group.candidates(scaled, options, ctx, self.graph.tracer, tied)
        else:
            if self.graph.tracer == "export":
                options = module_executor_options(scaled, options,
                                                  cluster.levers.sequence_parallel)
            if tied:  # which one the group runs is fixed per shape (_tied_names)
                options = tied_allowed(options)
        value = LayerEntry(scaled, tuple(options), ctx)
        self._layer[key] = value
        return value

    def kinds(self) -> tuple[list[int], list[int]]:
        """(per layer, its kind; per kind, its first layer): layers of one signature and
        tie, which self.layer gives one entry on every shape, made once."""
        if self._kinds is None:
            first: dict[tuple, int] = {}
            kinds, firsts = [], []
            for i, layer in enumerate(self.graph.layers):
                sig = self._signatures.get(layer.node)
                if sig is None:
                    sig = self._signatures[layer.node] = _signature(layer)
                k = first.setdefault((sig, layer.node in self.tied), len(first))
                if k == len(firsts):
                    firsts.append(i)
                kinds.append(k)
            self._kinds = (kinds, firsts)
        return self._kinds

    def price(self, entry: LayerEntry, strategy, dp: int, sharded: str) -> Price:
        """planner.price.price of one of `entry`'s options, once per dp and variant."""
        key = (strategy, dp, sharded)
        hit = entry.prices.get(key)
        if hit is None:
            hit = entry.prices[key] = price(entry.layer, strategy, entry.ctx, dp, sharded)
        return hit

    def rhythm(self, tp: int, rows: int) -> Cluster:
        """planner.price.in_rhythm of this cache's cluster, once per tp and rows."""
        hit = self._rhythm.get((tp, rows))
        if hit is None:
            times = self._compute.get(tp)
            if times is None:  # the same for every rows: once per tp
                times = self._compute[tp] = self._layer_compute_s(tp)
            hit = self._rhythm[(tp, rows)] = in_rhythm(self.cluster, self.graph, tp, rows,
                                                       self.optimizer, times)
        return hit

    def _layer_compute_s(self, tp: int) -> list[float]:
        """planner.price.layer_compute_s, priced once per kind of layer (kinds: the
        signature every option's price is shared by, as self.layer shares them)."""
        kinds, firsts = self.kinds()
        layers = self.graph.layers
        wanted = [i for i in firsts if not layers[i].is_input]
        times = dict(zip(wanted, layer_compute_s(self.cluster, self.graph, tp, self.optimizer,
                                                 [layers[i] for i in wanted])))
        return [times[firsts[k]] for k, layer in zip(kinds, layers) if not layer.is_input]

    def edge_plan(self) -> list[tuple[int, int, bool, int]]:
        """Every edge of the graph as _edges prices it, (src, dst, whether a gradient flows
        back, the readers of the value), in the graph's order: the same on every shape,
        made once (a graph of 7,342 layers asks hundreds of shapes for it)."""
        if self._edge_plan is None:
            graph = self.graph
            index = {layer.node: i for i, layer in enumerate(graph.layers)}
            # a priced sequence-parallel configuration changes layouts where torchtitan's
            # DTensor hooks do (planner.price.edge_kind's dtensor_hooks), once per tensor
            # its modules read
            module_readers = None
            if self.cluster.levers.sequence_parallel:
                module_readers = Counter(n for l in graph.layers if l.op == "call_module"
                                         for n in l.inputs)
            self._edge_plan = [
                (index[name], dst, graph.carries_gradient(name),
                 graph.readers(name) if module_readers is None else module_readers[name])
                for dst, layer in enumerate(graph.layers) for name in layer.inputs]
        return self._edge_plan

    def edge(self, kind: EdgeKind):
        """planner.price.edge_cost, once per distinct edge."""
        hit = self._edge.get(kind)
        if hit is None:
            hit = edge_cost(kind, self.rhythm(kind.ranks, kind.rows))
            self._edge[kind] = hit
        return hit


@dataclass(frozen=True)
class _PricedOptions:
    """One layer's options on a shape (its strategies over tp, each replicated or sharded
    over dp) and their prices: what build() puts in a LayerOptions."""

    names: tuple[str, ...]
    strategies: tuple
    sharded: tuple[str, ...]
    costs: tuple
    microbatch_s: np.ndarray
    step_s: np.ndarray
    weight_bytes: np.ndarray
    activation_bytes: np.ndarray
    local_param_bytes: np.ndarray
    sync_s: np.ndarray  # of step_s, the gradient sync (planner.price.Price.sync_s)
    sync_serial_s: np.ndarray  # that sync, none of it beside compute
    prices: tuple[Price, ...] = ()

    @staticmethod
    def of(names, variants, prices) -> _PricedOptions:
        """The options `variants` ((strategy, dp suffix) pairs) named `names`, each at its
        planner.price.Price."""
        return _PricedOptions(
            tuple(names), tuple(s for s, _ in variants), tuple(sh for _, sh in variants),
            tuple(p.cost for p in prices), np.array([p.microbatch_s for p in prices]),
            np.array([p.step_s for p in prices]), np.array([p.weight_bytes for p in prices]),
            np.array([p.activation_bytes for p in prices]),
            np.array([p.local_param_bytes for p in prices]),
            np.array([p.sync_s for p in prices]), np.array([p.sync_serial_s for p in prices]),
            tuple(prices))

    def only(self, names: set[str]) -> _PricedOptions:
        """The options named in `names`, in their order."""
        keep = [j for j, n in enumerate(self.names) if n in names]
        return _PricedOptions.of([self.names[j] for j in keep],
                                 [(self.strategies[j], self.sharded[j]) for j in keep],
                                 [self.prices[j] for j in keep])


def _priced_options(cache: "CostCache", entry: LayerEntry, layer: Layer, dp: int, tp: int,
                    want: str | None, tied_copy, tied_link, tie: str | None = None,
                    computing: float | None = None) -> _PricedOptions:
    """Each of `entry`'s options (only the one named `tie` where its tie group runs that:
    _tied_names), then its FSDP and HSDP variants where offered (planner.dp_shard), an
    experts layer's expert parallelism carved out of dp (planner.expert_degrees, priced on
    the wider group's entry), kept to `want` where pinned, priced by planner.price."""
    graph, cluster = cache.graph, cache.cluster
    strategies = [s for s in entry.strategies if tie is None or s.name == tie]
    variants = [(s, "") for s in strategies]
    variants += [(s, sh) for s in strategies for sh in dp_shard.variants(
        layer, s.name, dp, tp, graph.tracer, layer.node in cache.tied,
        cluster.devices_per_node)]
    over = [(entry, dp)] * len(variants)  # the entry each is priced on, and its replicas
    rows = entry.ctx.batch
    for e in expert_degrees.degrees(layer, dp, tp, rows, graph.batch_size):
        wide = cache.layer(layer, tp * e, rows * e, computing)
        s = expert_degrees.carved(wide.strategies, tp, e)
        if s is None:
            continue
        # FSDP over the dp/e ranks sharing its experts; not HSDP, which the executor does not run
        shards = [sh for sh in dp_shard.variants(layer, s.name, dp // e, tp * e, graph.tracer,
                                                 False, cluster.devices_per_node)
                  if sh == dp_shard.SUFFIX]
        variants += [(s, sh) for sh in ["", *shards]]
        over += [(wide, dp // e)] * (1 + len(shards))
    names = [s.name + sh for s, sh in variants]
    want = expert_degrees.canonical(want, tp)
    keep = [j for j, n in enumerate(names) if want and (
        n == want or (want.startswith("+") and n.endswith(want))
        or (want == dp_shard.REPLICATED and not variants[j][1]))]
    if keep:
        variants, names, over = ([variants[j] for j in keep], [names[j] for j in keep],
                                 [over[j] for j in keep])
    prices = [cache.price(e, s, d, sh) for (s, sh), (e, d) in zip(variants, over)]
    if tied_copy is not None:
        prices = [with_tied_copy(p, s, tied_copy, entry.ctx, dp, tied_link)
                  for p, (s, _) in zip(prices, variants)]
    return _PricedOptions.of(names, variants, prices)


def _group_options(cache: CostCache, entry: LayerEntry, layer: Layer, group: OneGroup,
                   want: str | None) -> _PricedOptions:
    """`entry`'s options on one group of all devices, kept to `group`'s rules and to the
    pinned `want` (its exact name: planner.offers.pinned), priced by planner.price."""
    tied = layer.node in cache.tied
    options = group.allowed(layer, list(entry.strategies), tied)
    if want is not None:
        options = pinned(layer, options, want, entry.ctx)
    return _PricedOptions.of([s.name for s in options], [(s, "") for s in options],
                             [cache.price(entry, s, 1, "") for s in options])


@dataclass(frozen=True)
class Built:
    """A StageProblem and what its indices mean (for the plan)."""

    problem: StageProblem
    strategies: tuple[tuple, ...]  # per layer (the sink last): Strategy objects
    costs: tuple[tuple, ...]
    layers: tuple[Layer, ...]  # scaled to the microbatch, the sink excluded
    local_param_bytes: tuple[np.ndarray, ...]
    sharded: tuple[tuple[str, ...], ...] = ()  # per layer and option: "", "+fsdp", "+hsdp"
    transient_bytes: float = 0.0  # held once per rank beside the problem's memory
    # per unit: what one microbatch sends across a cut right before it (pipeline buffers)
    cut_bytes: tuple[float, ...] = ()
    # per layer and option: the optimizer temporaries its weight_bytes carry
    # (strategies.step_memory.summed_temp_bytes), which the plan reports beside the layers
    temp_bytes: tuple[np.ndarray, ...] = ()
    # per layer and option: of its step_s, the gradient sync as waited and as run alone
    # (planner.price.Price), which a layer's reason quotes (planner.reasons)
    sync_s: tuple[np.ndarray, ...] = ()
    sync_serial_s: tuple[np.ndarray, ...] = ()
    # layers that share a parameter, each group to pick one strategy name (planner.ties):
    # where the program chooses it (build's `group`); the 3-D search fixes it per group
    # (planner.ties.tied_strategy)
    ties: tuple[tuple[int, ...], ...] = ()
    prices: tuple[tuple[Price, ...], ...] = ()  # per layer and option: planner.price.Price
    # one group of all devices (build's `group`): a 1-D plan, which executor.parallelize
    # runs whole (DDP or FSDP over the group), not executor.pipeline's stages
    one_group: bool = False

    def temp(self, i: int, c: int) -> float:
        """The optimizer temporaries layer i's option c carries in its weight_bytes (0
        for the sink and where none are carried)."""
        return float(self.temp_bytes[i][c]) if i < len(self.temp_bytes) else 0.0


def build(cache: CostCache, pp: int, dp: int, tp: int, rows: int,
          pin: dict[str, str] | None = None, ends_together: bool = False,
          group: OneGroup | None = None) -> Built:
    """The stage problem of one mesh shape at `rows` rows per microbatch per replica.
    `pin` maps layer names to the option they must use where it applies: a strategy's
    name, or with "+fsdp" ("+hsdp") its variant sharded over the dp group (the dp ranks of
    a node: planner.dp_shard); a bare suffix ("+fsdp") keeps every option with it (the
    strategy over tp stays free: planner.baseline's "fsdp_tp"), and dp_shard.REPLICATED
    every option without one (DDP over dp). `ends_together`: the first
    and last stages lie on one rank (a V-shaped schedule), which holds a tied embedding and
    head as one weight: no copy to price. `group`: the shape is one group of all devices
    (pp = dp = 1, tp = N, the whole batch: a 1-D plan, planner.choices) offering what
    planner.offers.OneGroup says; there a tie group's strategy is the program's to choose
    (Built.ties), a pin names its option exactly and every pinned layer must exist, and
    the rows carry no optimizer temporaries (a 1-D plan checks what the step holds beside
    its layers after the solve: planner.pipeline.stage_held.peak_bytes)."""
    graph, cluster = cache.graph, cache.cluster
    unit_names, unit_of = _units_of(cache)
    if group is None:
        priced, layers = _shape_options(cache, pp, dp, tp, rows, pin, ends_together)
        ties = ()
        # the optimizer step's temporaries that add up over a rank's layers ride on each
        # option's weights: the rows then hold what the step holds at the optimizer step
        temp_of = once_per_object(lambda got: summed_temp_bytes(
            got.local_param_bytes, cache.optimizer, cluster.device.kind))
        temps = [temp_of(got) for got in priced]
    else:
        assert pp == dp == 1 and rows == graph.batch_size, "one group of all devices"
        priced, ties = _one_group_options(cache, tp, pin, group)
        zeros = once_per_object(lambda got: np.zeros(len(got.names)))
        layers, temps = list(graph.layers), [zeros(got) for got in priced]
    options = _layer_options(cache, priced, temps, unit_of, len(unit_names), dp, tp)
    strategies = [got.strategies for got in priced]
    edges = (_edges(cache, priced, strategies, layers, rows, tp, shared=group is None)
             if group is None or group.layouts else [])
    # an export graph's stages recompute what depends on positions alone (planner.block_cuts)
    sent = (carries_weights(graph) if graph.tracer == "export"
            else {layer.node for layer in graph.layers})
    cut_s, cut_bytes = (_cut_times(cache, layers, unit_of, len(unit_names), sent,
                                   group_link(cluster, 2 * dp * tp))
                        if pp > 1 else ([0.0] * len(unit_names), [0.0] * len(unit_names)))
    problem = StageProblem(tuple(options), tuple(edges), tuple(unit_names), tuple(cut_s),
                           replay_s=_replay_s(graph, options, unit_names, sent)
                           if pp > 1 else 0.0,
                           split_backward=graph.split_backward if pp > 1 else 1.0,
                           forward_share=graph.forward_share)
    return Built(problem, tuple(strategies), tuple(got.costs for got in priced),
                 tuple(layers), tuple(got.local_param_bytes for got in priced),
                 tuple(got.sharded for got in priced), cut_bytes=tuple(cut_bytes),
                 temp_bytes=tuple(map(once_per_object(lambda t: np.asarray(t, dtype=float)),
                                      temps)),  # shared as temps are (block_recompute)
                 sync_s=tuple(got.sync_s for got in priced),
                 sync_serial_s=tuple(got.sync_serial_s for got in priced), ties=ties,
                 prices=tuple(got.prices for got in priced), one_group=group is not None)


def _layer_options(cache: CostCache, priced: list[_PricedOptions], temps: list,
                   unit_of: list[int], units: int, dp: int, tp: int) -> list[LayerOptions]:
    """Each layer's options in the stage problem (its unit, times, memory rows, and what
    each option's FSDP group gathers, which the step's backward holds beside the rows:
    the second memory row, planner.pipeline.held_row), then the output sink. Identical
    layers (a transformer's blocks) share one _PricedOptions and so one array of each
    figure: what reads them later (block_recompute, the bounds' tables) does a layer's
    work once per distinct array."""
    per_node = cache.cluster.devices_per_node

    # a layer's optimizer temporaries are its _PricedOptions' (build): keyed by it alone;
    # each distinct one's figures made once, and a layer's own LayerOptions from them (a
    # call per layer: DeepSeek-V3 has 7,342 layers on each of hundreds of shapes)
    def figures(got, temp) -> tuple:
        gathered = got.local_param_bytes * np.array([
            dp_shard.gathered_over(sh, *expert_degrees.sharing(s.name, dp, tp), per_node)
            for s, sh in zip(got.strategies, got.sharded)])
        return (got.names, got.microbatch_s, got.step_s, got.weight_bytes + temp,
                got.activation_bytes, None, temp, gathered)

    figures_of = once_per_object(figures)
    options = [LayerOptions(layer.name, unit_of[i], *figures_of(got, temp=temps[i]))
               for i, (layer, got) in enumerate(zip(cache.graph.layers, priced))]
    options.append(LayerOptions(OUTPUT, units - 1, ("output",), np.zeros(1), np.zeros(1),
                                np.zeros(1), np.zeros(1)))
    return options


def _shape_options(cache: CostCache, pp: int, dp: int, tp: int, rows: int, pin,
                   ends_together: bool) -> tuple[list[_PricedOptions], list[Layer]]:
    """Each layer's priced options on a shape of the 3-D search (build), and the layers
    scaled to the microbatch."""
    graph, cluster = cache.graph, cache.cluster
    # processes sharing a machine's cores: a stage waiting for its input holds no core, so
    # of pp stages, m microbatches, pp·m/(m+pp-1) compute at once on average
    m = max(1, graph.batch_size // (dp * rows))
    computing = (cluster.devices_per_node * m / (m + pp - 1) if pp > 1 and cluster.cores
                 else None)  # devices of their own (GPUs): one price whatever the pipeline
    # a tied head's copy of the embedding's weight on the last stage: its memory, and its
    # gradient all-reduced with the first stage's over the pipeline's link (block_cuts)
    tied_copy = tied_heads(graph) if pp > 1 and not ends_together else {}
    tied_link = group_link(cluster, pp * dp * tp)
    # each kind of layer (a transformer's blocks repeat) priced once: a call per layer cost
    # DeepSeek-V3 (7,342 layers) a quarter of a second a shape
    kinds, firsts = cache.kinds()
    of_kind = [cache.layer(graph.layers[i], tp, rows, computing) for i in firsts]
    entries = [of_kind[k] for k in kinds]
    ties = _tied_names(cache, entries, tp)
    if not pin and not tied_copy and not ties:  # nothing set per layer: per kind alone
        priced_kind = []
        for i, entry in zip(firsts, of_kind):
            layer = graph.layers[i]
            key = (id(entry), dp, None, None, layer.node in cache.tied, None)
            if key not in cache.options:
                cache.options[key] = _priced_options(cache, entry, layer, dp, tp, None, None,
                                                     tied_link, None, computing)
            priced_kind.append(cache.options[key])
        return [priced_kind[k] for k in kinds], [entry.layer for entry in entries]
    priced, scaled = [], []
    for layer, entry in zip(graph.layers, entries):
        want = pin.get(layer.name) if pin else None
        copy, tie = tied_copy.get(layer.node), ties.get(layer.node)
        key = (id(entry), dp, want, copy, layer.node in cache.tied, tie)
        if key not in cache.options:  # identical layers (a transformer's blocks) share one
            cache.options[key] = _priced_options(cache, entry, layer, dp, tp, want, copy,
                                                 tied_link, tie, computing)
        priced.append(cache.options[key])
        scaled.append(entry.layer)
    return priced, scaled


def _tied_names(cache: CostCache, entries: list[LayerEntry], tp: int) -> dict[str, str]:
    """Per node of a tie group, the one strategy its group runs on a shape of the 3-D
    search (planner.ties.tied_strategy: its stage problems have no tie rows), read from
    the members' entries `entries` (one per layer of the graph); none on one rank where
    the members' only options differ in name alone."""
    if not cache.tie_groups:
        return {}
    index = {layer.node: i for i, layer in enumerate(cache.graph.layers)}
    out = {}
    for group in cache.tie_groups:
        members = [index[node] for node in group]
        name = tied_strategy([[s.name for s in entries[i].strategies] for i in members],
                             [cache.graph.layers[i].name for i in members], tp)
        if name is not None:
            out.update((node, name) for node in group)
    return out


def _one_group_options(cache: CostCache, tp: int, pin, group: OneGroup
                       ) -> tuple[list[_PricedOptions], tuple[tuple[int, ...], ...]]:
    """Each layer's priced options on one group of all devices (build's `group`), and the
    tie groups, each layer of one kept to the strategies all of its group offer, or to the
    one planner.ties.tied_strategy fixes where `group` says so (OneGroup.fixed_ties)."""
    graph = cache.graph
    pin = dict(pin or {})
    priced = [_group_options(cache, cache.layer(layer, tp, graph.batch_size, None, group),
                             layer, group, pin.pop(layer.name, None))
              for layer in graph.layers]
    if pin:
        raise ValueError(f"pin: no layer named {sorted(pin)}; layers: "
                         f"{[l.name for l in graph.layers if not l.is_input]}")
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    offers = [list(got.names) for got in priced]
    layer_names = [layer.name for layer in graph.layers]
    ties, allowed = tie_groups([[index[node] for node in g] for g in cache.tie_groups],
                               offers, layer_names, tp)
    if group.fixed_ties:
        fixed = [tied_strategy([offers[i] for i in members], [layer_names[i] for i in members],
                               tp) for members in ties]
        allowed = [{name} if name else names for name, names in zip(fixed, allowed)]
    for members, names in zip(ties, allowed):
        for i in members:
            priced[i] = priced[i].only(names)
    return priced, ties


def _units_of(cache: CostCache) -> tuple[list[str], list[int]]:
    """(the units' names, each layer's unit): runs of layers of one top-level module."""
    unit_names: list[str] = []
    unit_of: list[int] = []
    for key in cache.unit_keys:
        if not unit_names or unit_names[-1] != key:
            unit_names.append(key)
        unit_of.append(len(unit_names) - 1)
    return unit_names, unit_of


def _edges(cache: CostCache, priced, strategies, scaled_layers, rows: int, tp: int,
           shared: bool = True) -> list[Edge]:
    """Every edge priced by planner.price per microbatch (one price between identical
    layers where `shared`: their options are the cache's own), and each output's into the
    sink, handed back as planner.handback says."""
    graph = cache.graph
    index = {layer.node: i for i, layer in enumerate(graph.layers)}
    hooks = cache.cluster.levers.sequence_parallel
    edges = []
    for src, dst, backward, readers in cache.edge_plan():
        key = (id(priced[src]), id(priced[dst]), rows, tp, backward, readers)
        if not shared or key not in cache.edges:
            kind = edge_kind(scaled_layers[src], [s.gives for s in strategies[src]],
                             scaled_layers[dst], strategies[dst], rows, tp,
                             graph.tracer, backward, readers, hooks)
            if not shared:  # options of this problem alone: ids are not kept
                edges.append(Edge(src, dst, cache.edge(kind)))
                continue
            cache.edges[key] = cache.edge(kind)
        edges.append(Edge(src, dst, cache.edges[key]))
    sink = len(graph.layers)
    for name in graph.outputs:
        src = index[name]
        gives = [s.gives for s in strategies[src]]
        cost = cache.edge(output_kind(scaled_layers[src], gives, rows, tp,
                                      graph.carries_gradient(graph.layers[src].node)))
        if cache.cluster.levers.loss_parallel:  # the loss reads a vocabulary shard as it is
            cost = np.where(np.array([g == Layout.FEATURE for g in gives])[:, None], 0.0, cost)
        edges.append(Edge(src, sink, cost))
    return edges


def _cut_times(cache: CostCache, scaled_layers, unit_of: list[int], units: int,
               sent: set[str], link) -> tuple[list[float], list[float]]:
    """(per unit u, the point-to-point time of a cut right before it: the values made
    before it, used after it and sent (not replayed), forward and their gradients back;
    and the bytes such a cut sends per microbatch)."""
    graph = cache.graph
    key = (units, tuple(unit_of), frozenset(sent))
    if cache.crossing is None or cache.crossing[0] != key:  # the same on every shape
        index = {layer.node: i for i, layer in enumerate(graph.layers)}
        last_use = {}
        for dst, layer in enumerate(graph.layers):
            for name in layer.inputs:
                last_use[index[name]] = max(last_use.get(index[name], -1), unit_of[dst])
        for name in graph.outputs:
            last_use[index[name]] = units
        # each cut's values, listed per unit from the values' live ranges (a scan of every
        # value at every cut took 30 ms a shape on a 405 B Llama), in last_use's order
        crossing: list[list[int]] = [[] for _ in range(units)]
        for src, until in last_use.items():
            if graph.layers[src].node in sent:
                for u in range(unit_of[src] + 1, min(until, units - 1) + 1):
                    crossing[u].append(src)
        cache.crossing = (key, crossing)
    crossing = cache.crossing[1]
    cut_s, cut_bytes = [0.0] * units, [0.0] * units
    for u in range(1, units):
        t = sent_bytes = 0.0
        for src in crossing[u]:
            nbytes = scaled_layers[src].output.nbytes
            grad = 0 if scaled_layers[src].is_input else 1
            t += (1 + grad) * send_recv_s(nbytes, link)
            sent_bytes += nbytes
        cut_s[u], cut_bytes[u] = t, sent_bytes
    return cut_s, cut_bytes


def _replay_s(graph, options: list[LayerOptions], units: list[str], sent: set[str]) -> float:
    """What each stage after the first computes again per microbatch: a torch.export
    model's values ahead of its blocks that depend on positions alone (the causal mask,
    position ids, rotary tables), which executor.hf_stages has every stage rerun rather
    than receive. Priced at each such layer's cheapest option; an fx model's stages
    receive every value (nothing replayed)."""
    if graph.tracer != "export":
        return 0.0
    return sum(float(opt.microbatch_s.min())
               for layer, opt in zip(graph.layers, options)
               if units[opt.unit] == BEFORE and not layer.is_input and layer.node not in sent)


def tp_whole_rows(shape: Shape, batch: int, cluster: Cluster) -> bool:
    """Does a torch.export graph run tensor-parallel on this shape (executor.hf_stages)?
    With its tp group inside a node, and each microbatch's rows whole on every tp rank
    (rows not a multiple of tp: Megatron's layout, every op outside a module replicated
    over tp, planner.handback). Rows split over tp would need the row rules of ops
    outside modules (the causal mask's) judged at the microbatch, which the layer scaled
    to it (_scaled) does not carry. A configuration priced as torchtitan runs its TP
    (Levers.sequence_parallel: DTensor's hooks on any rows) is not held to the rows."""
    if cluster.devices_per_node % shape.tp:
        return False
    return cluster.levers.sequence_parallel or shape.rows(batch) % shape.tp != 0


# --- the search --------------------------------------------------------------------------


class _LoadBounds:
    """The busiest rank's work bound (planner.pipeline.stage_loads) of chunked candidates, shared:
    it reads the stages' placement only, not the schedule's order, so one dynamic program
    serves the looped schedules of a problem, pp and m, and one the V-shaped; where that
    leaves a candidate open and its cuts are few, every cut priced through the schedule
    (planner.pipeline.stage_paths), and where they are many but its actions few, the same with the
    stage times free and each rank's memory row (stage_paths.relaxed_path_bound: the
    recompute that memory forces enters the bubble's bound)."""

    def __init__(self, problem_of, budget_of=lambda shape: None, beside_of=lambda shape: 0.0):
        self.problem_of = problem_of
        self.budget_of = budget_of  # shape -> what its stages may fill (None: no limit)
        self.beside_of = beside_of  # shape -> what a rank holds beside them at least
        self.found: dict[tuple, tuple[float, float]] = {}  # placement -> (from, bound)
        # shape -> (stage_paths.path_bound or relaxed_path_bound, its second row still to add)
        self.paths: dict[tuple, tuple[float | None, bool]] = {}
        self.memory: dict[tuple, float] = {}  # ranks' least flights -> memory_bound
        self.checked: set[int] = set()  # candidates raise_memory has seen
        self.one_chunk: dict[tuple, float] = {}  # one-chunk shape -> raise_path's bound

    def raise_memory(self, c: Candidate) -> bool:
        """Whether c fits with its schedule's own in-flight counts (else it is noted
        "does_not_fit"); c.bound_s raised by each rank's memory row (stage_loads.
        memory_bound), which reads how many microbatches each rank keeps at least, in any
        order of the ranks: one per problem, m, chunks, placement kind and those counts,
        whichever schedule asks."""
        s = c.shape
        budget = self.budget_of(s)
        if budget is None or id(c) in self.checked:
            return c.outcome != "does_not_fit"
        self.checked.add(id(c))
        b = self.problem_of(s).problem
        need = min_memory_bytes(b, s.pp, s.microbatches, s.schedule, s.chunks)
        if need > budget:
            c.outcome = "does_not_fit"
            c.note = f"needs at least {(need + self.beside_of(s)) / 1e9:.1f} GB per device"
            return False
        flights = s.flights()
        ranks = schedules.placement(s.schedule, s.pp, s.chunks)
        least = sorted(min(f for f, q in zip(flights, ranks) if q == r) for r in range(s.pp))
        key = (id(b), s.microbatches, s.chunks, s.schedule in V_SHAPED, tuple(least), budget)
        if key not in self.memory:
            self.memory[key] = memory_bound(b, s.pp, s.microbatches, s.schedule, s.chunks,
                                            budget, flights)
        c.bound_s = max(c.bound_s, self.memory[key])
        return True

    def raise_path(self, c: Candidate) -> None:
        """A one-chunk pipelined c's bound raised by its schedule's actions with the stage
        times free and each rank's memory rows (stage_paths.relaxed_path_bound, which holds
        for one chunk a rank as for several: tests/test_held_row.py), where it has at most
        RELAXED_ACTIONS actions. Where memory forces recompute, the fill and drain pay for
        it too: a 405 B Llama's pp 2 x dp 256 GPipe of one microbatch, 68.1 s by the stage
        bound, 105.8 s by this (its stage MIP had run out 10 s without a plan)."""
        s = c.shape
        if s.pp == 1 or s.chunks > 1 or s.pp * s.microbatches * 3 > RELAXED_ACTIONS:
            return
        b = self.problem_of(s).problem
        key = (id(b), s.pp, s.microbatches, s.schedule)
        if key not in self.one_chunk:
            budget = self.budget_of(s)
            flights = None if budget is None else s.flights()
            self.one_chunk[key] = relaxed_path_bound(b, s.pp, s.microbatches, s.schedule,
                                                     1, budget, flights)
        c.bound_s = max(c.bound_s, self.one_chunk[key])

    def raise_bound(self, c: Candidate, best_s: float, within: float,
                    actions: int = RELAXED_ACTIONS, memory: bool = True,
                    mip_s: float = HELD_MIP_S) -> None:
        """c.bound_s raised by the bound, computed to `within` of the best (0: only
        whether it reaches the best); the schedule's actions with the stage times free
        where it has at most `actions` of them. `memory`: each rank's memory rows in the
        busiest rank's program and the second row's MIP in the actions' where they are at
        most RELAXED_ACTIONS (seconds where the rest takes a fraction of one: the refining
        pass's, not the chunked pass's; on a 70 B Llama's 32-rank shapes, 6,144 actions,
        the MIP ran out its time at a bound of nothing), its bound read after `mip_s`."""
        s = c.shape
        b = self.problem_of(s).problem
        budget = self.budget_of(s)
        flights = None if budget is None else s.flights()
        rows = (budget, flights) if memory else (None, None)
        key = (id(b), s.pp, s.microbatches, s.chunks, s.schedule in V_SHAPED, within, *rows)
        start, raised = self.found.get(key, (math.inf, None))
        if raised is None or (raised <= start and c.bound_s < start):  # not lifted there
            raised = busiest_rank_bound(b, s.pp, s.microbatches, s.schedule, s.chunks,
                                        c.bound_s, best_s * (1 - 1e-9), within, *rows)
            self.found[key] = (c.bound_s, raised)
        c.bound_s = max(c.bound_s, raised or 0.0)
        if c.bound_s < best_s * (1 - 1e-9):  # few stages: every cut, the bubble included
            key = (id(b), s.pp, s.microbatches, s.chunks, s.schedule)
            if key not in self.paths:
                exact = path_bound(b, s.pp, s.microbatches, s.schedule, s.chunks)
                # too many cuts: the stage times free, where the program is small
                if exact is None and s.pp * s.chunks * s.microbatches * 3 > actions:
                    return  # not priced: a later call with more time may
                relaxed = exact is None
                if relaxed:
                    exact = relaxed_path_bound(b, s.pp, s.microbatches, s.schedule,
                                               s.chunks, budget, flights, second_row=False)
                self.paths[key] = (exact, relaxed)  # (bound, the second row still to add)
            exact, relaxed = self.paths[key]
            small = s.pp * s.chunks * s.microbatches * 3 <= RELAXED_ACTIONS
            if (memory and relaxed and small and exact is not None
                    and exact < best_s * (1 - 1e-9)):
                exact = max(exact, relaxed_path_bound(b, s.pp, s.microbatches, s.schedule,
                                                      s.chunks, budget, flights,
                                                      mip_s=mip_s))
                self.paths[key] = (exact, False)
            c.bound_s = max(c.bound_s, exact or 0.0)


def _ruled_out(c: Candidate, best_s: float | None) -> bool:
    """Whether c's bound reaches the best plan's step (so c cannot beat it), noted on c."""
    if best_s is None or not c.bound_s >= best_s * (1 - 1e-9):
        return False
    c.note = f"bound {c.bound_s * 1e3:.3g} ms >= best {best_s * 1e3:.3g} ms"
    return True


def _refine_chunked(chunked: list[Candidate], best_s: float, loads: _LoadBounds,
                    seconds_left, prove) -> None:
    """Raise the bounds of chunked candidates still open below `best_s` by each rank's
    memory and the busiest rank's work, least bound first, until the least is one so
    raised (the gap needs only the least): those raised to the best are settled ("pruned
    by bound"). The schedule's action program only where `seconds_left()` allows it
    (ACTIONS_PER_S). Where the least so raised has no plan (no quick plan fits), `prove`
    runs its stage MIP briefly: where memory binds, that program proves in seconds what
    the relaxed bounds cannot, that nothing fits (a 70 B Llama over 256 H100s, 32 ranks of
    2 chunks: 2 s, its bound 9.85 s against plans of 11 s)."""
    raised: set[int] = set()
    proved: set[int] = set()
    while seconds_left() > 0:
        left = [c for c in chunked if c.bound_s < best_s * (1 - 1e-9)
                and c.outcome not in ("does_not_fit", "infeasible")]
        if not left:
            return
        c = min(left, key=lambda c: c.bound_s)
        if id(c) not in raised:
            raised.add(id(c))
            if loads.raise_memory(c):
                loads.raise_bound(c, best_s, REFINE,
                                  int(min(REFINE_ACTIONS, ACTIONS_PER_S * seconds_left())),
                                  mip_s=min(REFINE_MIP_S, max(HELD_MIP_S, seconds_left() / 2)))
            if c.solution is None and _ruled_out(c, best_s):
                c.outcome = "pruned_by_bound"
            continue
        if id(c) in proved or c.solution is not None:
            return
        proved.add(id(c))
        prove(c)


FALLBACK_NOTE = "a quick plan: the search's time ran out before any solve found one"


def time_left(search_time_s: float | None, started: float) -> float | None:
    """What is left of a budget of `search_time_s` from perf_counter `started` (never
    below 0); None for no budget."""
    if search_time_s is None:
        return None
    return max(0.0, search_time_s - (time.perf_counter() - started))


def search(graph: ModelGraph, cluster: Cluster, optimizer: str, budget_bytes: float | None,
           *, max_microbatches: int | None = None, time_limit_s: float = 60.0,
           relative_gap: float = 1e-9, only: list[Shape] | None = None,
           cache: CostCache | None = None, pin: dict[str, str] | None = None,
           schedules: tuple[str, ...] = SCHEDULES,
           search_time_s: float | None = None) -> SearchResult:
    """The fastest plan over all shapes that fits `budget_bytes` per device; `schedules`
    limits the pipeline schedules tried. `search_time_s`: no solve runs past that many
    seconds from the start; what is left is "skipped" and counts in the gap (the plan says
    "feasible" with it), as after Ctrl-C; with no plan by then, the best quick plan of what
    is left (FALLBACK_S at most). None: no limit (the proof). The passes, in order, are the
    methods of _Search."""
    with older_objects_frozen():
        run = _Search(graph, cluster, optimizer, budget_bytes, cache, pin, time_limit_s,
                      relative_gap, search_time_s)
        run.rank(_shapes_to_try(graph, cluster, max_microbatches, only, schedules, pin))
        interrupted = False
        try:
            run.first_pass()
            run.chunked_pass()
            run.refine_chunked()
            run.second_pass()
            run.polish_best()
        except KeyboardInterrupt:
            # Ctrl-C: the best plan so far, with its gap to what was left open (SCIP is
            # told not to catch the signal, so it arrives when the solve in progress
            # returns)
            if run.best is None:
                raise
            interrupted = True
            run.skip_unvisited("not solved: interrupted")
        return run.result(interrupted)


def _shapes_to_try(graph: ModelGraph, cluster: Cluster, max_microbatches: int | None,
                   only: list[Shape] | None, schedules: tuple[str, ...],
                   pin: dict[str, str] | None = None) -> list[Shape]:
    """`only`, or every shape of the devices and batch, less those the model cannot run:
    pipelined ones of a model with weights shared across stages or not cut at blocks,
    tensor-parallel ones of a torch.export graph whose rows would split over tp; with the
    context-parallel degrees of a model with attention (planner.context_degrees) where
    nothing is pinned; and each again with its blocks offered recomputed where the model
    has them."""
    batch = graph.batch_size
    todo = only if only is not None else shapes(cluster.num_devices, batch, max_microbatches,
                                                schedules)
    if graph.tied_groups() and graph.tracer != "export":  # export: why_no_blocks judges ties
        todo = [s for s in todo if s.pp == 1]  # a shared parameter lives in one stage
    if graph.tracer == "export":  # stages cut at blocks (planner.block_cuts)
        cut = not why_no_blocks(graph)  # once: it walks every layer (0.2 s on 405 B)
        todo = [s for s in todo if (s.pp == 1 or cut)
                and (s.tp == 1 or s.cp > 1 or tp_whole_rows(s, batch, cluster))]
    if any(s.recompute_all and not s.recompute for s in todo):
        raise ValueError("only: recompute_all=True checkpoints every block the shape's "
                         "recompute offers; set recompute=True with it")
    if any(s.recompute for s in todo) and not block_recompute.offered(graph):
        raise ValueError(f"only: recompute=True checkpoints the transformer blocks of a "
                         f"decoder torch.export traced, and {graph.model_name} is not one; "
                         f"drop recompute from the shapes")
    if only is None and not pin:  # a pin names options of the shapes above
        n = cluster.num_devices
        todo = todo + [Shape(1, 1, n, 1, "1F1B", cp=cp)
                       for cp in context_degrees.search_degrees(graph, cluster)]
    if only is None and block_recompute.offered(graph):
        todo = todo + [replace(s, recompute=True) for s in todo]
    return todo


class _Search:
    """One search's state, the candidates and the best so far, and its passes (`search`
    calls them in order): rank (every shape bounded without a solve), first_pass (the
    one-chunk shapes' stage programs, briefly), chunked_pass (chunked shapes' quick plans
    and the MIPs of the best of them), refine_chunked (the open chunked bounds raised),
    second_pass (what is left open, cut off at the best), polish_best (the budget's rest
    to the best's own program)."""

    def __init__(self, graph: ModelGraph, cluster: Cluster, optimizer: str,
                 budget_bytes: float | None, cache: CostCache | None,
                 pin: dict[str, str] | None, time_limit_s: float, relative_gap: float,
                 search_time_s: float | None):
        self.started = time.perf_counter()
        self.deadline = None if search_time_s is None else self.started + search_time_s
        # the first and chunked passes stop REFINE_SHARE short of it: the refining pass's
        # bounds are what the gap is read from
        self.passes_until = (None if search_time_s is None
                             else self.deadline - REFINE_SHARE * search_time_s)
        self.graph, self.budget_bytes, self.pin = graph, budget_bytes, pin
        self.cache = cache or CostCache(graph, cluster, optimizer)
        self.time_limit_s, self.relative_gap = time_limit_s, relative_gap
        self.built: dict[tuple, Built] = {}
        # a tied embedding and head on one rank (V-shaped schedules) need no copy: their
        # own problem, only where the model has such a tie (planner.block_cuts.tied_heads)
        self.ties_ends = bool(tied_heads(graph))
        self.out: list[Candidate] = []
        self.ranked: list[tuple[float, Candidate]] = []
        self.chunked: list[Candidate] = []
        self.best: Candidate | None = None
        self.solve_seconds = 0.0
        self.outputs = set(graph.outputs)
        # shape -> bytes taken off its budget: what its plans held beside the stage rows
        # past the budget (stage_held.peak_bytes), so that its next solve leaves the room
        self.room: dict[Shape, float] = {}
        # bounds read the rows as they are: a relaxation of what the plans must fit
        self.loads = _LoadBounds(self.problem_of, self.rows_budget,
                                 lambda s: self.budget_bytes - self.rows_budget(s))
        self.first_s = min(time_limit_s, FIRST_PASS_S)
        self.first_until = None  # a budget: the one-chunk first pass stops at half of it
        if search_time_s is not None:
            self.first_s = min(self.first_s, max(0.1, search_time_s * FIRST_PASS_SHARE))

    # --- the problems, the budget and the clock ---------------------------------------

    def problem_of(self, shape: Shape) -> Built:
        """The shape's stage problem, built once per (pp, dp, tp, rows, recompute, tie)."""
        together = self.ties_ends and shape.schedule in V_SHAPED
        key = (shape.pp, shape.dp, shape.tp, shape.rows(self.graph.batch_size),
               shape.recompute, shape.recompute_all, together, shape.cp)
        if key not in self.built:
            if shape.recompute:
                self.built[key] = block_recompute.recompute_blocks(
                    self.problem_of(replace(shape, recompute=False, recompute_all=False)),
                    self.graph, shape.tp, every=shape.recompute_all)
            elif shape.cp > 1:  # one group of all devices (Shape.cp)
                self.built[key] = build(self.cache, *key[:4],
                                        group=context_degrees.ContextGroup(cp=shape.cp))
            else:
                self.built[key] = build(self.cache, *key[:4], pin=self.pin,
                                        ends_together=together)
        return self.built[key]

    def rows_budget(self, shape: Shape) -> float | None:
        """The budget the stage problem's rows may fill: less the recompute transient and,
        in a pipeline, the buffers torch.distributed.pipelining keeps for every microbatch
        at each of a rank's stages, an activation's coming in and a gradient's going back
        (strategies.step_memory.pipeline_buffer_bytes), at the largest cut. The rows carry
        the optimizer's temporaries (build); what else the step holds beside them (the
        loss, FSDP's gathered groups: stage_held.held_beside_stages) is at least 0, so a
        bound within this budget is a bound of every plan that fits, but for two terms
        taken off every rank alike: the recompute transient, which a rank recomputing no
        block does not hold, and the buffers at the largest cut, a rank's first and last
        stage at most one buffer each above what they hold."""
        if self.budget_bytes is None:
            return None
        built = self.problem_of(shape)
        buffers = 2 * shape.chunks * pipeline_buffer_bytes(max(built.cut_bytes, default=0.0),
                                                            shape.microbatches)
        return self.budget_bytes - built.transient_bytes - (buffers if shape.pp > 1 else 0.0)

    def budget_of(self, shape: Shape) -> float | None:
        """What a solve of `shape` may fill: rows_budget less the room its earlier plans
        were found to need beside the rows (refit)."""
        budget = self.rows_budget(shape)
        return None if budget is None else budget - self.room.get(shape, 0.0)

    def proves(self, shape: Shape) -> bool:
        """Whether a solve of `shape` runs in its rows' budget, a relaxation of the step's
        memory, so that what it proves (a bound, that nothing fits) holds for the shape;
        once refit took room off it, it does not."""
        return shape not in self.room

    def over_bytes(self, shape: Shape, solution) -> float:
        """By how much the plan's fullest rank holds more than the budget in its step
        (stage_held.peak_bytes, the figure the Plan reports); <= 0 where it fits."""
        if self.budget_bytes is None:
            return 0.0
        peak = peak_bytes(self.problem_of(shape), solution, shape, self.cache.cluster,
                          self.cache.optimizer, self.outputs)
        return max(peak) - self.budget_bytes

    def refit(self, shape: Shape, solution, solve):
        """`solution`, or where it does not fit with what its step holds beside the rows,
        `solve()` again with the shape's budget lowered by the excess, up to REFITS times;
        None where none of them fits. A solution so found proves nothing for the shape
        (another choice may hold less beside the rows): its bound stays the relaxed one."""
        for _ in range(REFITS + 1):
            if solution is None:
                return None
            over = self.over_bytes(shape, solution)
            if over <= 0:
                return solution
            # rows below this plan's fullest by the excess and a little more (the next
            # plan's own held bytes differ): less room than the budget alone would leave
            # where the plan did not fill it
            fullest = min(self.budget_of(shape), max(solution.times.memory_bytes))
            target = fullest - over - REFIT_MARGIN * self.budget_bytes
            self.room[shape] = self.rows_budget(shape) - target
            solution = solve()
        return solution if solution is not None and self.over_bytes(shape, solution) <= 0 else None

    def out_of_time(self, passes: bool = False) -> bool:
        """Past the deadline (`passes`: past the first and chunked passes' share of it)."""
        until = self.passes_until if passes else self.deadline
        return until is not None and time.perf_counter() >= until

    def seconds_left(self) -> float:
        return math.inf if self.deadline is None else self.deadline - time.perf_counter()

    @property
    def incumbent(self) -> float | None:
        return self.best.solution.times.step_s if self.best else None

    # --- the passes ---------------------------------------------------------------------

    def rank(self, todo: list[Shape]) -> None:
        """Every shape a candidate: dropped where dominated, infeasible or too large,
        else bounded without a solve (stages.lower_bound) and ranked, best bound first;
        one-stage shapes before all (planner.ilp proves them in a second, and their best
        is a cutoff for every pipelined shape); shapes with chunks per rank after those
        with one (their bound leaves out the bubble, and would put every one of them
        first)."""
        realizable: dict[int, bool] = {}
        listed = set(todo)
        keys = self.cache.unit_keys
        unit_count = sum(i == 0 or keys[i - 1] != k for i, k in enumerate(keys))  # as build's
        for shape in todo:
            if shape.schedule == "GPipe" and replace(shape, schedule="1F1B") in listed:
                self.out.append(Candidate(shape, "dominated", note="1F1B: same step time, "
                                          "no more activations in flight"))
                continue
            if shape.pp * shape.chunks > unit_count:  # before building its problem
                self.out.append(Candidate(shape, "infeasible", note="more stages than modules"))
                continue
            b = self.problem_of(shape)
            if id(b) not in realizable:  # the stage MIP takes finite edges only
                realizable[id(b)] = all(np.isfinite(cost).all() for cost in
                                        {id(e.cost_s): e.cost_s for e in b.problem.edges}
                                        .values())
            if not realizable[id(b)]:
                self.out.append(Candidate(shape, "infeasible", note="a layout change the "
                                          "module executor cannot make "
                                          "(planner.price._unrealizable)"))
                continue
            missing = self.pin and missing_pins(  # (lists of every layer: only for a pin)
                [layer.name for layer in b.layers], [o.strategies for o in b.problem.layers],
                self.pin, shape.tp)
            if missing:
                self.out.append(Candidate(shape, "infeasible", note=f"pin not offered on "
                                          f"this shape: {', '.join(missing)}"))
                continue
            # with chunks: one microbatch in flight until the chunked pass (the schedule's
            # order is simulated only for shapes a bound leaves in)
            need = min_memory_bytes(b.problem, shape.pp, shape.microbatches, shape.schedule,
                                    shape.chunks, 1 if shape.chunks > 1 else None)
            if self.budget_bytes is not None and need > self.rows_budget(shape):
                beside = self.loads.beside_of(shape)
                self.out.append(Candidate(shape, "does_not_fit", note=f"needs at least "
                                          f"{(need + beside) / 1e9:.1f} GB per device"))
                continue
            bound = lower_bound(b.problem, shape.pp, shape.microbatches, shape.schedule,
                                shape.chunks, self.rows_budget(shape))
            c = Candidate(shape, "pruned_by_bound", bound_s=bound)
            self.ranked.append((bound, c))
            self.out.append(c)
        self.ranked.sort(key=lambda t: (t[1].shape.pp > 1, t[1].shape.chunks > 1, t[0],
                                        t[1].shape.pp, t[1].shape.tp, t[1].shape.chunks))

    def first_pass(self) -> None:
        """The one-chunk shapes, best bound first, each briefly (first_s): a hard one met
        before any incumbent exists would otherwise spend the whole limit proving a plan
        far from best. With a budget, up to half of what is left; chunked shapes are set
        aside for the chunked pass."""
        if self.deadline is not None:
            self.first_until = (time.perf_counter() + self.passes_until) / 2
        for _, c in self.ranked:
            if self.out_of_time(passes=True):
                break
            if _ruled_out(c, self.incumbent):
                self.tell()
                continue
            if c.shape.chunks > 1:
                self.chunked.append(c)
                continue
            if (self.best is not None and self.first_until is not None
                    and time.perf_counter() > self.first_until):
                continue  # the second pass comes back to it
            self.loads.raise_path(c)  # a fraction of a second, where a solve takes seconds
            if _ruled_out(c, self.incumbent):
                self.tell()
                continue
            self.tell(_words(c.shape))
            self.attempt(c, self.first_s)
            self.tell()

    def chunked_pass(self) -> None:
        """Chunked schedules, least estimate first: each checked against memory with its
        schedule's own in-flight counts and its bound raised by each rank's memory row
        (loads.raise_memory); one still below the best gets its balanced estimate (a
        simulation of the schedule, which the cut can only miss by imbalance) and, where
        that beats the best, a quick plan (stages.quick_plan, a fraction of a second)
        while the time for quick plans lasts. What is left so is "skipped", and counts in
        the gap at its bound. Then the stage MIPs of the CHUNKED_TRIES best quick plans,
        started from them and cut off at the best (their MIPs are the hardest: they keep
        the quick plan where they find no better in CHUNKED_PASS_S)."""
        self.chunked.sort(key=self._guess)
        quick_until = time.perf_counter() + QUICK_PASS_S
        if self.deadline is not None:  # a budget: up to half of what it has left
            quick_until = max(quick_until, (time.perf_counter() + self.passes_until) / 2)
        quick_ones = []
        for c in self.chunked:
            if self.out_of_time(passes=True):
                break
            if self._quick(c, quick_until):
                quick_ones.append(c)
        quick_ones.sort(key=lambda c: c.solution.times.step_s)
        for c in quick_ones[:CHUNKED_TRIES]:
            if self.out_of_time(passes=True):
                break
            if c.bound_s >= self.incumbent * (1 - 1e-9):
                continue
            kept = c.solution
            self.tell(_words(c.shape))
            self.attempt(c, min(self.time_limit_s, CHUNKED_PASS_S))
            if c.solution is None or c.solution.times.step_s > kept.times.step_s:
                c.outcome, c.solution = "solved", kept
            self.tell()

    def _guess(self, c: Candidate) -> float:
        """What a chunked candidate's plan may take: its balanced estimate, at least its
        bound (the chunked pass tries the likeliest plans first; the refining pass takes
        the bounds in their own order)."""
        s = c.shape
        problem = self.problem_of(s).problem
        return max(estimate(problem, s.pp, s.microbatches, s.schedule, s.chunks), c.bound_s)

    def _quick(self, c: Candidate, quick_until: float) -> bool:
        """The chunked pass on one candidate (its docstring): whether it got a quick plan."""
        incumbent = self.incumbent
        if _ruled_out(c, incumbent) or not self.loads.raise_memory(c):
            return False
        if _ruled_out(c, incumbent):
            return False
        if incumbent is not None:  # whole units may rule it out before a quick plan
            self.loads.raise_bound(c, incumbent, 0.0, memory=False)
            if _ruled_out(c, incumbent):
                return False
        s = c.shape
        problem = self.problem_of(s).problem
        guess = self._guess(c)
        if incumbent is not None and guess >= incumbent * (1 - 1e-9):
            c.outcome = "skipped"
            c.note = f"estimate {guess * 1e3:.3g} ms >= best {incumbent * 1e3:.3g} ms"
            return False
        if self.best is not None and time.perf_counter() > quick_until:
            c.outcome, c.note = "skipped", "not solved: past the time for quick plans"
            return False
        t0 = time.perf_counter()

        def plan():
            return quick_plan(problem, s.pp, s.microbatches, s.schedule, self.budget_of(s),
                              s.chunks)

        quick = self.refit(s, plan(), plan)
        c.seconds += time.perf_counter() - t0
        self.solve_seconds += time.perf_counter() - t0
        if quick is None:
            c.outcome, c.note = "skipped", "not solved: no quick plan fits"
            return False
        c.outcome, c.solution = "solved", quick
        if incumbent is None or quick.times.step_s < incumbent:
            self.best = c
        return True

    def refine_chunked(self) -> None:
        """The chunked candidates left open, least bound first, their bounds raised under
        the final best to REFINE of it (_refine_chunked), then the one-chunk pipelined
        ones by their path bounds: those it reaches are settled, and the least bound left
        is the search's gap."""
        if self.best is None:
            return
        _refine_chunked(self.chunked, self.incumbent, self.loads, self.seconds_left,
                        lambda c: self.attempt(c, min(self.time_limit_s, PROOF_S)))
        # the one-chunk pipelined shapes left open: their path bounds (loads.raise_path),
        # least bound first, until the least is one so raised
        raised: set[int] = set()
        while self.seconds_left() > 0:
            left = [c for _, c in self.ranked if c.shape.chunks == 1 and c.shape.pp > 1
                    and (_open(c) or _unvisited(c))
                    and c.bound_s < self.incumbent * (1 - 1e-9)]
            c = min(left, key=lambda c: c.bound_s, default=None)
            if c is None or id(c) in raised:
                return
            raised.add(id(c))
            self.loads.raise_path(c)
            if _unvisited(c) and _ruled_out(c, self.incumbent):
                self.tell()

    def second_pass(self) -> None:
        """What is left open of the one-chunk shapes and might still beat the best, now
        cut off at it (an integer program whose LP bound is above the cutoff ends at
        once); chunked candidates get the chunked pass only."""
        for _, c in self.ranked:
            if self.out_of_time():
                break
            incumbent = self.incumbent
            open_ = c.outcome == "time_limit" or (c.solution is not None and c is not self.best
                                                  and c.solution.status != "optimal")
            if c.shape.chunks > 1:
                continue
            if incumbent is None or c.bound_s < incumbent * (1 - 1e-9):
                self.loads.raise_path(c)  # not once settled: seconds on a 64-GPU GPT
            if _unvisited(c) and _ruled_out(c, incumbent):
                continue
            if (open_ or _unvisited(c)) and (incumbent is None
                                             or c.bound_s < incumbent * (1 - 1e-9)):
                self.tell(_words(c.shape))
                self.attempt(c, self.time_limit_s if open_ else self.first_s)
                self.tell()

    def polish_best(self) -> None:
        """What a budget has left goes to the best itself where its own solve stopped
        short (its first pass was brief), cut off at its plan, which it keeps unless a
        better one is found."""
        c = self.best
        if (self.deadline is None or c is None or c.shape.chunks != 1
                or c.solution.status == "optimal" or self.out_of_time()):
            return
        kept = c.solution
        self.tell(_words(c.shape))
        self.attempt(c, self.time_limit_s)
        if c.solution is None or c.solution.times.step_s > kept.times.step_s:
            c.solution = kept
        c.outcome = "solved"
        self.tell()

    # --- one solve, the progress, the result --------------------------------------------

    def attempt(self, c: Candidate, limit_s: float) -> None:
        """Solve candidate c within `limit_s`, cut off at the incumbent; keep the best."""
        incumbent = self.incumbent
        s = c.shape
        t0 = time.perf_counter()
        if self.deadline is not None:
            limit_s = max(0.1, min(limit_s, self.deadline - t0))
        until = t0 + limit_s

        def solve():
            # a solve again in less room (refit) gets half the limit at least, within the
            # search's deadline
            now = time.perf_counter()
            left = max(until - now, limit_s / 2)
            if self.deadline is not None:
                left = min(left, self.deadline - now)
            return solve_stages(
                self.problem_of(s).problem, s.pp, s.microbatches, s.schedule,
                self.budget_of(s), max(0.1, left), self.relative_gap,
                cutoff_s=None if incumbent is None else incumbent * (1 + 1e-9),
                chunks=s.chunks)

        try:
            solution = solve()
            if solution is not None and self.proves(s):
                # both are lower bounds on this candidate's optimum: the tighter one holds
                c.bound_s = max(c.bound_s, solution.bound_s)
            solution = self.refit(s, solution, solve)
        except TimeLimit as limit:
            c.outcome = "time_limit"
            if self.proves(s):
                c.bound_s = max(c.bound_s, limit.bound_s)
            return
        finally:
            c.seconds += time.perf_counter() - t0
            self.solve_seconds += time.perf_counter() - t0
        if solution is None and not self.proves(s):
            c.outcome, c.note = "skipped", "no plan found that fits what its step holds"
            return
        if solution is None:
            c.outcome, c.solution = "infeasible", None
            c.note = "does not fit" if incumbent is None else "nothing beats the incumbent"
            if incumbent is not None:
                c.bound_s = max(c.bound_s, incumbent)
            return
        if not self.proves(s):  # found in less room than the rows': no proof for the shape
            solution = replace(solution, status="feasible", settles=False,
                               bound_s=min(solution.bound_s, c.bound_s))
        c.outcome, c.solution = "solved", solution
        if self.best is None or solution.times.step_s < self.incumbent:
            self.best = c

    def fallback(self) -> Candidate | None:
        """The search ran out of time with no plan: quick plans (stages.quick_plan, no
        proof) of the candidates not ruled out, least bound first, each fitted to what its
        step holds (refit), for FALLBACK_S at most; the fastest, or None where none fits in
        that time."""
        best: Candidate | None = None
        until = time.perf_counter() + FALLBACK_S
        for _, c in self.ranked:
            if time.perf_counter() > until:
                break
            if c.solution is not None or c.outcome in ("does_not_fit", "infeasible"):
                continue
            s = c.shape
            if best is not None and c.bound_s >= best.solution.times.step_s * (1 - 1e-9):
                continue
            t0 = time.perf_counter()

            def plan(s=s):
                return quick_plan(self.problem_of(s).problem, s.pp, s.microbatches,
                                  s.schedule, self.budget_of(s), s.chunks)

            quick = plan()
            if quick is not None and self.proves(s):
                c.bound_s = max(c.bound_s, quick.bound_s)
            quick = self.refit(s, quick, plan)
            c.seconds += time.perf_counter() - t0
            if quick is None:
                continue
            c.outcome, c.solution, c.note = "solved", quick, FALLBACK_NOTE
            if best is None or quick.times.step_s < best.solution.times.step_s:
                best = c
        return best

    def tell(self, current: str = "") -> None:
        """Report where the search stands: candidates dealt with (dropped, pruned, skipped
        or solved; not those unvisited or at a time limit), and the least bound still open."""
        if not listened():
            return
        settled = sum(not _unvisited(c) and c.outcome != "time_limit" for c in self.out)
        open_bounds = [c.bound_s for _, c in self.ranked if c.bound_s is not None
                       and (_open(c) or _unvisited(c))]
        report(Progress(len(self.out), settled, sum(c.seconds > 0 for c in self.out),
                        self.incumbent, min(open_bounds, default=None), current))

    def skip_unvisited(self, note: str) -> None:
        for _, c in self.ranked:
            if _unvisited(c):  # or cut short by an interrupt
                c.outcome, c.note = "skipped", note

    def result(self, interrupted: bool) -> SearchResult:
        """The best candidate (a quick plan where the budget ran out with none) and what
        became of every shape."""
        ran_out = self.out_of_time()
        fallback = ran_out and self.best is None and not interrupted
        if fallback:
            self.best = self.fallback()
            self.solve_seconds += sum(c.seconds for _, c in self.ranked
                                      if c.note == FALLBACK_NOTE)
        if ran_out:
            self.skip_unvisited("not solved: the search's time ran out")
        best = self.best
        if best is not None:
            best.outcome = "best"
        stats = {"layer_costs_computed": self.cache.misses,
                 "layer_costs_reused": self.cache.hits, "problems_built": len(self.built),
                 "solve_seconds": self.solve_seconds, "interrupted": interrupted,
                 "out_of_time": ran_out, "fallback": fallback and best is not None}
        return SearchResult(best, self.problem_of(best.shape) if best else None, self.out,
                            time.perf_counter() - self.started, stats)
