"""The 3-D search (pipeline x data x tensor) on GPT-style models planned on meta tensors.

1. Planning time of the full search for a 48-block transformer (width 4096, 9.7 B
   parameters, Adam, bf16-mixed as A100s train: 155 GB of fp32 weights and state) over 64
   devices (8x8xA100-80GB):
   candidates, how many were solved and pruned, seconds.
2. Must-show 1: the same model does not fit one A100-80GB; on 8xA100-80GB it gets a plan
   that fits, memory per device printed; with ample memory (a limit far above the need)
   the planner says whether a pipeline still pays.
3. Must-show 2: on 2x8xA100-80GB, where the tensor-parallel groups go, and the best plan
   of each mesh shape (tp across nodes included) from the search's own numbers.

    python benchmarks/pipeline_search.py [--layers 48] [--width 4096] [--batch 256]

Timings are wall-clock on the development machine (2 cores, shared with other work: the
figures are disturbed by it; the CPU time of this process is printed beside them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import gpt  # noqa: E402

from planner.report.explain import mesh_lines, pipeline_lines, search_lines, summary  # noqa: E402
from planner.profiled import PlanDoesNotFit  # noqa: E402
from planner.plan3d import optimize_3d  # noqa: E402


def model(layers: int, width: int, batch: int, seq: int = 1024):
    """The GPT built on meta (nothing allocated), and an example batch of token ids."""
    with torch.device("meta"):
        m = gpt.GPT(layers, width, max(1, width // 128), seq, 50304)
    return m, (torch.zeros(batch, seq, dtype=torch.long, device="meta"),)


def show(plan, top=10):
    for line in summary(plan) + mesh_lines(plan) + pipeline_lines(plan) + search_lines(plan, top):
        print(line)


def timed(label, fn):
    wall, cpu = time.perf_counter(), time.process_time()
    out = fn()
    print(f"[{label}: {time.perf_counter() - wall:.1f} s wall, "
          f"{time.process_time() - cpu:.1f} s CPU of this process]")
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--width", type=int, default=4096)
    ap.add_argument("--batch", type=int, default=256)
    args = ap.parse_args()
    m, inputs = model(args.layers, args.width, args.batch)
    params = sum(p.numel() for p in m.parameters())
    print(f"GPT: {args.layers} blocks, width {args.width}, {params / 1e9:.2f} B parameters, "
          f"global batch {args.batch} x 1024 tokens, Adam, bf16-mixed (A100)\n")

    print("== 1. planning time: 3-D search over 64 devices (8x8xA100-80GB) ==")
    plan = timed("planning", lambda: optimize_3d(m, "8x8xA100-80GB", inputs))
    show(plan)

    print("\n== must-show 1: too large for one device ==")
    try:
        optimize_3d(m, "1xA100-80GB", inputs, max_microbatches=args.batch)
    except PlanDoesNotFit as error:
        print(f"1xA100-80GB: {error}")
    small = max(8, args.batch // 8)
    m8, in8 = model(args.layers, args.width, small)
    plan = timed("planning", lambda: optimize_3d(m8, "8xA100-80GB", in8))
    print(f"-- 8xA100-80GB, global batch {small}:")
    show(plan, top=6)
    print("-- the same with ample memory (memory_limit_bytes=1e13 per device):")
    plan = timed("planning", lambda: optimize_3d(m8, "8xA100-80GB", in8,
                                                 memory_limit_bytes=1e13))
    show(plan, top=6)

    print("\n== must-show 2: 2x8xA100-80GB, where tensor parallelism goes ==")
    m16, in16 = model(args.layers, args.width, 64)
    plan = timed("planning", lambda: optimize_3d(m16, "2x8xA100-80GB", in16))
    show(plan, top=16)
    cross = [c for c in plan.search.best_per_shape if c.tp > 8]
    for c in cross:
        value = c.step_time_s or c.bound_s
        print(f"tp {c.tp} spans both nodes: {c.outcome.replace('_', ' ')}, "
              f"{'>= ' if c.step_time_s is None else ''}{value:.2f} s vs best "
              f"{plan.predicted.step_time_s:.2f} s")


if __name__ == "__main__":
    main()
