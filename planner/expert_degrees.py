"""Expert parallelism carved out of a shape's data-parallel ranks: the 3-D search's options
for an experts layer whose EP group spans several dp replicas.

On a shape (pp, dp, tp), an experts layer (strategies.experts) may run expert parallel over
its tp group alone (the catalog's own "expert_parallel") or over K = tp·e consecutive ranks
of its stage, the tp groups of e dp replicas together, as torchtitan carves its EP group out
of dp_shard (and tp, with expert tensor parallelism 1) and Megatron-Core its
--expert-model-parallel-size out of the data-parallel ranks: "expert_parallel:epK". Each
rank keeps its own rows (rows/tp of its replica's microbatch, as every BATCH layout of a tp
group), sends each (token, expert) pair to the rank of the K holding that expert and gets
the outputs back; it holds E/K experts, which the dp/e groups beside it hold too: their
gradients summed over those dp/e ranks once a step, or the experts FSDP-sharded over them
("expert_parallel:epK+fsdp").

Priced as what it is, with nothing of its own: the catalog's ExpertParallel over a group
of K ranks that holds the e replicas' rows (planner.search.CostCache.layer at tp·e ranks
and rows·e rows: the same compute per rank, a K-rank all-to-all, 1/K of the weights),
replicated or sharded over dp/e by planner.price.price, so every rule the other options
follow (the group link, DDP's buckets, FSDP's gathers beside compute) applies to it.
"""

from __future__ import annotations

from strategies.experts import ExpertParallel, _experts, parse_name


def degrees(layer, dp: int, tp: int, rows: int, batch: int) -> list[int]:
    """The e > 1 (dp replicas an EP group spans) a shape may offer `layer`: where it holds
    experts, e divides dp, the experts split evenly over tp·e ranks, and the e replicas'
    rows are rows of the batch (`carved` then asks the catalog over that wider group)."""
    experts = _experts(layer)
    if not experts:
        return []
    return [e for e in range(2, dp + 1)
            if dp % e == 0 and experts % (tp * e) == 0 and rows * e <= batch]


def carved(wide_strategies, tp: int, e: int) -> ExpertParallel | None:
    """The option over K = tp·e ranks where the catalog offers the layer expert
    parallelism over that group (`wide_strategies`: its options there): priced by
    ExpertParallel over a K-rank context (its group the whole context: no gradient sync of
    its own, planner.price adds the dp/e one), named with its degree for the plan and the
    executor. None where it is not offered."""
    if not any(isinstance(s, ExpertParallel) and not s.ep for s in wide_strategies):
        return None
    return ExpertParallel(ep=tp * e)


def sharing(name: str, dp: int, tp: int) -> tuple[int, int]:
    """(the ranks of a dp group that hold the same weights, the ranks a weight is split
    over) of option `name` on a (dp, tp) shape: (dp, tp) for every option but a carved
    expert-parallel one, (dp/e, tp·e) for that (what its FSDP variant gathers over)."""
    parsed = parse_name(name.split("+")[0])
    if parsed is None or parsed[0] <= tp:
        return dp, tp
    e = parsed[0] // tp
    return dp // e, tp * e


def canonical(pin: str | None, tp: int) -> str | None:
    """A pin of "expert_parallel:epK" on a shape whose tp group is those K ranks names the
    catalog's own option there, "expert_parallel" (EP over the tp group), suffix kept."""
    if pin is None:
        return None
    base, plus, suffix = pin.partition("+")
    parsed = parse_name(base)
    if parsed is None or parsed != (tp, False):
        return pin
    return "expert_parallel" + plus + suffix
