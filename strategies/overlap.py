"""What of a layer's data-parallel collectives a step waits for, where they run beside compute.

On GPUs NCCL runs FSDP2's all-gathers and reduce-scatters and DDP's bucket all-reduces on
their own CUDA streams while the compute stream goes on:
- FSDP2 gathers a unit's weights ahead of its forward while the units before it compute
  (implicit forward prefetch: the CPU issues the gather as soon as it reaches the unit,
  kernels ahead of the GPU), and ahead of its backward while the unit after it runs its
  backward (`backward_prefetch`); its reduce-scatter runs while the units before it run
  their backward;
- DDP all-reduces a bucket as soon as its gradients are ready, while the rest of
  backward runs (the last microbatch's, in a pipeline or a gradient-accumulation loop).

So a step waits only for what a collective takes beyond the compute beside it. Priced per
layer, which keeps the integer programs' costs additive: the compute beside one layer's
collectives is taken as its own compute times `cover` (forward beside the forward gather;
backward beside the backward gather, the scatter and the bucket all-reduce), where `cover`
adds the parameter-free ops between two layers with weights, which run beside the gathers
too (planner.price.in_rhythm sets it from the graph: all compute over the compute of the
layers with weights, e.g. 1.13 on Llama 3.1 8B at 8192 tokens traced by torch.export,
whose attention modules hold their projections and flash attention both). It leaves out
what slows compute while NCCL runs (the SMs and memory bandwidth its kernels take) and the
first gather of a step, which nothing hides.

Where `cover` is None the collectives are priced in the step's path: gloo on a CPU, whose
FSDP layers and bucket all-reduces `hyplan calibrate` timed inside whole steps (whatever
overlap there is, the figure holds), and every link before in_rhythm has seen the graph.

Checked against torchtitan's Llama 3.1 8B under FSDP on 8 and on 128 H100s, whose steps
differ by 3% (benchmarks/gpu_model_check.py): priced in the step's path the 128-GPU step
ran 63% longer than the 8-GPU one.
"""

from __future__ import annotations

# a layer without a FLOP count: forward is a third of forward + backward, as for a matmul
FORWARD_SHARE = 1 / 3


def forward_share(fwd_flops: float, bwd_flops: float) -> float:
    """The forward's share of a layer's forward + backward compute, by FLOPs."""
    total = fwd_flops + bwd_flops
    return fwd_flops / total if total > 0 else FORWARD_SHARE


def exposed_s(forward_s: float, backward_s: float, compute_s: float, share: float,
              cover: float | None) -> float:
    """What a step waits for of collectives taking `forward_s` beside a layer's forward
    and `backward_s` beside its backward, the layer computing `compute_s` (forward +
    backward, `share` of it forward): each beyond the compute that runs beside it (module
    docstring); all of it where `cover` is None."""
    if cover is None:
        return forward_s + backward_s
    beside_forward = cover * share * compute_s
    beside_backward = cover * (1 - share) * compute_s
    return max(0.0, forward_s - beside_forward) + max(0.0, backward_s - beside_backward)


def fsdp_exposed_s(gathers_s: float, scatter_s: float, compute_s: float, share: float,
                   cover: float | None) -> float:
    """`exposed_s` of one FSDP layer's collectives in a microbatch: of its two all-gathers
    (`gathers_s` together) one runs beside its forward, the other and the reduce-scatter
    beside its backward."""
    return exposed_s(gathers_s / 2, gathers_s / 2 + scatter_s, compute_s, share, cover)
