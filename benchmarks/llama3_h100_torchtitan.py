"""torchtitan's published Llama 3.1 8B run on 8 H100 beside hyplan: hyplan's plan for it, and
hyplan's price of torchtitan's own configuration (FSDP over 8, bf16, seq 8192, local batch
2), each as tokens/s per GPU against the published 5,762 (no torch.compile).

    PYTHONPATH=$PWD python benchmarks/llama3_h100_torchtitan.py

The run and its setup: benchmarks/llama3_h100_202412_torchtitan.md. Until mixed precision
lands (branch `precision`), the cluster dtype bfloat16 sets the FLOP rates only: weights,
activations and collectives are priced at the model's fp32 sizes.
"""

from __future__ import annotations

import time

import planner
from gpu_model_check import RUNS, bf16, price_fsdp
from planner.report.throughput import llm_throughput
from profiler.presets import load_llm

PUBLISHED = 5762  # tokens/s/GPU, torchtitan table 1, FSDP without torch.compile


def main() -> None:
    run = RUNS["titan8"]
    cluster = bf16(run.devices)
    peak = cluster.device.peak_flops["bfloat16"]
    print(f"torchtitan: {run.title}\n  published {PUBLISHED:,} tokens/s/GPU ({run.source})\n")

    model, inputs, kwargs, shape, seq = load_llm("llama3-8b", run.global_batch, run.seq)
    started = time.perf_counter()
    try:
        plan = planner.optimize(model, cluster, example_inputs=inputs, example_kwargs=kwargs)
        t = llm_throughput(plan.predicted.step_time_s, run.global_batch, seq, 8, shape, peak)
        print(plan.explain(), end="")
        print(f"hyplan's plan: {t.tokens_per_s_per_device:,.0f} tokens/s/GPU predicted, MFU "
              f"{t.mfu:.1%} ({t.tokens_per_s_per_device / PUBLISHED - 1:+.1%} against "
              f"{PUBLISHED:,}); planned in {time.perf_counter() - started:.1f} s\n")
    except planner.PlanDoesNotFit as error:
        print(f"hyplan's plan: none ({error}); planned in "
              f"{time.perf_counter() - started:.1f} s\n")

    step_s, terms, shape, _ = price_fsdp(run)
    t = llm_throughput(step_s, run.global_batch, seq, 8, shape, peak)
    print(f"hyplan's price of torchtitan's configuration (FSDP on every layer with weights, "
          f"data parallel elsewhere, no recompute priced):")
    for what, seconds in terms.items():
        print(f"  {what:<55s} {seconds * 1e3:9,.1f} ms")
    published_step = run.global_batch * seq / PUBLISHED / 8
    print(f"  step {step_s * 1e3:,.0f} ms (published {published_step * 1e3:,.0f} ms): "
          f"{t.tokens_per_s_per_device:,.0f} tokens/s/GPU predicted beside {PUBLISHED:,} "
          f"published ({t.tokens_per_s_per_device / PUBLISHED - 1:+.1%}); MFU predicted "
          f"{t.mfu:.1%}, published {PUBLISHED * t.flops_per_token / peak:.1%}")


if __name__ == "__main__":
    main()
