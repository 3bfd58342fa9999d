"""Why each layer got its strategy, in plain words, from the solver's own numbers: one
sentence for every plan kind, a 1-D plan (planner.assemble) and a 3-D one (planner.plan3d).

For a layer, every other option is priced per step with its neighbours held as planned: its
own time (m microbatches and the once-a-step part) and the layout changes on its edges (m
times). The cheapest alternative of the other kind (data-parallel against model-parallel) is
what the sentence compares with. A 1-D plan is the case of one microbatch and no dp group:
`of_choices` and `of_built` turn each planner's options into the one input, `Weighed`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from planner import dp_shard
from planner.problem import Edge
from profiler.graph import Layer
from strategies.catalog import Strategy

if TYPE_CHECKING:
    from planner.choices import Choices
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


@dataclass(frozen=True)
class Weighed:
    """Every layer's options and the edges between them, each edge's cost_s per step."""

    layers: tuple[Options, ...]  # node i of the edges is layers[i]; a sink may follow
    edges: tuple[Edge, ...]
    dp: int = 1  # the data-parallel group each layer is replicated over (1-D: none)


def of_choices(choices: Choices) -> Weighed:
    """A 1-D problem's options (planner.choices): one microbatch a step, no dp group; the
    catalog's "fsdp" gathers its weights in its own communication."""
    layers = []
    for row in choices.layers:
        fsdp = [s.name == "fsdp" for s in row.strategies]
        layers.append(Options(
            row.layer, row.strategies, tuple(s.name for s in row.strategies),
            tuple(p.time_s for p in row.prices), tuple(c.communication_s for c in row.costs),
            tuple(p.sync_s for p in row.prices), tuple(p.sync_serial_s for p in row.prices),
            tuple(c.communication_s if f else 0.0 for c, f in zip(row.costs, fsdp)),
            tuple(c.communication_s + c.notes.get("beside_compute_s", 0.0) if f else 0.0
                  for c, f in zip(row.costs, fsdp))))
    return Weighed(tuple(layers), choices.problem.edges)


def of_built(built: Built, microbatches: int, dp: int,
             stages: tuple[int, ...] | None = None) -> Weighed:
    """A 3-D shape's options (planner.search.Built) at `microbatches` a step, each layer
    replicated over `dp`; `stages`: each layer's stage, where there are several. An option
    sharded over dp (planner.dp_shard) waits per microbatch for its gathers beside its plain
    time (the catalog's compute and communication, and a recomputed forward)."""
    m, problem = microbatches, built.problem
    layers = []
    for i, layer in enumerate(built.layers):
        opts, costs = problem.layers[i], built.costs[i]
        n = len(opts.strategies)
        sync = built.sync_s[i] if built.sync_s else [0.0] * n
        serial = built.sync_serial_s[i] if built.sync_serial_s else [0.0] * n
        sharded = built.sharded[i] if built.sharded else [""] * n
        gather = [0.0] * n
        for c, cost in enumerate(costs):
            if sharded[c]:
                own = float(opts.microbatch_s[opts.plain_index(c)])
                gather[c] = m * (own - cost.compute_s - cost.communication_s)
        layers.append(Options(
            layer, tuple(built.strategies[i]), tuple(opts.strategies),
            tuple(m * float(t) + float(s) for t, s in zip(opts.microbatch_s, opts.step_s)),
            tuple(m * c.communication_s + g for c, g in zip(costs, gather)),
            tuple(float(s) for s in sync),
            tuple(float(s) for s in serial), tuple(gather), tuple(gather),
            stages[i] if stages is not None else None))
    edges = tuple(Edge(e.src, e.dst, e.cost_s * m) for e in problem.edges)
    return Weighed(tuple(layers), edges, dp)


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
        return (f"{where}{head}; {_label(row, j)} would add {_ms(delta)} per step "
                f"({self.traffic(i, j)})")

    def traffic(self, node: int, option: int) -> str:
        """What option `option` of `node` moves per step: its weights' traffic where it
        replicates or shards them over its ranks, else its activations'."""
        row = self.weighed.layers[node]
        params, reshard = row.layer.param_bytes, self.edge_time(node, option)
        name = dp_shard.split(row.names[option])
        if params and (name[1] or name[0] in ("data_parallel", "fsdp")):
            if name[0] == "data_parallel" and not name[1]:  # the sync as priced
                waited, serial = row.sync_s[option], row.sync_serial_s[option]
                text = f"all-reduce of its {_mb(params)} of gradients {_ms(waited)}"
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
