"""A 7 B Llama on 4x8xH100 at a global batch of 64 sequences of 2,048 tokens, planned in fp32
and in bf16-mixed: predicted step time (compute / communication / optimizer), memory per
device, tokens/s and the FLOP rate it implies.

    PYTHONPATH=$PWD python benchmarks/precision.py [--devices 4x8xH100] [--batch 64]

The model is built as benchmarks/scale.py builds it (transformers LlamaConfig on the meta
device: nothing downloaded, nothing allocated). Planning time depends on the machine's load.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import planner  # noqa: E402
from scale import llama_7b  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--devices", default="4x8xH100")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--precisions", default="fp32,bf16-mixed")
    args = parser.parse_args()
    model, inputs, kwargs = llama_7b(args.batch, args.seq)
    params = sum(p.numel() for p in model.parameters())
    tokens = args.batch * args.seq
    # 6 FLOPs per parameter per token (forward 2, backward 4), as MFU is usually counted
    model_flops = 6 * params * tokens
    print(f"Llama 7B ({params / 1e9:.2f} B parameters), batch {args.batch} x {args.seq} tokens, "
          f"{args.devices}")
    for precision in args.precisions.split(","):
        started = time.perf_counter()
        plan = planner.optimize(model, args.devices, inputs, kwargs, measure=False,
                                precision=precision)
        p = plan.predicted
        n = plan.num_devices
        rate = model_flops / p.step_time_s / n
        strategies = {}
        for layer in plan.layers:
            key = layer.strategy + ("+recompute" if layer.recompute else "")
            strategies[key] = strategies.get(key, 0) + 1
        print(f"  {plan.precision:>10}: step {p.step_time_s:.3f} s = compute {p.compute_s:.3f} "
              f"+ communication {p.communication_s:.3f} + optimizer {p.other_s:.3f}; memory "
              f"{max(p.memory_bytes) / 1e9:.1f} GB of {p.memory_limit_bytes / 1e9:.1f} GB per "
              f"device; {tokens / p.step_time_s:,.0f} tokens/s ({tokens / p.step_time_s / n:,.0f} "
              f"per device); {rate / 1e12:.0f} TFLOP/s per device (6·N·tokens); planned in "
              f"{time.perf_counter() - started:.0f} s; layers {dict(sorted(strategies.items()))}",
              flush=True)


if __name__ == "__main__":
    main()
