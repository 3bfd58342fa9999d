"""Asynchronous tensor parallelism priced: the TP all-gather and reduce-scatter hidden
behind the matmuls beside them.

Sequence-parallel TP all-gathers a block's input before its column-parallel matmuls and
reduce-scatters the row-parallel matmul's output. torch's async TP (the micro-pipelining
pass `torch._inductor.fx_passes.micro_pipeline_tp`, enabled by torchtitan's
`enable_async_tensor_parallel` with compile) splits each into tp - 1 point-to-point
steps, each running beside the matmul of the shard that arrived (or before the one that
leaves): the first step has nothing to hide behind, the rest hide behind the matmul's
remaining (tp - 1) / tp. Its authors measured up to ~29% forward and ~8% end-to-end on
Llama 3 8B, ~20% forward and ~8% end-to-end on Llama 3 70B (Wang, He, Wright et al.,
"[Distributed w/ TorchTitan] Introducing Async Tensor Parallelism in PyTorch", PyTorch
forums, 2024); torchtitan's 70B on 256 H100 table: 597 to 652 tokens/s/GPU (+9.2%).

What reaches a plan's step time: `exposed_s` for the TP collectives a plan prices in its
path. The 3-D price (planner.plan3d / planner.price) adds a layer's TP collectives to
the step as they are; the lever applies where it reads them (see the report of the
engineer who added this file: one call in that sum).
"""

from __future__ import annotations


def exposed_s(collective_s: float, matmul_s: float, tp: int) -> float:
    """The part of a TP all-gather or reduce-scatter (`collective_s`, as priced blocking)
    that async TP leaves in the step beside a matmul of `matmul_s` over `tp` ranks: the
    first of tp chunks whole, the rest past the matmul's remaining chunks."""
    if tp <= 1 or collective_s <= 0:
        return collective_s
    first = collective_s / tp
    rest = (collective_s - first) - matmul_s * (tp - 1) / tp
    return first + max(0.0, rest)
