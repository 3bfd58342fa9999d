"""The mixture-of-experts presets (profiler.presets: DeepSeek-V3, Qwen3-235B-A22B,
Mixtral-8x22B, Llama 4 Scout, gpt-oss-120b) planned as `hyplan plan PRESET --devices D
--seq 4096 --batch B` plans them, on the smallest H100 cluster of a ladder that fits.

    PYTHONPATH=$PWD python benchmarks/moe_presets.py [--presets a,b] [--search-time S] [--batch B]

The global batch is 1,024 sequences of 4,096 tokens by default (4 M tokens a step, the
order of the published runs: DeepSeek-V3 trained at up to 15,360 sequences of 4K,
Megatron-Core's MoE runs at 256-1,024); a batch of 8 leaves one microbatch on 64-128 GPUs
and a bubble that is most of every step.

Per preset: the cluster tried first is the smallest of the ladder whose memory holds the
weights, gradients and Adam state at bf16-mixed's 16 bytes per parameter (a lower bound:
no activations); each cluster is planned with `planner.optimize(mesh="auto",
tracer="blocks")` (the 1-D integer program beside the 3-D pp x dp x tp search, whose
experts layers each pick an EP degree carved out of dp x tp: planner.expert_degrees), and a
PlanDoesNotFit moves to the next; `--nodes 32,64` plans each of those clusters instead. The model is traced once before the first cluster
(planner.profiled keeps the graph), so that each cluster's search_time_s is its search's,
not the trace's. Printed: the devices, the plan's mesh and its
kinds of weighted layers, predicted step time, tokens/s per GPU, MFU, planning time.
"""

from __future__ import annotations

import argparse
import math
import os
import time
from collections import Counter

import planner
from planner.profiled import trace_model
from planner.report.throughput import plan_throughput
from profiler.presets import load_llm

PRESETS = ("gpt-oss-120b", "llama4-scout", "mixtral-8x22b", "qwen3-235b-a22b", "deepseek-v3")
# nodes of 8 H100: the ladder of clusters tried, smallest first
NODES = (1, 2, 4, 8, 16, 32, 64)
SEQ, BATCH = 4096, 1024
# weights, gradients and Adam's two moments at bf16-mixed: fp32 master 4 + grad 4 + 8 state
BYTES_PER_PARAM = 16
H100_BYTES = 80e9
TRACER = "blocks"


def first_nodes(params: int) -> int:
    """The smallest rung whose devices hold the model's training state at all."""
    need = math.ceil(params * BYTES_PER_PARAM / H100_BYTES / 8)
    return next((n for n in NODES if n >= need), NODES[-1])


def describe(plan, shape) -> str:
    dims = " x ".join(f"{n} {s}" for n, s in zip(plan.mesh.dim_names, plan.mesh.shape))
    kinds = Counter(l.strategy + ("+fsdp" if l.dp_shard else "")
                    for l in plan.layers if l.param_bytes)
    t = plan_throughput(plan, shape, SEQ)
    p = plan.predicted
    return (f"  mesh {dims} ({plan.mesh_choice or '3-D'}); weighted layers: "
            + ", ".join(f"{k} {n}" for k, n in kinds.most_common())
            + f"\n  step {p.step_time_s:.3f} s = compute {p.compute_s:.3f} + communication "
            f"{p.communication_s:.3f} + optimizer {p.other_s:.3f} + bubble {p.bubble_s:.3f}"
            + (f" ({plan.pipeline.microbatches} microbatch(es), {plan.pipeline.schedule})"
               if plan.pipeline is not None else "")
            + f"\n  step {p.step_time_s:.3f} s, {t.tokens_per_s_per_device:,.0f} tokens/s/GPU, "
            f"MFU {t.mfu:.1%}, memory {max(p.memory_bytes) / 1e9:.1f} of "
            f"{p.memory_limit_bytes / 1e9:.1f} GB; solver {plan.solver.status}")


def run(preset: str, search_time_s: float, batch: int = BATCH,
        nodes: tuple[int, ...] | None = None) -> None:
    model, inputs, kwargs, shape, seq = load_llm(preset, batch, SEQ)
    print(f"== {preset}: {shape.params / 1e9:.1f} B parameters ({shape.active_params / 1e9:.1f} B "
          f"active), seq {seq}, batch {batch} ==", flush=True)
    # traced once, ahead: optimize's search_time_s counts from its call's start, and the
    # first cluster's call paid the trace out of it (DeepSeek-V3 ~90 s, gpt-oss 70-100 s
    # of a 30 s budget: "no plan found within the time budget" on the rung that fits)
    wall = time.perf_counter()
    trace_model(model, inputs, kwargs, (), TRACER)
    print(f"traced in {time.perf_counter() - wall:.1f} s (tracer {TRACER!r}, kept for every "
          f"cluster below)", flush=True)
    ladder = nodes is None
    for count in nodes or [n for n in NODES if n >= first_nodes(shape.params)]:
        devices = f"{count}x8xH100" if count > 1 else "8xH100"
        wall, cpu = time.perf_counter(), time.process_time()
        try:
            plan = planner.optimize(model, devices, example_inputs=inputs,
                                    example_kwargs=kwargs, mesh="auto", tracer=TRACER,
                                    search_time_s=search_time_s)
        except (planner.PlanDoesNotFit, ValueError) as error:
            print(f"{devices}: no plan ({time.perf_counter() - wall:.1f} s): "
                  f"{str(error).splitlines()[0][:300]}", flush=True)
            continue
        print(f"{devices}: planned in {time.perf_counter() - wall:.1f} s wall, "
              f"{time.process_time() - cpu:.1f} s CPU (load {os.getloadavg()[0]:.2f})")
        print(describe(plan, shape), flush=True)
        if ladder:  # the smallest rung that fits; --nodes plans each one asked for
            return


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--presets", default=",".join(PRESETS))
    parser.add_argument("--search-time", type=float, default=30.0,
                        help="planner.optimize's search_time_s per cluster (default 30)")
    parser.add_argument("--batch", type=int, default=BATCH,
                        help=f"global batch in sequences of {SEQ} tokens (default {BATCH})")
    parser.add_argument("--nodes", default=None,
                        help="comma-separated node counts (of 8 H100) to plan each of, "
                        "instead of the smallest of the ladder that fits")
    args = parser.parse_args()
    nodes = tuple(int(n) for n in args.nodes.split(",")) if args.nodes else None
    for preset in args.presets.split(","):
        run(preset, args.search_time, args.batch, nodes)


if __name__ == "__main__":
    main()
