"""Sequence parallelism in figures: a GPT (examples/gpt.py, traced by fx on the meta device)
planned tensor-parallel over one node, with and without norms, dropout and residual adds
split by tokens: predicted step time, memory and activation memory per device, and how
many layers the solver put on their tokens.

    PYTHONPATH=$PWD python benchmarks/sequence_parallel.py [--devices 8xH100] [--layers 24]
        [--width 2048] [--seq 8192] [--batch 8]

Plans of the same 1-D problem (planner.choices, solved by planner.ilp), recomputation left
out so that the token split's own effect shows:
- "tensor parallel": Megatron's split (attention by heads, MLP column-then-row, rows never
  split), no token split; then every norm and residual add forced onto its tokens;
- "tensor + sequence parallel, solver's choice": the token split allowed;
- "hyplan (every strategy)": data parallel, fsdp and recompute as well;
each without a memory limit and within the device's memory. Nothing runs; planning time
depends on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

import gpt  # noqa: E402
from planner.choices import layer_choices  # noqa: E402
from planner.ilp import solve  # noqa: E402
from planner.problem import Infeasible  # noqa: E402
from profiler.trace import trace  # noqa: E402
from strategies import parse_devices  # noqa: E402
from strategies.catalog import weights_memory  # noqa: E402
from strategies.layouts import Layout  # noqa: E402


def megatron(layer, options):
    """Model-parallel or whole: no rows split (a replica's rows stay together)."""
    return [s for s in options if s.name != "data_parallel" and not s.name.startswith("fsdp")
            and not s.name.endswith("+recompute")]


def megatron_without_sp(layer, options):
    return [s for s in megatron(layer, options) if Layout.SEQUENCE not in (s.takes, s.gives)]


def megatron_all_sp(layer, options):
    """Every layer that can run on its tokens does."""
    kept = megatron(layer, options)
    return [s for s in kept if s.name == "sequence_parallel"] or kept


def report(label, graph, cluster, keep, budget=None):
    started = time.perf_counter()
    choices = layer_choices(graph, cluster, "adam", budget, keep=keep)
    try:
        solution = solve(choices.problem)
    except Infeasible as e:
        print(f"  {label:<45} does not fit ({str(e).split(';')[0]})")
        return None
    ctx = choices.context
    strategies = [row.strategies[solution.choice[i]] for i, row in enumerate(choices.layers)]
    costs = [row.costs[solution.choice[i]] for i, row in enumerate(choices.layers)]
    memory = choices.problem.memory_of(solution.choice)
    weights = sum(weights_memory(row.layer.param_bytes / (ctx.ranks if s.model_parallel else 1),
                                 ctx, sharded=s.name.startswith("fsdp"))
                  for row, s in zip(choices.layers, strategies))
    sp = sum(s.name.startswith("sequence_parallel") for s in strategies)
    print(f"  {label:<45} step {solution.objective_s * 1e3:8.2f} ms   memory "
          f"{memory / 1e9:6.2f} GB   activations {(memory - weights) / 1e9:6.2f} GB   "
          f"{sp:3d} layers on their tokens   solved in {time.perf_counter() - started:.1f} s")
    return memory


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="8xH100")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=8192)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--vocab", type=int, default=50304)
    args = parser.parse_args()
    with torch.device("meta"):
        model = gpt.GPT(args.layers, args.width, args.heads, args.seq, args.vocab)
        ids = torch.randint(0, args.vocab, (args.batch, args.seq))
    graph = trace(model, (ids,), leaf_modules=(gpt.CausalSelfAttention,))
    cluster = parse_devices(args.devices)
    params = sum(p.numel() for p in model.parameters())
    print(f"GPT {args.layers} layers x {args.width} ({params / 1e9:.2f} B parameters), batch "
          f"{args.batch} x {args.seq} tokens, {args.devices}, "
          f"{cluster.training_precision.describe()}, Adam")
    limit = cluster.device.memory_bytes
    rows = [("tensor parallel", megatron_without_sp), ("  every norm and add on its tokens",
            megatron_all_sp), ("tensor + sequence parallel, solver's choice", megatron),
            ("hyplan (every strategy)", None)]
    for title, budget in (("no memory limit", None),
                          (f"within {limit / 1e9:.1f} GB per device", limit)):
        print(f" {title}:")
        for label, keep in rows:
            report(label, graph, cluster, keep, budget)

if __name__ == "__main__":
    main()
