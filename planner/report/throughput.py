"""What a language-model plan delivers in the units LLM trainers quote: tokens per second,
tokens per second per device, and model FLOPs utilisation (MFU).

MFU = tokens/s per device x training FLOPs per token / the device's peak FLOP/s at the
plan's precision, with FLOPs per token as PaLM and torchtitan count them (6 per
non-embedding parameter plus attention's matmuls: profiler.presets.LLMShape): the work the
model needs, not what the plan adds (recomputation is not counted), so plans compare on it.
"""

from __future__ import annotations

from dataclasses import dataclass

from planner.plan import Plan
from profiler.presets import LLMShape


@dataclass(frozen=True)
class Throughput:
    tokens_per_s: float
    tokens_per_s_per_device: float
    flops_per_token: float
    peak_flops: float  # per device, at the plan's precision
    mfu: float

    def describe(self) -> str:
        return (f"Throughput: {self.tokens_per_s:,.0f} tokens/s, "
                f"{self.tokens_per_s_per_device:,.0f} tokens/s per device; MFU "
                f"{self.mfu:.1%} ({self.flops_per_token / 1e9:.1f} GFLOP per token against "
                f"{self.peak_flops / 1e12:.0f} TFLOP/s peak per device)\n")


def llm_throughput(step_time_s: float, global_batch: int, seq: int, devices: int,
                   shape: LLMShape, peak_flops: float) -> Throughput:
    """Tokens/s and MFU of a step of `global_batch` sequences of `seq` tokens."""
    if step_time_s <= 0:
        raise ValueError(f"step_time_s must be positive, got {step_time_s}")
    tokens_per_s = global_batch * seq / step_time_s
    per_device = tokens_per_s / devices
    flops = shape.flops_per_token(seq)
    return Throughput(tokens_per_s, per_device, flops, peak_flops,
                      per_device * flops / peak_flops)


def plan_throughput(plan: Plan, shape: LLMShape, seq: int) -> Throughput:
    """The plan's predicted throughput (its global batch is in sequences of `seq` tokens)."""
    cluster = plan.cluster
    return llm_throughput(plan.predicted.step_time_s, plan.global_batch, seq,
                          cluster.num_devices, shape, cluster.device.peak_flops[cluster.compute_dtype])
