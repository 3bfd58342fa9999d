"""The DDP and FSDP baselines of a 7 B Llama on 4x8xH100 side by side: what each is
predicted to cost per step, how many bytes each device sends, and whether it fits.

    PYTHONPATH=$PWD python benchmarks/fsdp_baseline.py [--batch 64] [--seq 2048]

The model is benchmarks/scale.py's (a transformers LlamaConfig built on the meta device,
traced by torch.export); nothing is downloaded and no weight is allocated. By volume
FSDP should send 1.5x DDP's bytes: two all-gathers of the weights (before forward and
before backward) and a reduce-scatter of the gradients, against DDP's all-reduce (a
reduce-scatter and an all-gather). The last lines check that against the hand count
(P-1)/P x weight bytes x 2 (DDP) or x 3 (FSDP).
"""

from __future__ import annotations

import argparse
import time

import planner
from benchmarks.scale import llama_7b

GB = 1e9


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--devices", default="4x8xH100")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()

    model, inputs, kwargs = llama_7b(batch=args.batch, seq=args.seq)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(f"Llama 7 B ({weights / GB:.2f} GB of weights), batch {args.batch} x {args.seq} "
          f"tokens, on {args.devices}, adam")
    print(f"{'baseline':<6} {'step':>9} {'compute':>9} {'comm':>9} {'sent/device':>12} "
          f"{'memory/device':>14}  fits")
    plans = {}
    for kind in ("ddp", "fsdp"):
        started = time.perf_counter()
        plan = planner.baseline(model, args.devices, kind, inputs, kwargs)
        p = plans[kind] = plan.predicted
        memory = max(p.memory_bytes)
        fits = ("yes" if memory <= p.memory_limit_bytes
                else f"no (needs {memory / GB:.1f} GB of {p.memory_limit_bytes / GB:.1f} GB)")
        used: dict[str, int] = {}
        for layer in plan.layers:
            used[layer.strategy] = used.get(layer.strategy, 0) + 1
        print(f"{kind:<6} {p.step_time_s:>7.3f} s {p.compute_s:>7.3f} s "
              f"{p.communication_s:>7.3f} s {p.communication_bytes / GB:>9.2f} GB "
              f"{memory / GB:>11.1f} GB  {fits}   [{time.perf_counter() - started:.1f} s "
              f"to plan; strategies {dict(sorted(used.items()))}]")
    ranks = plan.cluster.num_devices
    ddp, fsdp = plans["ddp"].communication_bytes, plans["fsdp"].communication_bytes
    print(f"FSDP / DDP bytes sent: {fsdp / ddp:.3f} (hand count: 1.5 for the weights' "
          f"collectives alone)")
    print(f"hand count over {ranks} ranks: DDP 2(P-1)/P x {weights / GB:.2f} GB = "
          f"{2 * (ranks - 1) / ranks * weights / GB:.2f} GB; FSDP 3(P-1)/P x "
          f"{weights / GB:.2f} GB = {3 * (ranks - 1) / ranks * weights / GB:.2f} GB")


if __name__ == "__main__":
    main()
