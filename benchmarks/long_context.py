"""Llama 3 8B on 8 H100 at 32K-256K tokens: the context-parallel plan hyplan chooses beside
torchtitan's published long-context runs.

    PYTHONPATH=$PWD python benchmarks/long_context.py [32768 65536 131072 262144]

torchtitan's benchmarks/llama3_h100_202412_torchtitan.md (pytorch/torchtitan, commit
820504e of that file), table 2, quoted:

> **Table 2** FSDP + CP + torch.compile + Float8. Llama 3.1 8B model. 8 GPUs. Local batch
> size 1. Full activation checkpointing.
>
> | Parallelism | Sequence Length | TPS/GPU | Memory(GiB) |
> | FSDP 8, CP 1 | 32768 | 3,890 | 83.9 |
> | FSDP 4, CP 2 | 65536 | 2,540 | 84.2 |
> | FSDP 2, CP 4 | 131072 | 1,071 | 84.0 |
> | FSDP 1, CP 8 | 262144 | 548 | 84.5 |

Local batch 1 per FSDP rank: global batch 8, 4, 2 and 1 sequences. Their hardware (same
file): Grand Teton hosts of 8 H100 (96 GB HBM2e, 2.4 TB/s, 500 W) over NVLink; hyplan's
`8xH100-96GB` is that device.

Per sequence length, three figures, each from the "cp" baseline (planner.context_plan:
planner.price's costs, planner.ilp within memory):
- hyplan's choice: the best cp degree, weight mode (DDP or FSDP) and full activation
  checkpointing or none, the fastest that fits, priced with torch.compile and float8 tensorwise on (strategies.kernel_levers), as
  torchtitan ran;
- the same, levers off (eager bf16: what hyplan's own executor runs);
- the 3-D search's own plan (mesh "3d": cp a degree beside pp, dp and tp, weights and
  recomputation picked layer by layer), compile and float8;
- torchtitan's configuration priced: its cp, FSDP, every block recomputed (full
  activation checkpointing) with compile and float8.
The model is the llama3-8b preset with its positions raised to the sequence (Llama 3.1's
RoPE scaling changes no cost), traced by torch.export on meta, three blocks repeated
(tracer "blocks"). Nothing runs on a GPU.
"""

from __future__ import annotations

import sys
import time

from planner.baseline import baseline
from planner.optimize import optimize
from planner.context_plan import priced
from planner.profiled import profiled_graph
from planner.report.throughput import llm_throughput, plan_throughput
from planner.search import CostCache
from profiler.presets import build_llm, llm_shape, preset_config
from strategies.kernel_levers import Levers
from strategies.parse import parse_devices

DEVICES = "8xH100-96GB"
LEVERS = Levers(compile=True, float8="tensorwise")  # torchtitan's table 2
# sequence length -> (torchtitan's cp, published tokens/s/GPU); global batch = 8 / cp
PUBLISHED = {32768: (1, 3890), 65536: (2, 2540), 131072: (4, 1071), 262144: (8, 548)}


def llama(seq: int, batch: int):
    """The llama3-8b preset on meta at `seq` tokens: (model, inputs, kwargs, shape)."""
    config = preset_config("llama3-8b")
    config.max_position_embeddings = seq
    model, inputs, kwargs = build_llm(config, batch, seq)
    return model, inputs, kwargs, llm_shape(model, config, "llama3-8b")


def cluster(levers: Levers):
    return parse_devices(DEVICES).model_copy(update={"levers": levers})


def row(seq: int) -> None:
    titan_cp, published = PUBLISHED[seq]
    batch = 8 // titan_cp
    model, inputs, kwargs, shape = llama(seq, batch)
    print(f"== {seq:,} tokens, global batch {batch} (torchtitan: FSDP {8 // titan_cp}, "
          f"CP {titan_cp}, full AC, compile + float8: {published:,} tokens/s/GPU)")
    for label, levers in (("hyplan, compile + float8", LEVERS), ("hyplan, eager bf16", Levers())):
        started = time.perf_counter()
        plan = baseline(model, cluster(levers), "cp", inputs, kwargs, optimizer="adamw",
                        tracer="blocks")
        tps = plan_throughput(plan, shape, seq).tokens_per_s_per_device
        cp = plan.context_parallel
        recomputed = len(plan.recompute_blocks)
        print(f"  {label:<26s} cp {cp.degree} x dp {8 // cp.degree} "
              f"{'FSDP' if cp.sharded else 'DDP '}  step {plan.predicted.step_time_s:7.2f} s  "
              f"{tps:6,.0f} tokens/s/GPU ({tps / published - 1:+.0%})  memory "
              f"{max(plan.predicted.memory_bytes) / 2**30:5.1f} GiB  {recomputed} blocks "
              f"recomputed  [{time.perf_counter() - started:.0f} s]")
        print(f"    why: {cp.why}")
        _terms(plan)
    _searched(model, inputs, kwargs, shape, seq, published)
    _titan(seq, batch, titan_cp, published, model, inputs, kwargs, shape)


def _searched(model, inputs, kwargs, shape, seq, published) -> None:
    """The 3-D search's own plan (mesh "3d": pipeline x data x tensor x context, each
    layer's weights and each block's recomputation its program's pick), compile + float8."""
    started = time.perf_counter()
    plan = optimize(model, cluster(LEVERS), inputs, kwargs, optimizer="adamw", tracer="blocks",
                    mesh="3d")
    tps = plan_throughput(plan, shape, seq).tokens_per_s_per_device
    mesh = " x ".join(f"{n} {k}" for n, k in zip(plan.mesh.dim_names, plan.mesh.shape))
    sharded = sum(l.shards_weights for l in plan.layers
                  if l.param_bytes > 0)
    print(f"  {'3-D search, compile+fp8':<26s} {mesh}  step "
          f"{plan.predicted.step_time_s:7.2f} s  {tps:6,.0f} tokens/s/GPU "
          f"({tps / published - 1:+.0%})  memory "
          f"{max(plan.predicted.memory_bytes) / 2**30:5.1f} GiB  "
          f"{len(plan.recompute_blocks)} blocks recomputed, {sharded} layers FSDP  "
          f"[{time.perf_counter() - started:.0f} s, {plan.solver.status}]")
    if plan.context_parallel is not None:
        print(f"    why: {plan.context_parallel.why}")


def _titan(seq, batch, cp, published, model, inputs, kwargs, shape) -> None:
    """torchtitan's own configuration priced: its cp, FSDP, every block recomputed; and its
    terms: the K/V all-gather and reduce-scatter, what full AC adds (the same plan
    without it, fitting or not)."""
    graph, priced_on = profiled_graph(model, cluster(LEVERS), inputs, kwargs, tracer="blocks")
    cache = CostCache(graph, priced_on, "adamw")
    budget = priced_on.device.memory_bytes
    tried, plain = priced(cache, cp, True, True, budget), priced(cache, cp, True, False, budget)
    tps = llm_throughput(tried.step_s, batch, seq, 8, shape,
                         priced_on.device.peak_flops["bfloat16"])
    print(f"  {'torchtitan config priced':<26s} cp {cp} x dp {8 // cp} FSDP  step "
          f"{tried.step_s:7.2f} s  {tps.tokens_per_s_per_device:6,.0f} tokens/s/GPU "
          f"({tps.tokens_per_s_per_device / published - 1:+.0%})  memory "
          f"{max(tried.peak) / 2**30:5.1f} GiB  every block recomputed; MFU {tps.mfu:.1%} "
          f"(published: {tps.mfu * published / tps.tokens_per_s_per_device:.1%})")
    rows, choice = tried.choices.layers, tried.solution.choice
    notes = [row.costs[c].notes for row, c in zip(rows, choice)]
    kv = sum(n.get("kv_all_gather_s", 0.0) + n.get("kv_reduce_scatter_s", 0.0) for n in notes)
    print(f"    terms: K/V all-gather + reduce-scatter {kv:.2f} s, full AC "
          f"+{tried.step_s - plain.step_s:.2f} s (without it: {max(plain.peak) / 2**30:.0f} "
          f"GiB)")


def _terms(plan) -> None:
    """The step's split and the attention blocks' share, so an error can be read."""
    p = plan.predicted
    attention = [l for l in plan.layers if l.strategy.startswith("context_parallel")]
    # a recomputed block's extra forward sits in its layers' step beside their compute,
    # which planner.plan3d reports inside communication_s (see the torchtitan line's terms)
    print(f"    compute {p.compute_s:.2f} s (attention blocks "
          f"{sum(l.compute_s for l in attention):.2f}), communication and recompute "
          f"{p.communication_s:.2f} s (attention blocks' {sum(l.communication_s for l in attention):.2f}), "
          f"optimizer {p.other_s:.2f} s")


def main(seqs: list[int]) -> None:
    print(f"Llama 3 8B, {DEVICES}, AdamW, bf16-mixed; hyplan's 'cp' baseline beside "
          f"torchtitan's table 2\n")
    for seq in seqs:
        row(seq)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or list(PUBLISHED))
