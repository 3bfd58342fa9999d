"""The one price list: what a layer costs under one option on one device group, and what
a layout change between two layers costs.

Every plan shape reads its costs from here, through planner.search.build: the 3-D search
(and so its lower bounds, the baselines it prices, explain() and the pictures of a 3-D
plan) and the 1-D planner (planner.choices), whose one group of all N devices is built as
the 3-D shape pp = 1, dp = 1, tp = N at one microbatch. The rules both apply live here once:

- the group-link rule (`group_link`): a group of consecutive ranks stays on the intra-node
  link only inside one node;
- the gradient sync (`price`, through strategies.catalog.gradient_sync, its one price):
  DDP's bucket fit (strategies.collectives) over the replicas
  that hold the same weights: dp x tp for layers that split rows (or tokens) over their tp
  group, dp for the rest, with DDP's copies into and out of its buckets, once per step; on
  a GPU only what it takes beyond the backward beside it (strategies.overlap);
- the reshard overhead and the batch-free rule on edges (`edge_cost`), and for torch.export
  graphs the layout changes the module executor can make;
- the fixed cost of a distributed step (`step_overhead_s`), outside every choice;
- the rhythm blocking collectives are priced at (`in_rhythm`), where the link measured one,
  and on GPUs the compute that runs beside FSDP's and DDP's collectives (strategies.overlap);
- the kernel levers on tensor-parallel collectives (`lever_reduction_s`, `lever_edge`):
  float8 tensorwise's 1-byte all-gathers, async TP's fused collectives; levers off, none.

    microbatch_s  the catalog's time on one microbatch over the tp group, less its
                  gradient sync                                   (charged m times a step)
    step_s        the gradient sync over the replicas + the optimizer on this device's
                  weights                                          (charged once a step)
    memory        weights, gradients, optimizer state (weight_bytes) + what backward keeps
                  of one microbatch (activation_bytes, times the microbatches in flight)
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

import numpy as np

from planner import dp_shard
from planner.handback import output_layout
from profiler.graph import Layer, ModelGraph
from strategies import async_tp, float8
from strategies.catalog import (
    Cost, CostContext, Strategy, compute_s, gradient_sync, update_s, weights_memory,
)
from strategies.cluster import Cluster
from strategies.collectives import all_gather_s, all_reduce_s, collective_s, reduce_scatter_s
from strategies.devices import LinkSpec
from strategies.edges import changes, edge_matrix
from strategies.gpu_compute import attention_dims, gemm_s, linear_dims
from strategies.kernel_levers import Levers
from strategies.layouts import Layout, edge_collectives
from strategies.memory import split_name
from strategies.overlap import exposed_s, forward_share

# a layout change the module executor cannot make: an infinite cost, which the solver
# turns into a bound on its edge variable (planner.ilp: a finite penalty would set the
# solver's time unit and drown microsecond costs in its tolerances)
UNREALIZABLE_S = float("inf")


def group_link(cluster: Cluster, span: int) -> LinkSpec:
    """The slowest link inside a group whose ranks lie in one aligned block of `span`
    consecutive ranks (a tp group: span tp; a dp group: dp·tp; two adjacent stages:
    2·dp·tp). It stays inside a node only if the block fits a node and nodes divide evenly."""
    per_node = cluster.devices_per_node
    inside = span <= per_node and per_node % span == 0
    return cluster.intra_node if inside or cluster.nodes == 1 else cluster.inter_node


def step_overhead_s(cluster: Cluster) -> float:
    """What every distributed step costs whatever the plan (calibrated; the same for every
    choice, so outside the integer programs' objectives)."""
    return cluster.step_overhead_s if cluster.num_devices > 1 else 0.0


def tp_context(cluster: Cluster, tp: int, rows: int, optimizer: str) -> CostContext:
    """The catalog's context for a tp group of `tp` ranks working on `rows` rows: its
    strategies price their collectives on `ctx.link`, which here follows `group_link`."""
    if group_link(cluster, tp) is not cluster.link(tp):  # in a node, not aligned to one
        cluster = cluster.model_copy(update={"intra_node": cluster.inter_node})
    return CostContext(cluster=cluster, ranks=tp, batch=rows, optimizer=optimizer)


def layer_compute_s(cluster: Cluster, graph: ModelGraph, tp: int, optimizer: str,
                    layers: Iterable[Layer] | None = None) -> list[float]:
    """Each layer's compute (inputs left out) at 1/tp of the whole batch: what `in_rhythm`
    reads, the same for every microbatch size (the 3-D search keeps it per tp, priced once
    per kind of layer: `layers`, some of the graph's, in place of all of them)."""
    ctx = tp_context(cluster, tp, graph.batch_size, optimizer)
    return [compute_s(layer, 1 / tp, ctx) for layer in
            (graph.layers if layers is None else layers) if not layer.is_input]


def in_rhythm(cluster: Cluster, graph: ModelGraph, tp: int, rows: int,
              optimizer: str, times: list[float] | None = None) -> Cluster:
    """`cluster` at the rhythm a plan of `graph` on tp groups of `tp` ranks, `rows` rows,
    computes and communicates in: every option of every shape is priced at it, known from
    the graph, not from a solution, so the plan the solver returns is optimal for the
    prices it reports.

    - Blocking collectives, on links with a measured gap curve, at the gap they are
      issued at (strategies.collectives.rhythm_latency_s), where a node's processes
      outnumber its cores (`time_shared`). In a model-parallel plan each
      layer with weights synchronises its group about once a step (a column layer's
      input-gradient all-reduce, a row, head or vocabulary layer's output reduction), so
      the ranks compute about one such layer's share, with the parameter-free ops around
      it, between two: the layers' compute at 1/tp over the number with weights. A plan
      that issues no blocking collective (DDP, FSDP) pays nothing for it.
    - On GPUs, the compute that runs beside a layer's FSDP and DDP collectives
      (`Cluster.overlap_cover`, strategies.overlap): all compute over the compute of the
      layers with weights, the parameter-free ops between them included.

    `times`: `layer_compute_s` of these arguments, where the caller keeps it."""
    links = {name: getattr(cluster, name) for name in ("intra_node", "inter_node")}
    gaps = (tp > 1 and time_shared(cluster)
            and any(link.gap_curve is not None for link in links.values()))
    overlaps = cluster.device.kind == "cuda"
    if not (gaps or overlaps):
        return cluster
    layers = [layer for layer in graph.layers if not layer.is_input]
    if times is None:
        times = layer_compute_s(cluster, graph, tp, optimizer)
    compute = sum(times)
    update: dict = {}
    if overlaps:
        weighted_s = sum(t for t, layer in zip(times, layers) if layer.param_bytes > 0)
        update["overlap_cover"] = max(1.0, compute / weighted_s) if weighted_s > 0 else None
    if gaps:
        weighted = sum(1 for layer in layers if layer.param_bytes > 0)
        gap_s = compute / max(1, weighted) * rows / graph.batch_size
        update.update({name: link.model_copy(update={"blocking_gap_s": gap_s})
                       for name, link in links.items() if link.gap_curve is not None})
    return cluster.model_copy(update=update)


@dataclass(frozen=True)
class Price:
    """One layer under one option on one device group (module docstring)."""

    cost: Cost  # the catalog's cost over the tp group (compute_s, update_s, notes)
    microbatch_s: float
    step_s: float
    weight_bytes: float
    activation_bytes: float
    local_param_bytes: float  # this device's share of the layer's weights
    sync_s: float  # the gradient sync part of step_s (with DDP's bucket copies)
    sync_serial_s: float = 0.0  # the same, none of it beside compute

    @property
    def time_s(self) -> float:
        """A step of one microbatch: what the 1-D planner's options cost."""
        return self.microbatch_s + self.step_s

    @property
    def memory_bytes(self) -> float:
        """With one microbatch in flight."""
        return self.weight_bytes + self.activation_bytes


def price(layer: Layer, strategy: Strategy, ctx: CostContext, dp: int = 1,
          sharded: str = "") -> Price:
    """`layer` (scaled to ctx.batch rows) running `strategy` over a tp group of ctx.ranks
    ranks (`tp_context`), replicated over a dp group of `dp`; `sharded`: "+fsdp" for its
    variant fully sharded over the dp group, "+hsdp" sharded over the dp ranks of a node
    and replicated across nodes (planner.dp_shard)."""
    tp = ctx.ranks
    cost = strategy.cost(layer, ctx)
    if strategy.model_parallel and tp_levers_on(ctx.cluster, tp):
        whole = strategy.gives not in (Layout.BATCH, Layout.SEQUENCE)
        cost = replace(cost, communication_s=lever_reduction_s(layer, cost, ctx, whole))
    base = split_name(strategy.name)[0]
    tp_sharded = strategy.shards_weights  # ZeRO-3 inside the tp group (strategies.memory)
    local = layer.param_bytes / tp if strategy.model_parallel or tp_sharded else layer.param_bytes
    weights = weights_memory(local, ctx, sharded=tp_sharded)
    activations = cost.memory_bytes - weights
    microbatch = cost.compute_s + cost.communication_s
    link = group_link(ctx.cluster, dp * tp)  # a dp group spans dp·tp consecutive ranks
    share = forward_share(layer.fwd_flops, layer.bwd_flops)
    if sharded:
        priced = dp_shard.price_variant(sharded, local, microbatch, dp, tp, link, ctx,
                                        cost.compute_s, share)
        return Price(cost, priced.microbatch_s, priced.step_s, priced.weight_bytes,
                     activations, priced.local_param_bytes, 0.0)
    if base in dp_shard.SUMMED_OVER_TP:  # rows (tokens) split over tp too: dp x tp copies
        replicas, held = dp * tp, layer.param_bytes
    else:
        replicas, held = dp, local
    synced = gradient_sync(held, replicas, link, ctx)
    # on a GPU the all-reduce runs beside the last microbatch's backward (strategies.overlap)
    sync = exposed_s(0.0, synced.all_reduce_s, cost.compute_s, share,
                     ctx.cluster.overlap_cover) + synced.copies_s
    return Price(cost, microbatch, cost.update_s + sync, weights, activations, local, sync,
                 synced.all_reduce_s + synced.copies_s)


def with_tied_copy(priced: Price, strategy: Strategy, copy_bytes: float, ctx: CostContext,
                   dp: int, pipeline_link: LinkSpec) -> Price:
    """`priced` for a head on a pipeline's last stage that also holds a copy of the
    `copy_bytes` weight it shares with the first stage's token embedding (Megatron's
    embedding group, planner.block_cuts.tied_heads): the copy's weights and optimizer state,
    its gradient synced over the replicas like the head's own, then all-reduced once with
    the first stage's copy, and its optimizer step."""
    tp = ctx.ranks
    base = split_name(strategy.name)[0]
    local = copy_bytes / tp if strategy.model_parallel else copy_bytes
    replicas = dp * tp if base in dp_shard.SUMMED_OVER_TP else dp
    # the all-reduce over the replicas as the sync prices it, not beside any compute
    sync = gradient_sync(local, replicas, group_link(ctx.cluster, dp * tp), ctx).all_reduce_s
    # one blocking call (executor)
    sync += all_reduce_s(ctx.precision.reduce_bytes(local), 2, pipeline_link)
    return replace(priced, step_s=priced.step_s + sync + update_s(local, ctx),
                   weight_bytes=priced.weight_bytes + weights_memory(local, ctx),
                   sync_s=priced.sync_s + sync, sync_serial_s=priced.sync_serial_s + sync)


# --- edges -------------------------------------------------------------------------------


def batch_free_takes(producer: Layer, takes: Layout, batch: int) -> Layout:
    """A tensor without the batch in dim 0 (a positional embedding, a mask) that meets a
    layer split by rows is broadcast to every rank's rows, not split: it stays whole, and
    its gradient, summed over each rank's rows, is all-reduced (as REPLICATE_PARTIAL_GRAD)."""
    if takes == Layout.BATCH and not producer.output.has_rows(batch):
        return Layout.REPLICATE_PARTIAL_GRAD
    return takes


def time_shared(cluster: Cluster) -> bool:
    """Do a node's processes share cores (more CPU processes than cores)? Only there do
    blocking collectives follow the gap curve's rhythm: with a core each, the curve's
    cheap collectives after short gaps do not show in steps (the measurements are in
    benchmarks/results/HISTORY.md, "Calibration choices")."""
    return bool(cluster.cores) and (cluster.devices_per_node * cluster.threads_per_device
                                    > cluster.cores)


# Ops whose output depends on their tensor input's dtype and device alone (`x.new_ones(())`):
# they read any layout as it is, at no cost. Hugging Face's sliding-window masks (Mistral,
# Gemma 2) build a scalar `new_ones` from a mask split by rows, and with only a replicated
# option for the scalar every assignment of such a model had an unrealizable edge: no
# plan but a pipeline could be made for it.
READS_METADATA_ONLY = frozenset({"new_ones", "new_zeros", "new_empty", "new_full"})


@dataclass(frozen=True)
class EdgeKind:
    """Everything an edge's price depends on (hashable: the 3-D search caches by it)."""

    gives: tuple[Layout, ...]  # per producer option
    takes: tuple[Layout, ...]  # per consumer option, the batch-free rule applied
    own_style: tuple[bool, ...]  # per consumer option: it changes its input itself
    nbytes: float
    ranks: int
    rows: int
    backward: bool
    # "plain"; "export": an op outside modules of a torch.export graph on either side;
    # "through_rows": a module's output of a torch.export graph, handed on split by rows;
    # "metadata": the consumer reads only its input's dtype and device (READS_METADATA_ONLY)
    route: str = "plain"
    into_module: bool = False  # the consumer is a module (it changes layouts in its hooks)
    # "through_rows": the edges out of the producer, which share its one hand-over; under
    # DTensor hooks (edge_kind's dtensor_hooks), the modules reading it, which share one
    # layout change
    readers: int = 1
    # for the kernel levers on TP collectives (`lever_edge`): the consumer's forward GEMM
    # on one of the ranks (m, n, k), None where it runs none; whether torchtitan's float8
    # converter converts it (strategies.float8.converts)
    into_gemm: tuple[int, int, int] | None = None
    into_float8: bool = False


def edge_kind(producer: Layer, gives, consumer: Layer, strategies, rows: int, ranks: int,
              tracer: str, backward: bool, readers: int = 1,
              dtensor_hooks: bool = False) -> EdgeKind:
    """The edge from `producer` (its options give `gives`) into `consumer` running one of
    `strategies`, `ranks` ranks sharing `rows` rows; `backward`: a gradient flows back
    into the producer's output (profiler.graph.ModelGraph.carries_gradient); `readers`:
    the edges out of the producer (ModelGraph.readers; with `dtensor_hooks`, the modules
    among them). `dtensor_hooks`: a configuration priced as torchtitan runs its TP
    (strategies.kernel_levers.Levers.sequence_parallel), where every edge is a DTensor
    layout change ("plain") and the change into a module is shared by the modules reading
    the same tensor: torchtitan's PrepareModuleInput gathers a block's attention or
    feed-forward input once for q, k, v or w1, w3, and reduce-scatters their summed input
    gradient once."""
    takes = tuple(batch_free_takes(producer, s.takes, rows) for s in strategies)
    route = "plain"
    if consumer.op != "call_module" and consumer.kind in READS_METADATA_ONLY:
        route = "metadata"
    elif tracer == "export" and not dtensor_hooks:
        if producer.op == "call_module" and producer.output.has_rows(rows):
            route = "through_rows"
        elif producer.op != "call_module" and consumer.op != "call_module":
            route = "export"
    return EdgeKind(tuple(gives), takes, tuple(s.model_parallel for s in strategies),
                    producer.output.nbytes, ranks, rows, backward, route,
                    consumer.op == "call_module",
                    max(1, readers) if route == "through_rows" or (
                        dtensor_hooks and consumer.op == "call_module") else 1,
                    input_gemm(consumer, ranks), _converted(consumer, TENSORWISE))


def output_kind(producer: Layer, gives, rows: int, ranks: int, backward: bool) -> EdgeKind:
    """The edge from `producer` into the model's output, handed back as planner.handback
    says for `ranks` ranks sharing `rows` rows."""
    return EdgeKind(tuple(gives), (output_layout(rows, ranks),), (False,),
                    producer.output.nbytes, ranks, rows, backward)


def edge_cost(kind: EdgeKind, cluster: Cluster) -> np.ndarray:
    """cost[i, j] in seconds (per microbatch): the producer's option i into the consumer's
    option j, with DTensor's reshard overhead where the layout changes."""
    ranks, nbytes = kind.ranks, kind.nbytes
    if kind.route == "metadata":  # read as it is, whatever its layout
        return np.zeros((len(kind.gives), len(kind.takes)))
    link = group_link(cluster, ranks)
    overhead = cluster.dtensor_reshard_overhead_s if ranks > 1 else 0.0
    if kind.route == "through_rows":
        return _through_rows(kind, link, overhead, cluster)
    matrix = edge_matrix(list(kind.gives), list(kind.takes), nbytes, ranks, link,
                         backward=kind.backward, reshard_overhead_s=overhead,
                         own_style=list(kind.own_style))
    if kind.route == "plain" and tp_levers_on(cluster, ranks):
        matrix = lever_edge(kind, cluster, link, matrix)
    if kind.route == "export" and ranks > 1:  # one device: one layout
        matrix = matrix + _unrealizable(kind)
    if kind.route == "plain" and kind.readers > 1:  # one change shared (dtensor_hooks)
        matrix = matrix / kind.readers
    return matrix


def _unrealizable(kind: EdgeKind) -> np.ndarray:
    """A layout change between two ops outside modules cannot be made by the module
    executor (modules change layouts in their hooks)."""
    out = np.zeros((len(kind.gives), len(kind.takes)))
    for i, g in enumerate(kind.gives):
        for j, t in enumerate(kind.takes):
            ok = g == t or (t == Layout.REPLICATE_PARTIAL_GRAD and g == Layout.REPLICATE)
            out[i, j] = 0.0 if ok else UNREALIZABLE_S
    return out


def _through_rows(kind: EdgeKind, link: LinkSpec, overhead: float,
                  cluster: Cluster | None = None) -> np.ndarray:
    """The edge out of a module of a torch.export graph: its output is handed on split by
    rows (it has them in dim 0: TensorMeta.has_rows) and each reader changes it to what
    it takes from there; an op outside modules cannot change it, so it takes the rows or
    nothing; or, where the rows are whole, each rank's feature shard for a reader that
    takes it feature-split."""
    held = output_layout(kind.rows, kind.ranks)  # rows, or whole where they do not split
    out = edge_matrix(list(kind.gives), [held], kind.nbytes, kind.ranks, link,
                      backward=kind.backward, reshard_overhead_s=overhead)
    into = edge_matrix([held], list(kind.takes), kind.nbytes, kind.ranks, link,
                       backward=kind.backward, reshard_overhead_s=overhead,
                       own_style=list(kind.own_style))
    levers = cluster is not None and tp_levers_on(cluster, kind.ranks)
    if levers:  # the reader's own change of the rows it is handed (lever_edge)
        into = lever_edge(replace(kind, gives=(held,)), cluster, link, into)
    if not kind.into_module and kind.ranks > 1:
        into = np.where(np.array([[t == held for t in kind.takes]]), into, UNREALIZABLE_S)
    if held == Layout.BATCH:  # the code sees rows split: a feature split shows it whole rows
        # the module hands its output on once, in a forward hook (executor.modules), and
        # its readers' gradients are summed before that hook's backward: one change for
        # all of them, a share on each edge (charged whole on each, Llama's norms, read by
        # the attention or the MLP's two projections and a residual add, paid it 2-3x)
        return out / kind.readers + into
    # rows whole: a reader that takes it feature-split (Llama's act_fn after gate_proj,
    # act(gate) * up, down_proj after it) gets each rank's feature shard straight from the
    # module, as torchtitan's ColwiseParallel hands its local output to RowwiseParallel: no
    # collective where it is split so already (executor.modules)
    direct = edge_matrix(list(kind.gives), list(kind.takes), kind.nbytes, kind.ranks, link,
                         backward=kind.backward, reshard_overhead_s=overhead,
                         own_style=list(kind.own_style))
    if levers:
        direct = lever_edge(kind, cluster, link, direct)
    return np.where(np.array([[t == Layout.FEATURE for t in kind.takes]]), direct, out + into)


# --- kernel levers on the tensor-parallel collectives (strategies.kernel_levers) -----------
#
# torchtitan runs a Llama block's TP as sequence parallelism: a reduce-scatter of each
# row-parallel output (its gradient all-gathered back) and an all-gather into each
# column-parallel group (its input gradient reduce-scattered). A plan whose blocks keep
# activations whole moves the same bytes as all-reduces (a ring all-reduce is a
# reduce-scatter then an all-gather, strategies.sequence); with float8 tensorwise or async
# TP on, each such all-reduce is priced as that pair, half of its own price each (the
# link's all-reduce fit, NVLS's on an H100 node, stays the price of those bytes), so the
# levers reach it as they reach torchtitan's collectives: float8 tensorwise halves the
# all-gather half (strategies.float8.tp_gather_bytes), async TP leaves of a fused
# collective what strategies.async_tp.exposed_s says, and leaves an input gradient's
# reduce-scatter whole (a sum of matmuls, which the pass does not fuse). Levers off:
# nothing here runs.

TENSORWISE = Levers(float8="tensorwise")


def tp_levers_on(cluster: Cluster, ranks: int) -> bool:
    """Do the levers change a TP collective's price on a group of `ranks`?"""
    levers = cluster.levers
    return ranks > 1 and (levers.float8 == "tensorwise" or levers.async_tp)


def _converted(layer: Layer, levers: Levers) -> bool:
    """Does torchtitan run `layer`'s matmuls in float8 under `levers` (a Linear its
    converter swaps, an attention block's projections)?"""
    if not levers.float8 or layer.is_input:
        return False
    dims = linear_dims(layer)
    if dims is not None:
        return float8.converts(layer, levers, *dims)
    return attention_dims(layer) is not None


def _rows(layer: Layer) -> int:
    shape = layer.output.shape
    return max(1, int(np.prod(shape[:-1]))) if shape else 1


def output_gemm(layer: Layer, tp: int) -> tuple[int, int, int] | None:
    """(m, n, k) of the forward GEMM that makes a row-split layer's partial output on one
    of `tp` ranks (an attention block's output projection); None for a layer with none
    (a vocabulary-parallel embedding)."""
    dims = linear_dims(layer)
    if dims is not None and layer.output.shape:
        return _rows(layer), dims[1], max(1, dims[0] // tp)
    heads = attention_dims(layer)
    if heads is not None:
        q_heads, _, head_dim = heads
        return _rows(layer), layer.output.shape[-1], max(1, q_heads * head_dim // tp)
    return None


def input_gemm(layer: Layer, tp: int) -> tuple[int, int, int] | None:
    """(m, n, k) of the forward GEMM a column-split layer runs on its gathered input on one
    of `tp` ranks (an attention block's q, k and v projections as one); None for a layer
    with none."""
    if layer.is_input:
        return None
    dims = linear_dims(layer)
    if dims is not None and layer.output.shape:
        return _rows(layer), max(1, dims[1] // tp), dims[0]
    heads = attention_dims(layer)
    if heads is not None:
        q_heads, kv_heads, head_dim = heads
        return (_rows(layer), max(1, (q_heads + 2 * kv_heads) * head_dim // tp),
                layer.output.shape[-1])
    return None


def _gemm_s(gemm: tuple[int, int, int], cluster: Cluster, converted: bool) -> float:
    """One GEMM's seconds as the device prices it (strategies.gpu_compute on a GPU priced
    by shape; float8 where torchtitan converts the layer), else at the achievable rate."""
    device, dtype = cluster.device, cluster.compute_dtype
    if device.shape is not None and not device.op_flops:
        if converted and "float8" in device.peak_flops:
            return gemm_s(*gemm, device, "float8") / float8.gemm_share(cluster.levers.float8)
        return gemm_s(*gemm, device, dtype)
    m, n, k = gemm
    return 2 * m * n * k / device.achievable_flops(dtype)


def _memory_pass_s(nbytes: float, cluster: Cluster) -> float:
    """A fused op's copy or sum outside its pipeline, at the best copy's bandwidth."""
    device = cluster.device
    fraction = device.shape.memory_fraction if device.shape is not None else 1.0
    return nbytes / (device.memory_bandwidth_bytes_per_s * fraction)


def _scatter_gather_s(n: float, gathered: float, tp: int, link: LinkSpec, whole: bool
                      ) -> tuple[float, float]:
    """(reduce-scatter of `n` bytes, all-gather of `gathered` bytes of it) over `tp` ranks;
    where the plan reduces to a whole output (`whole`: an all-reduce), its all-reduce's
    price halved between the two, the gather's half scaled as the link's all-gather
    prices `gathered` against `n`."""
    if not whole:
        return reduce_scatter_s(n, tp, link), all_gather_s(gathered, tp, link)
    half = all_reduce_s(n, tp, link) / 2
    return half, half * all_gather_s(gathered, tp, link) / all_gather_s(n, tp, link)


def _fused_s(collective: str, seconds: float, nbytes: float, gemm, cluster: Cluster,
             ranks: int, converted: bool) -> float:
    """`seconds` of a TP all-gather or reduce-scatter of `nbytes` beside `gemm`: what async
    TP leaves of it where on and the GEMM is known (strategies.async_tp), else whole."""
    if not cluster.levers.async_tp or gemm is None:
        return seconds
    copy_s = _memory_pass_s(async_tp.copy_bytes(collective, nbytes, ranks), cluster)
    return async_tp.exposed_s(seconds, _gemm_s(gemm, cluster, converted), ranks, copy_s)


def lever_reduction_s(layer: Layer, cost: Cost, ctx: CostContext, whole: bool) -> float:
    """A model-parallel layer's own collectives (`cost.communication_s`) with the levers
    on: its output reduction (cost.notes) as a reduce-scatter of the output, fused with
    the GEMM that makes it, and an all-gather (of its output gradient in backward where it
    gives split rows or tokens; into the next block's column-parallel group where it gives
    the output whole), float8 under tensorwise and fused with a GEMM of this layer's size
    (its input-gradient GEMM, or the next layer's, which this one's stands for).
    `whole`: the layer gives its output whole (an all-reduce, `_scatter_gather_s`)."""
    n = cost.notes.get("output_bytes")
    if n is None:
        return cost.communication_s
    tp, link, cluster = ctx.ranks, ctx.link, ctx.cluster
    converted = _converted(layer, cluster.levers)
    gathered = float8.tp_gather_bytes(n, converted, cluster.levers)
    gemm = output_gemm(layer, tp)
    scatter_s, gather_s = _scatter_gather_s(n, gathered, tp, link, whole)
    scatter = _fused_s("reduce_scatter", scatter_s, n, gemm, cluster, tp, converted)
    gather = _fused_s("all_gather", gather_s, gathered, gemm, cluster, tp, converted)
    return cost.communication_s - cost.notes["output_reduction_s"] + scatter + gather


def lever_edge(kind: EdgeKind, cluster: Cluster, link: LinkSpec, matrix: np.ndarray
               ) -> np.ndarray:
    """`matrix` with the levers on the edges into a model-parallel consumer that change
    its input themselves (a column-parallel group): the forward all-gather float8 under
    tensorwise and fused with the consumer's GEMM; the backward reduce-scatter of its input
    gradient whole (a sum of matmuls: not fused); a backward all-reduce as that
    reduce-scatter and the all-gather of the gradient the previous row-parallel layer
    reads (float8 e5m2 under tensorwise, fused with its input-gradient GEMM, for which the
    consumer's stands)."""
    out = matrix.copy()
    ranks, n, levers = kind.ranks, kind.nbytes, cluster.levers
    converted = kind.into_float8 and levers.float8 is not None  # its GEMMs float8
    gathered = float8.tp_gather_bytes(n, converted, levers)
    gemm = kind.into_gemm
    for i, g in enumerate(kind.gives):
        for j, t in enumerate(kind.takes):
            if not kind.own_style[j] or not changes(g, t, kind.backward):
                continue
            fwd, bwd = edge_collectives(g, t)
            time = 0.0
            if fwd == "all_gather":
                time += _fused_s(fwd, all_gather_s(gathered, ranks, link), gathered, gemm,
                                 cluster, ranks, converted)
            else:
                time += collective_s(fwd, n, ranks, link)
            if kind.backward and bwd == "all_reduce":
                scatter_s, gather_s = _scatter_gather_s(n, gathered, ranks, link, True)
                time += scatter_s + _fused_s("all_gather", gather_s, gathered, gemm, cluster,
                                             ranks, converted)
            elif kind.backward:
                time += collective_s(bwd, n, ranks, link)
            out[i, j] = time
    return out
