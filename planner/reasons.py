"""Why each layer got its strategy, in plain words, from the solver's own numbers: one
sentence for every plan kind, a 1-D plan and a 3-D one (planner.plan3d.plan_of makes
both), read from the one stage problem they are built as (planner.search.build).

For a layer, every other option is priced per step with its neighbours held as planned: its
own time (m microbatches and the once-a-step part) and the layout changes on its edges (m
times). The cheapest alternative of the other kind (data-parallel against model-parallel) is
what the sentence compares with. A 1-D plan is the case of one microbatch and no dp group;
`of_built` turns a shape's options into the sentences' input, `Weighed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner import dp_shard
from planner.per_object import once_per_object
from planner.problem import Edge
from profiler.graph import Layer
from strategies.catalog import Cost, Strategy
from strategies.context import TOKEN_SPLIT
from strategies.memory import split_name

if TYPE_CHECKING:
    from planner.pipeline.stages import LayerOptions
    from planner.search import Built


@dataclass(frozen=True)
class Options:
    """One layer's options as its reason weighs them, index-aligned; seconds per step."""

    layer: Layer
    strategies: tuple[Strategy, ...]
    names: tuple[str, ...]  # as the plan names them: "column_parallel+fsdp"
    time_s: tuple[float, ...]  # its own time: m microbatches and the once-a-step part
    traffic_s: tuple[float, ...]  # of it, its own collectives, FSDP's gathers included
    sync_s: tuple[float, ...]  # of it, the gradient all-reduce as waited (planner.price)
    sync_serial_s: tuple[float, ...]  # that all-reduce, none of it beside compute
    gather_s: tuple[float, ...]  # of it, FSDP's all-gathers and reduce-scatter, as waited
    gather_serial_s: tuple[float, ...]  # those, none of them beside compute
    stage: int | None = None  # its pipeline stage where there are several
    memory_bytes: tuple[float, ...] = ()  # weights and one microbatch's activations


@dataclass(frozen=True)
class Weighed:
    """Every layer's options and the edges between them, each edge's cost_s per step."""

    layers: tuple[Options, ...]  # node i of the edges is layers[i]; a sink may follow
    edges: tuple[Edge, ...]
    dp: int = 1  # the data-parallel group each layer is replicated over (1-D: none)


def of_built(built: Built, microbatches: int, dp: int,
             stages: tuple[int, ...] | None = None) -> Weighed:
    """A shape's options (planner.search.Built) at `microbatches` a step, each layer
    replicated over `dp`; `stages`: each layer's stage, where there are several. An option
    sharded over dp (planner.dp_shard) waits per microbatch for its gathers beside its plain
    time (the catalog's compute and communication, and a recomputed forward); one sharded
    over its tp group (a 1-D plan's "fsdp") has them in its communication."""
    m, problem = microbatches, built.problem
    n_layers = len(built.layers)
    none = (None,) * n_layers
    # identical layers (a transformer's blocks) share their options' arrays and prices
    # (planner.search.build): each distinct one weighed once, then given its own layer
    # and stage (a layer at a time, DeepSeek-V3's 7,342 took seconds per plan)
    weigh = once_per_object(lambda opts, *ids, **parts: _weighed(opts, m=m, **parts))
    layers = []
    for i, (layer, opts, costs, strategies, sync, serial, sharded) in enumerate(zip(
            built.layers, problem.layers, built.costs, built.strategies,
            built.sync_s or none, built.sync_serial_s or none, built.sharded or none)):
        # keyed by what the figures are made of (built keeps each alive meanwhile)
        figures, memory = weigh(opts, *map(id, (
            opts.strategies, opts.microbatch_s, opts.step_s, opts.weight_bytes,
            opts.activation_bytes, opts.recomputed, costs, strategies, sync, serial, sharded)),
            costs=costs, strategies=strategies, sync=sync, serial=serial, sharded=sharded)
        layers.append(Options(layer, *figures,
                              stages[i] if stages is not None else None, memory))
    scaled = once_per_object(lambda cost: cost * m)  # each distinct matrix once
    edges = tuple(Edge(e.src, e.dst, scaled(e.cost_s)) for e in problem.edges)
    return Weighed(tuple(layers), edges, dp)


def _weighed(opts, costs, strategies, sync, serial, sharded, m: int) -> tuple:
    """One layer's figures of_built weighs (Options' fields from its strategies to its
    gather_serial_s; its memory_bytes) at m microbatches a step."""
    n = len(opts.strategies)
    sync = [0.0] * n if sync is None else sync
    serial = [0.0] * n if serial is None else serial
    sharded = [""] * n if sharded is None else sharded
    traffic, gather, serial_gather = [], [0.0] * n, [0.0] * n
    for c, cost in enumerate(costs):
        traffic.append(m * cost.communication_s)
        if sharded[c]:  # its gathers come beside the catalog's communication
            own = float(opts.microbatch_s[opts.plain_index(c)])
            gather[c] = serial_gather[c] = m * (own - cost.compute_s - cost.communication_s)
            traffic[c] += gather[c]
        elif strategies[c].shards_weights:  # sharded over its group (a 1-D plan's "fsdp"
            # lever, strategies.memory; a cp plan's "+fsdp" options, strategies.context):
            # its gathers are its communication but for K/V's
            kv = cost.notes.get("kv_all_gather_s", 0.0) + cost.notes.get(
                "kv_reduce_scatter_s", 0.0)
            gather[c] = m * (cost.communication_s - kv)
            serial_gather[c] = m * (cost.communication_s - kv
                                    + cost.notes.get("beside_compute_s", 0.0))
    figures = (tuple(strategies), tuple(opts.strategies),
               tuple(m * float(t) + float(s) for t, s in zip(opts.microbatch_s, opts.step_s)),
               tuple(traffic), tuple(float(s) for s in sync), tuple(float(s) for s in serial),
               tuple(gather), tuple(serial_gather))
    return figures, tuple(float(w + a) for w, a in zip(opts.weight_bytes, opts.activation_bytes))


def lever_fields(row: Options, c: int, cost: Cost, opts: LayerOptions, sharded: bool) -> dict:
    """The LayerPlan fields that say what option `c` of a layer's levers save and cost
    per step: over its own group (strategies.memory's fsdp and recompute, a 1-D plan's:
    the catalog's own notes), or sharded over the dp group (planner.dp_shard, a 3-D
    plan's: against the same strategy replicated over dp where that was an option, at
    the times its reason weighs)."""
    if not sharded:
        return {"recompute": split_name(row.strategies[c].name)[1],
                "saved_bytes": float(cost.notes.get("saved_bytes", 0.0)),
                "lever_s": float(cost.notes.get("lever_s", 0.0)),
                "recompute_s": float(cost.notes.get("recompute_s", 0.0)),
                "recompute_saved_bytes": float(cost.notes.get("recompute_saved_bytes", 0.0))}
    base, suffix = dp_shard.split(opts.strategies[c])
    flags = {"dp_shard": True, "hsdp": suffix == dp_shard.HSDP_SUFFIX}
    if base not in opts.strategies:
        return flags
    j = opts.strategies.index(base)
    return {**flags, "saved_bytes": float(opts.weight_bytes[j] - opts.weight_bytes[c]),
            "lever_s": row.time_s[c] - row.time_s[j]}


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} KB"


class _Sentences:
    """The reasons of one assignment `choice` (a sink's option may follow the layers')."""

    def __init__(self, weighed: Weighed, choice):
        self.weighed, self.choice = weighed, list(choice)
        self.around: list[list[Edge]] = [[] for _ in range(len(self.choice))]
        for e in weighed.edges:  # each node's edges, in the edges' order
            self.around[e.src].append(e)
            if e.dst != e.src:
                self.around[e.dst].append(e)

    def edge_time(self, node: int, option: int) -> float:
        """Layout-change time on the edges of `node` if it ran `option`, others as chosen."""
        total, choice = 0.0, self.choice
        for e in self.around[node]:
            if e.src == node:
                total += float(e.cost_s[option, choice[e.dst]])
            if e.dst == node:
                total += float(e.cost_s[choice[e.src], option])
        return total

    def reason(self, i: int) -> str:
        row, c = self.weighed.layers[i], self.choice[i]
        where = f"stage {row.stage}: " if row.stage is not None else ""
        chosen = row.strategies[c]
        if len(row.strategies) == 1:
            return f"{where}{_label(row, c)}: the only strategy that applies here"
        if row.layer.is_input:
            return where + ("each rank passes its rows" if chosen.name == "data_parallel"
                            else "each rank passes the whole batch (the first layers are "
                                 "model-parallel)")
        base = row.time_s[c] + self.edge_time(i, c)
        deltas = [(row.time_s[j] + self.edge_time(i, j) - base, j)
                  for j in range(len(row.strategies)) if j != c]
        other_kind = [d for d in deltas
                      if row.strategies[d[1]].model_parallel != chosen.model_parallel
                      and row.strategies[d[1]].name != "replicate"]
        delta, j = min(other_kind or deltas)
        if not row.layer.param_bytes and not chosen.model_parallel:
            head = f"{_label(row, c)}: follows its neighbours' layout ({chosen.gives.value})"
        else:
            head = f"{_label(row, c)}: {self.traffic(i, c)}"
        if delta < 0 and row.memory_bytes:  # faster, so memory ruled it out
            more = row.memory_bytes[j] - row.memory_bytes[c]
            return (f"{where}{head}; {_label(row, j)} would save {_ms(-delta)} per step but "
                    f"hold {_mb(more)} more per device, which the plan has no room for")
        return (f"{where}{head}; {_label(row, j)} would add {_ms(delta)} per step "
                f"({self.traffic(i, j)})")

    def traffic(self, node: int, option: int) -> str:
        """What option `option` of `node` moves per step: its weights' traffic where it
        replicates or shards them over its ranks, else its activations'."""
        row = self.weighed.layers[node]
        params, reshard = row.layer.param_bytes, self.edge_time(node, option)
        name = dp_shard.split(split_name(row.names[option])[0])  # recomputed or not
        summed = ("data_parallel", *TOKEN_SPLIT)  # gradients summed over the group
        if params and (name[1] or name[0] in (*summed, "fsdp")):
            if name[0] in summed and not name[1]:  # the sync as priced
                waited, serial = row.sync_s[option], row.sync_serial_s[option]
                text = f"all-reduce of its {_mb(params)} of gradients {_ms(waited)}"
                if name[0] == "context_parallel":  # its K/V, gathered and scattered
                    text += f", activation traffic {_ms(row.traffic_s[option])}"
            else:
                waited, serial = row.gather_s[option], row.gather_serial_s[option]
                text = (f"all-gathers and reduce-scatter of its {_mb(params)} of "
                        f"weights {_ms(waited)}")
            if serial - waited >= 1e-6:
                text += f" ({_ms(serial - waited)} more beside compute)"
            moved = row.traffic_s[option] - row.gather_s[option]  # a tp group's, beside
            if name[1] and moved >= 1e-6:
                text += f", activation traffic {_ms(moved)}"
            return text + (f", layout changes {_ms(reshard)}" if reshard >= 1e-6 else "")
        text = f"activation traffic {_ms(reshard + row.traffic_s[option])}"
        if self.weighed.dp > 1 and params and row.sync_serial_s[option] >= 1e-6:
            text += f", all-reduce of its gradients over dp {_ms(row.sync_s[option])}"
        return text


def _label(row: Options, option: int) -> str:
    name = row.names[option]
    if row.strategies[option].model_parallel:
        return f"model-parallel ({name})"
    return name.replace("_", "-")


def reasons(weighed: Weighed, choice) -> list[str]:
    """One sentence per layer (a sink excluded), index-aligned with weighed.layers."""
    sentences = _Sentences(weighed, choice)
    return [sentences.reason(i) for i in range(len(weighed.layers))]
