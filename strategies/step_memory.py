"""What a training step holds beside each layer's weights, gradients, optimizer state and
saved activations (strategies.catalog.weights_memory, the per-layer part): the executor's
buffers and the optimizer's temporaries, as torch 2.13 allocates them. One function,
`step_held_bytes`, gives it for one device; a 1-D plan's reported memory adds it
(planner.assemble.held_beside_layers), and its integer program is solved again with the
budget lowered by it where a solution would not fit with it (planner.optimize). Not yet
read: the 3-D plans (planner.plan3d), bf16-mixed's copies, DTensor redistribute outputs,
the loss's logits.

The terms, in fp32 bytes of the parameters as the layers hold them on one device (a
model-parallel or FSDP layer: its 1/ranks share):

- DDP's gradient buckets (torch/nn/parallel/distributed.py, `Reducer` in
  torch/csrc/distributed/c10d/reducer.cpp): every replicated (data-parallel) parameter's
  gradient is copied into a flat bucket that is all-reduced and copied back; the buckets
  are allocated once and kept for the life of the module (`gradient_as_bucket_view=False`,
  the default), so they add one gradient's worth of every data-parallel layer, at every
  moment of the step.
- FSDP2's unsharded parameters (torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py,
  `_fsdp_collectives.foreach_all_gather`): a group's parameters are all-gathered whole
  before its forward and its backward and freed after (reshard_after_forward); its
  reduce-scatter input, the whole gradient, lives with them at the end of its backward,
  and the backward prefetches the next group's all-gather (`_backward_prefetch`): at
  worst the two largest groups gathered and the largest one's whole gradient.
- The optimizer step's temporaries (torch/optim/adamw.py): the for-loop AdamW, torch's
  default for CPU tensors (`_default_to_fused_or_foreach` picks foreach only on CUDA-like
  devices), makes `denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)` per
  parameter: two parameter-sized tensors (sqrt, then the division) of the largest one at
  a time. `_multi_tensor_adamw` (foreach, the CUDA default) makes
  `exp_avg_sq_sqrt = torch._foreach_sqrt(device_exp_avg_sqs)` for the whole group at
  once: one fp32 copy of every local parameter. Fused AdamW allocates none. SGD without
  momentum allocates none; with momentum, the for-loop/foreach update is in place.

Peak, not sum: the optimizer's temporaries live during `optimizer.step()`; FSDP's
gathered group and its whole gradient (the reduce-scatter input) live together during
that group's backward, when there are no optimizer temporaries; DDP's buckets live
throughout. So this is buckets + max(optimizer temporaries, FSDP's backward).
The per-layer part keeps the activations in full beside both (an upper bound by at most
the activations, which the step has freed by the optimizer step). Measured on gloo ranks
(benchmarks/memory.py), the 19 M-parameter MLP over the per-layer sum: DDP +121 MiB on 2
ranks (58 of buckets + 2 x 32 of temporaries), tensor parallel +31 (2 x 16), FSDP +66 on
2 ranks and +70 to +86 on 4 (the largest layer gathered, 32, its whole gradient, 32,
and, when the prefetch lands inside that window, the next layer gathered, 16).
"""

from __future__ import annotations

from collections.abc import Iterable

# optimizer -> fp32 parameter-sized temporaries made per parameter (for-loop) / per group
# (foreach): torch/optim/adamw.py, sgd.py
_FOR_LOOP_TEMPS = {"sgd": 0, "sgd_momentum": 0, "adam": 2, "adamw": 2}
_FOREACH_TEMPS = {"sgd": 0, "sgd_momentum": 0, "adam": 1, "adamw": 1}


def step_held_bytes(layers: Iterable[tuple[str, float, bool]], ranks: int, optimizer: str,
                    device_kind: str = "cpu") -> float:
    """Bytes one device holds during a step beyond the per-layer weights, gradients,
    optimizer state and saved activations. `layers`: (strategy name, the layer's fp32
    parameter bytes whole, whether it is model-parallel) for each layer on the device;
    `ranks`: the devices a model-parallel or FSDP layer is split over."""
    buckets, local, largest = 0.0, 0.0, 0.0
    groups: list[float] = []
    for strategy, param_bytes, model_parallel in layers:
        if not param_bytes:
            continue
        split = model_parallel or strategy.startswith("fsdp")
        mine = param_bytes / ranks if split else param_bytes
        local += mine
        largest = max(largest, mine)
        if strategy.startswith("fsdp"):
            groups.append(param_bytes)
        elif not model_parallel:
            buckets += param_bytes
    if device_kind == "cpu":
        temps = _FOR_LOOP_TEMPS.get(optimizer, 0) * largest
    else:
        temps = _FOREACH_TEMPS.get(optimizer, 0) * local
    two = sorted(groups, reverse=True)[:2]
    # a group's backward: its gathered parameters and whole gradient, the next one prefetched
    backward = 2 * two[0] + (two[1] if len(two) > 1 else 0.0) if two else 0.0
    return buckets + max(temps, backward)
