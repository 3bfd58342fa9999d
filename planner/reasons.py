"""Why each layer got its strategy, in plain words, from the solver's own numbers.

For a layer, every other option is priced with its neighbours held as planned: its own
time and the layout changes on its edges. The cheapest alternative of the other kind
(data-parallel against model-parallel) is what the sentence compares with.
"""

from __future__ import annotations

from planner.choices import Choices
from planner.problem import Problem


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds >= 1e-4 else f"{seconds * 1e6:.0f} µs"


def _mb(nbytes: float) -> str:
    return f"{nbytes / 1e6:.0f} MB" if nbytes >= 1e6 else f"{nbytes / 1e3:.0f} KB"


def _edge_time(problem: Problem, choice: list[int], node: int, option: int) -> float:
    """Layout-change time on the edges of `node` if it ran `option`, others as chosen."""
    total = 0.0
    for e in problem.edges:
        if e.src == node:
            total += float(e.cost_s[option, choice[e.dst]])
        if e.dst == node:
            total += float(e.cost_s[choice[e.src], option])
    return total


def _label(strategy) -> str:
    if strategy.model_parallel:
        return f"model-parallel ({strategy.name})"
    return strategy.name.replace("_", "-")


def _traffic(choices: Choices, choice: list[int], node: int, option: int) -> str:
    row = choices.layers[node]
    strategy, cost, priced = row.strategies[option], row.costs[option], row.prices[option]
    if strategy.name in ("data_parallel", "fsdp") and row.layer.param_bytes:
        if strategy.name == "data_parallel":  # the sync as priced: on a GPU beside backward
            waited, serial = priced.sync_s, priced.sync_serial_s
            text = f"all-reduce of its {_mb(row.layer.param_bytes)} of gradients {_ms(waited)}"
        else:
            waited = cost.communication_s
            serial = waited + cost.notes.get("beside_compute_s", 0.0)
            text = (f"all-gathers and reduce-scatter of its {_mb(row.layer.param_bytes)} of "
                    f"weights {_ms(waited)}")
        if serial - waited >= 1e-6:
            text += f" ({_ms(serial - waited)} more beside compute)"
        reshard = _edge_time(choices.problem, choice, node, option)
        return text + (f", layout changes {_ms(reshard)}" if reshard >= 1e-6 else "")
    moved = _edge_time(choices.problem, choice, node, option) + cost.communication_s
    return f"activation traffic {_ms(moved)}"


def reasons(choices: Choices, choice: list[int]) -> list[str]:
    """One sentence per layer (the sink excluded), index-aligned with choices.layers."""
    problem = choices.problem
    out = []
    for i, row in enumerate(choices.layers):
        c = choice[i]
        chosen = row.strategies[c]
        if len(row.strategies) == 1:
            out.append(f"{_label(chosen)}: the only strategy that applies here")
            continue
        if row.layer.is_input:
            out.append("each rank passes its rows" if chosen.name == "data_parallel"
                       else "each rank passes the whole batch (the first layers are model-parallel)")
            continue
        # the prices the solver read (planner.price), not the catalog's own costs
        base = row.prices[c].time_s + _edge_time(problem, choice, i, c)
        deltas = [(row.prices[j].time_s + _edge_time(problem, choice, i, j) - base, j)
                  for j in range(len(row.strategies)) if j != c]
        other_kind = [d for d in deltas if row.strategies[d[1]].model_parallel != chosen.model_parallel
                      and row.strategies[d[1]].name != "replicate"]
        delta, j = min(other_kind or deltas)
        alt = row.strategies[j]
        if not row.layer.param_bytes and not chosen.model_parallel:
            head = f"{_label(chosen)}: follows its neighbours' layout ({chosen.gives.value})"
        else:
            head = f"{_label(chosen)}: {_traffic(choices, choice, i, c)}"
        out.append(f"{head}; {_label(alt)} would add {_ms(delta)} per step "
                   f"({_traffic(choices, choice, i, j)})")
    return out
