"""The second memory row of a pipeline rank: the stage rows without the optimizer's
temporaries, plus what FSDP's backward holds beside them.

A rank's step holds Σ(W - T) + f·A + held (planner.pipeline.stage_held.peak_bytes): W an
option's weights with the optimizer temporaries T its row carries, A its activations per
microbatch, f its stage's microbatches in flight. The stage rows price held by T, which
held is at least (the first row). Where the rank holds FSDP layers, held is also at least
their backward: the largest gathered group with its whole gradient, the next one
prefetched and the previous one's reduce-scatter input (strategies.step_memory:
top1 + top3 of the gathered bytes g), so at least (4/3)·top3(g). On a 405 B Llama with
tp = 1 that is 14 GB a rank, where T is 3 GB: shapes whose first row fits with FSDP
layers, and whose plans do not, kept the search's bound 12% under its plans.

top3 is not a sum over layers, but it is the least over τ >= 0 of 3τ + Σ max(0, g - τ),
reached at τ = 0 or at one of the g, so for any λ >= 0 the Lagrangian of this row,

    min over τ of [4λτ + Σ_layers min_o (work_o + λ·(W_o - T_o + f·A_o
                                                    + (4/3)·max(0, g_o - τ)))] - λ·budget,

is at most the work of any choice that fits the row: for each τ one least per layer, as
the first row's bounds take them (planner.pipeline.stages._dual_stage_bounds,
stage_loads.memory_bound). Where the g take many values they are rounded down to a few
levels first (a smaller g only lowers the row: still a bound), so that τ takes few.
"""

from __future__ import annotations

import math

import numpy as np

LEVELS = 6  # the most distinct gathered sizes the bounds try as τ (besides 0)
STEP = 2 ** 0.25  # the rounding grid of the gathered sizes: within 16% below each
SHARE = 4 / 3  # (4/3)·top3(g): top1 + top3 is at least top3 + top3 / 3


def levels(tables, one: bool = False) -> tuple[np.ndarray, np.ndarray] | None:
    """(the gathered bytes the row reads, (distinct, width); the values τ takes: 0 and
    each of those sizes) of a problem's tables: the sizes themselves where they are at
    most LEVELS, else rounded down to the grid and the smallest to 0 past LEVELS of them;
    None where no option gathers anything (no row to add). `one`: a single size besides 0,
    the one the model gathers most bytes at or above (a transformer's MLP), every size
    rounded down to it or to 0: where τ is a choice per rank in a program, two values
    keep that choice a binary."""
    g = tables.gathered_bytes
    if not (g > 0).any():
        return None
    sizes = np.unique(g[g > 0])[::-1]
    rounded = g
    if len(sizes) > LEVELS and not one:
        top = float(sizes[0])
        rounded = np.where(g > 0, top * STEP ** np.floor(
            np.log(np.maximum(g, 1e-300) / top) / np.log(STEP) + 1e-9), 0.0)
        sizes = np.unique(rounded[rounded > 0])[::-1][:LEVELS]
    if one:
        many = tables.counts.sum(axis=1)[:, None]  # how often each distinct layer occurs
        size = sizes[np.argmax([(many * (g >= x)).sum() * x for x in sizes])]
        return np.where(g >= size, size, 0.0), np.array([0.0, size])
    rounded = np.where(rounded >= sizes[-1], rounded, 0.0)
    return rounded, np.concatenate([[0.0], sizes[::-1]])


def memory(tables, f: int, rounded: np.ndarray, taus: np.ndarray) -> np.ndarray:
    """(len(taus), distinct, width): each option's part of the row at each τ, f
    microbatches in flight: W - T + f·A + (4/3)·max(0, g - τ); +inf past a layer's
    options."""
    valid = np.isfinite(tables.microbatch_s)
    own = tables.rest_bytes + f * tables.activation_bytes
    priced = own[None] + SHARE * np.maximum(rounded[None] - taus[:, None, None], 0.0)
    return np.where(valid[None], priced, math.inf)


def least_memory_by_unit(tables, f: int) -> tuple[np.ndarray, np.ndarray] | None:
    """(per τ and unit, Σ over its layers of the least row memory; per τ, the 4τ the row
    adds once per rank), or None where nothing is gathered: a run of units [i, j) on one
    rank needs at least min over τ of 4τ + Σ_{i <= u < j} of the first."""
    found = levels(tables)
    if found is None:
        return None
    rounded, taus = found
    return tables.least_by_unit(memory(tables, f, rounded, taus)), 3 * SHARE * taus


def lagrangian_by_unit(tables, work: np.ndarray, f: int, lams: np.ndarray, one: bool = False
                       ) -> tuple[np.ndarray, np.ndarray] | None:
    """(per τ, λ and unit: Σ over its layers of min_o (work_o + λ·row_o); per τ and λ the
    4λτ added once per rank), for `work` (distinct, width); None where nothing is
    gathered. A rank's Lagrangian bound is the least over τ of its units' sum plus that
    term, less λ·budget (module docstring). `one`: two values of τ (levels)."""
    found = levels(tables, one)
    if found is None:
        return None
    rounded, taus = found
    row = memory(tables, f, rounded, taus)  # (τ, distinct, width)
    valid = np.isfinite(row)  # past a layer's options: +inf, which λ = 0 would make nan
    priced = np.where(valid[:, None], work[None, None] + lams[None, :, None, None]
                      * np.where(valid, row, 0.0)[:, None], math.inf)
    return tables.least_by_unit(priced), 3 * SHARE * taus[:, None] * lams[None, :]


def rank_bytes(problem, choice, layers_on_rank, flights_of) -> float:
    """What the row holds on one rank for `choice`, its layers `layers_on_rank` (each with
    the microbatches in flight flights_of[i]): Σ(W - T + f·A) + top1 + top3 of the
    gathered bytes, as the step holds them (for tests: the row is below this)."""
    total, gathered = 0.0, []
    for i in layers_on_rank:
        layer, c = problem.layers[i], choice[i]
        temp = 0.0 if layer.temp_bytes is None else float(layer.temp_bytes[c])
        total += (float(layer.weight_bytes[c]) - temp
                  + flights_of[i] * float(layer.activation_bytes[c]))
        if layer.gathered_bytes is not None and layer.gathered_bytes[c] > 0:
            gathered.append(float(layer.gathered_bytes[c]))
    top = sorted(gathered, reverse=True)[:3]
    return total + (top[0] + sum(top) if top else 0.0)
