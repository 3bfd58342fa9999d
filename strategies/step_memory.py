"""What a training step holds beside each layer's weights, gradients, optimizer state and
saved activations (strategies.catalog.weights_memory, the per-layer part): the executor's
buffers and the optimizer's temporaries, as torch 2.13 allocates them. One function,
`step_held_bytes`, gives it for one device, from a `HeldLayer` per layer on it; every
plan's reported memory adds it per pipeline rank (planner.pipeline.stage_held.
held_beside_stages; a 1-D plan is one rank, its layers as `one_d_layer` says). A 1-D
solve is repeated with the budget lowered by it where a solution would not fit with it
(planner.optimize); the 3-D search carries the optimizer's temporaries in its memory rows
(summed_temp_bytes) and solves a shape again in less room where the rest does not fit
(planner.search). Not priced here: bf16-mixed's copies, and the saved activations, which
are per-layer (Layer.activation_bytes: what autograd was measured to keep,
profiler.saved), not step buffers; DTensor redistribute outputs a consumer saves are
(reshard_copy_bytes).

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
  the backward prefetches the next group's all-gather (`_backward_prefetch`), and the
  previous group's reduce-scatter input is kept until this group's reduce
  (`reduce_scatter_states`, `reduce_scatter_max_input_buffers` = 1): at most the largest
  group gathered with its whole gradient and the next two largest groups' worth.
  Measured (benchmarks/memory.py, ResNet-18 FSDP on 4 ranks): layer4's 9 MiB groups, four
  of them mid-backward, where three priced it 11% short (and a group's neighbours
  alone, 10%).
- The loss (loss_held_bytes): cross-entropy's saved log-softmax and two gradients of the
  output's size at the backward's start (a pipeline's last stage keeps no outputs beside
  it: executor.pipeline steps its schedule with return_outputs=False).
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
that group's backward, the loss's tensors at the backward's start, neither with the
optimizer temporaries; the copies layout changes make live with the activations, until
the backward; DDP's buckets, a last stage's kept outputs and a stage's receive buffers
live throughout. So this is kept + max(optimizer temporaries, copies + max(FSDP's
backward, the loss)), and a 3-D plan's flat bucket (one at a time, between backward and
optimizer step) joins the max.
The per-layer part keeps the activations and the gradients in full beside both, which
they never are together in full (the step zeroes its gradients to None before the
forward, and frees the activations by the optimizer step); where the caller says what
each layer keeps for backward (HeldLayer.activation_bytes) and no layer is FSDP-sharded,
step_held_bytes takes the excess back (not_together_bytes); a pipeline rank, whose
gradients live beside its later microbatches' activations, by what its schedule's order
holds together (schedule_not_together_bytes). A layer's output that every reader takes
through a layout change is kept by none of them (each keeps the change's copy): the
per-layer part's count of it is taken back too (replaced_bytes). Measured on gloo ranks
(benchmarks/memory.py), the 19 M-parameter MLP over the per-layer sum: DDP +121 MiB on 2
ranks (58 of buckets + 2 x 32 of temporaries), tensor parallel +31 (2 x 16), FSDP +66 on
2 ranks and +70 to +86 on 4 (the largest layer gathered, 32, its whole gradient, 32,
and, when the prefetch lands inside that window, the next layer gathered, 16).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from strategies.collectives import DDP_BUCKET_CAP_BYTES
from strategies.context import FSDP_SUFFIX, TOKEN_SPLIT
from strategies.layouts import Layout

_WHOLE = (Layout.REPLICATE, Layout.REPLICATE_PARTIAL_GRAD)

# optimizer -> fp32 parameter-sized temporaries made per parameter (for-loop) / per group
# (foreach): torch/optim/adamw.py, sgd.py
_FOR_LOOP_TEMPS = {"sgd": 0, "sgd_momentum": 0, "adam": 2, "adamw": 2}
_FOREACH_TEMPS = {"sgd": 0, "sgd_momentum": 0, "adam": 1, "adamw": 1}


@dataclass(frozen=True)
class HeldLayer:
    """What one layer on a device contributes to step_held_bytes: `local_bytes`, the fp32
    parameter bytes the device keeps; `gathered_bytes`, what FSDP2 all-gathers whole before
    its forward and backward (0: not sharded by FSDP); `bucketed`, whether its gradient is
    all-reduced over replicas through flat buckets; `activation_bytes`, what its cost
    prices as kept for backward (None: not told; `step_held_bytes` then prices the
    gradients and activations as alive together); `replaced_bytes`, the part of those
    activations its readers save as layout-change copies instead (replaced_bytes)."""

    local_bytes: float
    gathered_bytes: float = 0.0
    bucketed: bool = False
    activation_bytes: float | None = None
    replaced_bytes: float = 0.0


def not_together_bytes(layers: list[HeldLayer], temps: float, start: float,
                       during: float) -> float:
    """What the per-layer sum counts too much where the gradients and the activations are
    not alive at once, for `layers` in execution order (all with `activation_bytes`): a
    step zeroes its gradients to None first (executor.step.train_step), so the backward
    starts with every activation and no gradient (`start`: beside them then, the loss);
    while it runs, a layer's activations are freed as its gradient is made, the layers
    from the last one back (`during`: beside them, an FSDP group's backward); the
    optimizer step holds every gradient and no activation (`temps`: its temporaries). The
    sum prices gradients + activations + max(temps, start, during). Measured
    (benchmarks/memory.py, GPT-2 4 layers, DDP on 2 ranks): the peak at the backward's
    start, no gradient alive, 16 MiB below the sum."""
    grads = [l.local_bytes for l in layers]
    acts = [(l.activation_bytes or 0.0) - l.replaced_bytes for l in layers]
    gradient, activation = sum(grads), sum(acts)
    backward, made, kept = activation, 0.0, activation
    for g, a in zip(reversed(grads), reversed(acts)):  # the backward, last layer first
        made, kept = made + g, kept - a
        backward = max(backward, made + kept)
    peak = max(gradient + temps, activation + start, backward + during)
    return gradient + activation + max(temps, start, during) - peak


def schedule_not_together_bytes(gradient: float, activation: float, together: float,
                                temps: float, start: float) -> float:
    """not_together_bytes for a pipeline rank, whose activations are per microbatch in
    flight and whose gradients are made at its stages' first backwards: the per-layer sum
    prices `gradient` + `activation` (every stage's microbatches in flight at once) +
    max(temps, start); the rank holds at most its gradients with the optimizer's
    temporaries or the flat bucket (`temps`, after its last backward), or `together`
    (the most gradients and activations its schedule holds at once:
    planner.pipeline.stage_held.together_bytes) with `start` (the loss, the layout
    copies) beside them."""
    peak = max(gradient + temps, together + start)
    return max(0.0, gradient + activation + max(temps, start) - peak)


_SUMMED = ("data_parallel", "sequence_parallel", *TOKEN_SPLIT)


def one_d_layer(strategy: str, param_bytes: float, model_parallel: bool,
                ranks: int, activation_bytes: float | None = None) -> HeldLayer:
    """A layer of a 1-D plan: model-parallel and FSDP layers keep 1/ranks, FSDP gathers the
    whole; only a layer whose gradient is a partial sum over the ranks (data- or
    sequence-parallel: executor.styles.summed_params) goes through DDP's buckets, a
    replicated one (every rank the whole batch) is left out of DDP
    (executor.styles.data_parallel_over)."""
    fsdp = strategy.startswith("fsdp") or strategy.endswith(FSDP_SUFFIX)
    local = param_bytes / ranks if (model_parallel or fsdp) else param_bytes
    return HeldLayer(local, param_bytes if fsdp else 0.0,
                     bucketed=ranks > 1 and strategy in _SUMMED,
                     activation_bytes=activation_bytes)


def output_share(gives: Layout, ranks: int, loss_parallel: bool = False) -> float:
    """The share of a model output one device holds for the loss: 1/ranks where the layer
    that makes it gives it split by rows or tokens (a data-parallel head), or by features
    under a loss that reads its shard (`loss_parallel`: Levers.loss_parallel), all of it
    otherwise (handed back whole: planner.handback)."""
    split = (Layout.BATCH, Layout.SEQUENCE) + ((Layout.FEATURE,) if loss_parallel else ())
    return 1 / ranks if gives in split else 1.0


def loss_held_bytes(output_numel: float) -> float:
    """What the loss holds beyond the output the last layer's activations price, for a
    cross-entropy over `output_numel` outputs on the device: torch's `cross_entropy` is
    `log_softmax` then `nll_loss` (torch/nn/functional.py); `_log_softmax` saves its fp32
    result for its backward (tools/autograd/derivatives.yaml: `_log_softmax_backward_data
    (grad, result, ...)`), and the backward's start makes `nll_loss_backward`'s gradient and
    then `_log_softmax_backward_data`'s, both the output's size, while the result is still
    saved: three output-sized tensors at once, the logits themselves freed by then. Measured
    (benchmarks/memory.py, GPT-2's 4096-wide vocabulary): the step's peak is there, 3 x the
    logits above the forward's end."""
    return 2 * 4 * output_numel


def reshard_copy_bytes(whole_bytes: float, gives: Layout, takes: Layout, ranks: int) -> float:
    """The tensor a layout change between two layers makes, which the consumer keeps for
    its backward wherever it saves its input (a Linear, a norm, an activation): DTensor's
    `redistribute_local_tensor` (torch/distributed/tensor/_redistribute.py) all-gathers a
    split tensor into a new whole one (`Shard._to_replicate_tensor`), returns "the
    corresponding cloned local shard" of a whole one (`Shard._replicate_to_shard`), and
    all-to-alls one split into another (`_to_new_shard_dim`): `whole_bytes` (the producer's
    output, whole) or its 1/ranks share. A whole layout taken as the other whole one
    (replicate, replicate/partial-grad: both Replicate forward) is no copy. Measured on
    GPT-2's tensor plan (benchmarks/memory.py): 15 MiB of such copies alive at the peak on
    each of 2 ranks, 13 by this rule."""
    if gives == takes or (gives in _WHOLE and takes in _WHOLE):
        return 0.0
    return whole_bytes if takes in _WHOLE else whole_bytes / ranks


def replaced_bytes(activation_bytes: float, saved_per_output: float | None,
                   users_saved_per_output: float | None, copies: list[float]) -> float:
    """The part of a layer's priced activations (`activation_bytes`, what its cost keeps
    for backward) that is its output kept by the layers reading it, where each of those
    readers takes it through a layout change (`copies`: reshard_copy_bytes of each edge to
    a layer, none to the model's outputs): each reader then saves the copy the change
    makes (priced by reshard_copy_bytes) and autograd keeps no storage of the output
    itself, so it is freed once read. The share is the one measured on one device
    (profiler.saved: Layer.users_saved_per_output of Layer.saved_per_output), so it
    follows the activations wherever the strategy splits them. A layer that saves its own
    output (a ReLU, a tanh), or with one reader in its layout, keeps it: 0. Measured
    (benchmarks/memory.py, GPT-2 4 layers, tensor plan on 2 ranks, live storages at the
    peak by their creating op): per block 8 MiB of the GELU's [8, 64, 1024] tensors (the
    all-gathered input copy and three of its own) and c_proj's 1 MiB cloned shard, where
    c_fc's 1 MiB row share and the GELU's 2 MiB output were priced beside those copies."""
    if (not copies or not all(copies) or not saved_per_output
            or not users_saved_per_output):
        return 0.0
    return activation_bytes * min(1.0, users_saved_per_output / saved_per_output)


def pipeline_buffer_bytes(boundary_bytes: float, microbatches: int) -> float:
    """What torch.distributed.pipelining allocates for one tensor crossing a stage cut, on
    each side, and keeps for the schedule's life: the receiving stage one buffer per
    microbatch for the activation (torch/distributed/pipelining/stage.py,
    `_prepare_forward_infra`: `buffer=_make_tensor_from_meta(meta, ...)` for every
    `chunk_id in range(num_microbatches)`), the sending stage one per microbatch for its
    gradient (`_setup_backward_recv_info` -> `_create_grad_recv_info`). Measured
    (benchmarks/memory.py): the MLP's two-stage pipeline from -0.7% to -0.1% with them."""
    return boundary_bytes * microbatches


def summed_temp_bytes(local_bytes, optimizer: str, device_kind: str = "cpu") -> float:
    """The part of the optimizer step's temporaries that is a sum over the layers on a
    device, one layer's share of it: foreach AdamW's fp32 copy of every local parameter
    (`_FOREACH_TEMPS`, the CUDA default); 0 for the for-loop step (CPU tensors), whose
    temporaries are the largest parameter's, one at a time. The 3-D search adds it to each
    option's weights (planner.search.build), so its memory rows hold weights + activations
    + these temporaries, never more than step_held_bytes prices with them: a relaxation
    of the plan's memory, which keeps the search's bounds bounds."""
    return (0 if device_kind == "cpu" else _FOREACH_TEMPS.get(optimizer, 0)) * local_bytes


def step_held_bytes(layers: Iterable[HeldLayer], optimizer: str, device_kind: str = "cpu",
                    *, kept_buckets: bool = True, loss_bytes: float = 0.0,
                    saved_bytes: float = 0.0, kept_bytes: float = 0.0,
                    schedule: tuple[float, float] | None = None) -> float:
    """Bytes one device holds during a step beyond the per-layer weights, gradients,
    optimizer state and saved activations, for the layers on that device. `kept_buckets`:
    DDP's Reducer keeps its buckets for the module's life (1-D plans); the pipeline
    executor's `sum_in_buckets` (executor.pipeline, 3-D plans) flattens one bucket of at
    most DDP_BUCKET_CAP_BYTES at a time after the backward, freed before the optimizer
    step. `loss_bytes`: loss_held_bytes of the output on this device (0 where it holds
    none), live at the backward's start, when neither the optimizer's temporaries nor an
    FSDP group's backward are. `saved_bytes`: kept from the forward to the backward beside
    the activations and freed with them, before the optimizer step (reshard_copy_bytes).
    `kept_bytes`: held throughout the step beside all of it (pipeline_buffer_bytes).
    Less the layers' `replaced_bytes`: per-layer activations no storage holds, their
    readers keeping layout-change copies (in `saved_bytes`) instead. `schedule`: a
    pipeline rank's (activations the per-layer sum prices, the most gradients and
    activations its schedule holds at once): where no layer is FSDP-sharded, less what the
    sum counts beyond that (schedule_not_together_bytes).
    Where every layer says what it keeps for backward (HeldLayer.activation_bytes) and none
    is FSDP-sharded, less what the per-layer sum counts of gradients and activations at
    moments they are not alive together (not_together_bytes): then negative where that is
    more than the rest. FSDP's backward keeps more than its term beside the activations
    there (measured, benchmarks/memory.py: GPT-2 FSDP on 4 ranks 13% under with the take
    back, 8% over without), so a plan with FSDP layers keeps the sum."""
    every = list(layers)
    layers = [l for l in every if l.local_bytes]
    bucketed = sum(l.local_bytes for l in layers if l.bucketed)
    largest = max((l.local_bytes for l in layers), default=0.0)
    if device_kind == "cpu":
        temps = _FOR_LOOP_TEMPS.get(optimizer, 0) * largest
    else:
        temps = _FOREACH_TEMPS.get(optimizer, 0) * sum(l.local_bytes for l in layers)
    top = sorted((l.gathered_bytes for l in layers if l.gathered_bytes), reverse=True)[:3]
    # a group's backward: its gathered parameters and whole gradient, the next one
    # prefetched, the previous one's reduce-scatter input still kept
    backward = top[0] + sum(top) if top else 0.0
    # with the gradients (after the backward): the optimizer's temporaries, or a 3-D
    # plan's flat bucket, one at a time between the backward and the optimizer step
    with_gradients = temps if kept_buckets else max(temps, min(bucketed, DDP_BUCKET_CAP_BYTES))
    held = (kept_bytes + (bucketed if kept_buckets else 0.0)
            + max(with_gradients, saved_bytes + max(backward, loss_bytes)))
    if not any(l.gathered_bytes for l in every):
        # FSDP's backward keeps more than its term (below): there the sum stands, measured
        # (ResNet-18 FSDP on 4 ranks, BatchNorm whole between sharded convolutions) 5.7%
        # under with this taken back, 0.1% over without
        held -= sum(l.replaced_bytes for l in every)
    if every and all(l.activation_bytes is not None for l in every) and not any(
            l.gathered_bytes for l in every):
        held -= not_together_bytes(every, with_gradients, saved_bytes + loss_bytes,
                                   saved_bytes + backward)
    elif schedule is not None and not any(l.gathered_bytes for l in every):
        held -= schedule_not_together_bytes(sum(l.local_bytes for l in every), schedule[0],
                                            schedule[1], with_gradients,
                                            saved_bytes + loss_bytes)
    return held
