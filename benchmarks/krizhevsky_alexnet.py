"""AlexNet as in Krizhevsky's "one weird trick" (2014): hyplan's plan and predicted speedup
beside his measured Table 1, and the batch at which the FC layers flip to data parallel.

    python benchmarks/krizhevsky_alexnet.py

Plans on meta tensors (nothing allocated, nothing timed here): the figures are the cost
model's predictions for K20s joined by PCIe at about 6 GB/s, and for V100s on NVLink.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import planner  # noqa: E402
from alexnet import build  # noqa: E402

# Krizhevsky 2014, Table 1: (GPUs, batch) -> measured speedup over one GPU
KRIZHEVSKY = {1: 1.0, 2: 1.95, 4: 3.74, 8: 6.25}


def _plan(devices: str, batch: int, **kwargs) -> planner.Plan:
    model, inputs, _ = build(batch, "meta")
    return planner.optimize(model, devices, example_inputs=inputs, optimizer="sgd_momentum",
                            **kwargs)


def _fc(plan: planner.Plan) -> str:
    return ", ".join(f"{l.name}={l.strategy}" for l in plan.layers if l.kind == "Linear")


def _convs(plan: planner.Plan) -> str:
    kinds = {l.strategy for l in plan.layers if l.kind == "Conv2d"}
    return "/".join(sorted(kinds))


def table1() -> None:
    print("Krizhevsky's Table 1 (K20, 128 images per GPU) beside hyplan's prediction")
    print(f"{'GPUs':>4} {'batch':>6} {'measured':>9} {'predicted':>9} {'vs DP':>6}  "
          f"{'convs':<14} FC layers")
    for gpus, measured in KRIZHEVSKY.items():
        plan = _plan(f"{gpus}xK20", 128 * gpus)
        p = plan.predicted
        vs_dp = p.speedup_over_data_parallel  # None: data parallelism does not fit
        vs_dp = f"{vs_dp:>5.2f}x" if vs_dp else "no fit"
        print(f"{gpus:>4} {128 * gpus:>6} {measured:>8.2f}x {p.speedup_over_single_device:>8.2f}x "
              f"{vs_dp:>6}  {_convs(plan):<14} {_fc(plan)}")


def breakdown() -> None:
    plan = _plan("8xK20", 1024)
    conv = sum(l.compute_s for l in plan.layers if l.name.startswith("features"))
    fc = sum(l.compute_s for l in plan.layers if l.kind == "Linear")
    conv_sync = sum(l.communication_s for l in plan.layers if l.kind == "Conv2d")
    dp = _plan("8xK20", 1024, pin={n: "data_parallel" for n in
                                    ("classifier.1", "classifier.4", "classifier.6")})
    fc_sync = sum(l.communication_s for l in dp.layers if l.kind == "Linear")
    moved = sum(l.communication_s + l.reshard_in_s for l in plan.layers
                if not l.name.startswith("features"))
    print("\nPer-GPU step at 8xK20, batch 1024 (REFERENCES.md's derived figures in brackets)")
    print(f"  conv forward+backward       {conv * 1e3:6.1f} ms  [252 ms]")
    print(f"  FC compute                  {fc * 1e3:6.1f} ms  [22.5 ms]")
    print(f"  conv gradient all-reduce    {conv_sync * 1e3:6.1f} ms  [2.9 ms]")
    print(f"  data-parallel FC all-reduce {fc_sync * 1e3:6.1f} ms  [68.4 ms]")
    print(f"  model-parallel FC traffic   {moved * 1e3:6.1f} ms  [20.8 ms, Krizhevsky's scheme]")


def crossover() -> None:
    print("\nFC strategy by global batch on 8xK20 (memory limit lifted: a what-if)")
    for batch in (1024, 2048, 4096, 8192, 16384, 32768):
        plan = _plan("8xK20", batch, memory_limit_bytes=1e13)
        print(f"  batch {batch:>6}: {_fc(plan)}")


if __name__ == "__main__":
    start = time.perf_counter()
    table1()
    breakdown()
    for devices in ("8xK20", "8xV100"):
        print(f"\n{_plan(devices, 1024).explain()}")
    crossover()
    print(f"\n(planned {6 + 2 + 2 + 6} times in {time.perf_counter() - start:.1f} s)")
