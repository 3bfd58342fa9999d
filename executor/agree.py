"""Before anything collective: the plan is this model's, and every rank holds the same plan.

Ranks that run different plans call different collectives (one scatters a weight while the
other broadcasts it) and deadlock until killed, with nothing saying why. So `parallelize`
first gathers a digest of each rank's plan in one small all_gather and raises PlanMismatch
on every rank at once, naming which ranks hold which plan. The model check is here too,
one function for both tracers, used by the executor and by `hyplan train` before launch.
"""

from __future__ import annotations

import hashlib
import json

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn

from planner.plan import Plan
from profiler.trace import fingerprint, fingerprint_modules, fx_trace
from strategies.catalog import leaf_types

HOW_TO_AGREE = ("make the plan once and hand it to every rank: planner.optimize under the "
                "process group does that, or Plan.load the same file")


class PlanMismatch(ValueError):
    """The plan was made for another model or another number of devices, or the ranks
    hold different plans."""


def plan_digest(plan: Plan) -> str:
    """sha256 of the plan's canonical JSON (sorted keys, no spaces), in hex."""
    text = json.dumps(plan.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def check_same_plan(plan: Plan) -> None:
    """Raise PlanMismatch on every rank unless all ranks of the default group hold `plan`'s
    digest (its first 64 bits, gathered as one int64 per rank)."""
    digest = plan_digest(plan)
    device = (torch.device("cuda", torch.cuda.current_device())
              if dist.get_backend() == "nccl" else torch.device("cpu"))
    first_64_bits = int.from_bytes(bytes.fromhex(digest[:16]), "big", signed=True)
    mine = torch.tensor([first_64_bits], dtype=torch.int64, device=device)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, mine)
    values = [int(t.item()) for t in gathered]
    if len(set(values)) == 1:
        return
    holders: dict[int, list[int]] = {}
    for rank, value in enumerate(values):
        holders.setdefault(value, []).append(rank)
    groups = "; ".join(f"{_ranks(ranks)} plan {value & (2**64 - 1):016x}"
                       for value, ranks in holders.items())
    raise PlanMismatch(f"plan mismatch across ranks: {groups} (this is rank "
                       f"{dist.get_rank()}); {HOW_TO_AGREE}")


def _ranks(ranks: list[int]) -> str:
    if len(ranks) == 1:
        return f"rank {ranks[0]} holds"
    return f"ranks {', '.join(map(str, ranks))} hold"


def traced_as_planned(model: nn.Module, plan: Plan, leaf_modules=()) -> fx.GraphModule:
    """The model traced with torch.fx as the planner traced it, refused if its graph is not
    the one the plan was made for (a plan for another model, or for this one edited since)."""
    gm = fx_trace(model, tuple(leaf_modules) + leaf_types(model))
    _refuse_other_model(model, plan, fingerprint(gm), "graph")
    return gm


def check_model(model: nn.Module, plan: Plan, leaf_modules=()) -> None:
    """Refuse a plan made for another model, whichever tracer made it: fx plans by the
    traced graph's fingerprint, export plans by the module tree's (executor.modules runs
    the module itself)."""
    if plan.tracer == "export":
        _refuse_other_model(model, plan, fingerprint_modules(model), "module")
    else:
        traced_as_planned(model, plan, leaf_modules)


def _refuse_other_model(model: nn.Module, plan: Plan, found: str, what: str) -> None:
    if found != plan.fingerprint:
        raise PlanMismatch(
            f"plan mismatch: the plan was made for a {plan.model} whose {what} fingerprint is "
            f"{plan.fingerprint}, this {type(model).__name__} has {found}; make the plan for "
            f"this model (planner.optimize, or `hyplan plan MODEL ... --json FILE`)")
