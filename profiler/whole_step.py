"""What timing layers one by one misses: the glue of a real step.

Each layer is timed on its own (profiler.profile), and a training step is more than the sum
of those times: the autograd engine walking the graph, gradients accumulated into `.grad`,
the loss on the model's output, the ops' inputs arriving from a cold cache. On this 2-core
VM (CPU time, one thread) the layers summed to 0.84-0.99 of a real forward + loss +
backward, model by model, which priced every plan 5-15% short. So the whole model is run
once for real at the same rows, and `glue_factor` is that step over the sum of its layers:
profile() scales every layer's time by it.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn
from torch.utils import _pytree as pytree

from profiler.per_model import PerModel
from profiler.rounds import medians_in_rounds

# model -> {(batch, rows, threads, input shapes): seconds}: one measurement per model and
# shape in a process, as the layer times are cached by shape, so that two plans of one
# program are priced alike: measured at every planning, the step moves with the host's
# load (up to 13% between two plannings of one model here).
_STEPS = PerModel()


def _key(example_inputs, example_kwargs: dict, batch: int, rows: int) -> tuple:
    """What a measurement of one model depends on: the batch, the rows timed, the threads."""
    shapes = tuple(tuple(x.shape) if isinstance(x, torch.Tensor) else repr(x)
                   for x in pytree.tree_leaves((tuple(example_inputs), dict(example_kwargs))))
    return (batch, rows, torch.get_num_threads(), shapes)


def cached_whole_step_s(model: nn.Module, example_inputs, example_kwargs: dict, batch: int,
                        rows: int, timer) -> float | None:
    """whole_step_s, measured once per model, batch, rows and thread count in a process."""
    return _STEPS.get(model, _key(example_inputs, example_kwargs, batch, rows),
                 lambda: whole_step_s(model, example_inputs, example_kwargs, batch, rows,
                                      timer))


def whole_step_s(model: nn.Module, example_inputs, example_kwargs: dict, batch: int,
                 rows: int, timer) -> float | None:
    """Seconds of one forward, loss and backward of `model` on `rows` of the example
    batch (whose dim 0 is `batch`), timed by `timer(fn)`; None where it cannot run (weights
    on the meta device, a batch the model will not take). The loss is a log-softmax over
    the output's last dim, as a classifier's or a language model's cross-entropy costs.
    The model's gradients and buffers (BatchNorm statistics) are left as they were."""
    if any(p.is_meta for p in model.parameters()):
        return None
    with _rows_of(model, example_inputs, example_kwargs, batch, rows) as (args, kwargs, params):
        def step():
            for p in params:
                p.grad = None  # zero_grad's default: each step writes fresh gradients
            _step_loss(model, args, kwargs).backward()

        try:
            return timer(step)
        except Exception:  # noqa: BLE001 - the layer times stand without the glue
            return None


@contextlib.contextmanager
def _rows_of(model: nn.Module, example_inputs, example_kwargs: dict, batch: int, rows: int):
    """(args, kwargs, trainable parameters) with `rows` of the example batch; on exit the
    model's gradients and buffers (BatchNorm statistics) are what they were before."""
    def cut(x):
        return x[:rows] if isinstance(x, torch.Tensor) and x.dim() and x.shape[0] == batch else x

    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    try:
        with buffers_kept(model):
            yield (pytree.tree_map(cut, tuple(example_inputs)),
                   pytree.tree_map(cut, dict(example_kwargs)), params)
    finally:
        for p, g in zip(params, grads):
            p.grad = g


@contextlib.contextmanager
def buffers_kept(*modules: nn.Module | None):
    """Leave the modules' buffers as they were, by name: timing runs a BatchNorm in
    training mode, which moves its running statistics (planning a model with BatchNorm had
    counted 27 batches into the user's model). A traced module shares the user's
    submodules."""
    kept = [(m, {name: b.detach().clone() for name, b in m.named_buffers() if not b.is_meta})
            for m in modules if m is not None]
    try:
        yield
    finally:
        with torch.no_grad():
            for m, saved in kept:
                for name, b in m.named_buffers():
                    if name in saved:
                        b.copy_(saved[name])


# model -> {(batch, rows, threads, input shapes): ratio}, as _STEPS
_SPLITS = PerModel()


def split_backward_ratio(model: nn.Module, example_inputs, example_kwargs: dict, batch: int,
                         rows: int, clock, budget_s: float = 0.5) -> float:
    """How much longer a step of `model` takes when its backward is split as torch's
    zero-bubble schedules split it (torch.distributed.pipelining's stage_backward_input,
    then stage_backward_weight: two passes of the autograd engine, the second from the
    first's saved intermediate gradients) than with one backward, on `rows` rows: the
    median of each over alternating samples (a slow spell of the machine hits both),
    within [1, 2]; 1.0 where it cannot run (weights on meta, a model the split refuses).
    The stage's input is the model's first floating value, a leaf needing its gradient
    as a stage's received activation does. Measured once per model and shape in a process.
    On this 2-core VM it read 1.04-1.31 over six models; two GPT-2 blocks, 1.36."""
    if any(p.is_meta for p in model.parameters()):
        return 1.0
    return _SPLITS.get(model, _key(example_inputs, example_kwargs, batch, rows),
                 lambda: _measure_split(model, example_inputs, example_kwargs, batch, rows,
                                        clock, budget_s))


def _measure_split(model, example_inputs, example_kwargs, batch, rows, clock,
                   budget_s) -> float:
    from torch.distributed.pipelining._backward import (
        stage_backward_input, stage_backward_weight,
    )

    leaves: list[torch.Tensor] = []  # this step's stage input

    def first_float(module, inputs, output):  # the stage's received activation
        if not leaves and isinstance(output, torch.Tensor) and output.is_floating_point():
            leaves.append(output.detach().requires_grad_())
            return leaves[0]
        return None

    with _rows_of(model, example_inputs, example_kwargs, batch, rows) as (args, kwargs, params):
        def step(split: bool):
            for p in params:
                p.grad = None
            leaves.clear()
            loss = _step_loss(model, args, kwargs)
            if split:
                _, groups = stage_backward_input([loss], [None], leaves, iter(params))
                stage_backward_weight(iter(params), groups)
            else:
                torch.autograd.backward(loss, inputs=leaves + params)

        # registered once, outside the timed steps
        hooks = [m.register_forward_hook(first_float) for m in model.modules()
                 if not any(True for _ in m.children())]
        try:
            t = _warm_medians({"plain": lambda: step(False), "split": lambda: step(True)},
                              clock, budget_s)
        except Exception:  # noqa: BLE001 - priced as a plain backward
            return 1.0
        finally:
            for h in hooks:
                h.remove()
    return min(2.0, max(1.0, t["split"] / t["plain"]))


# model -> {(batch, rows, threads, input shapes): share}, as _STEPS
_SHARES = PerModel()
# the share a step's forward may be priced at: a third is a matmul's (its backward is two
# products of its forward's size); on this 2-core VM's CPU, the six models of
# benchmarks/fidelity.py measured 0.30 (the MLP) to 0.53 (a small CNN: pooling forward)
SHARE_RANGE = (0.2, 0.6)


def forward_share(model: nn.Module, example_inputs, example_kwargs: dict, batch: int,
                  rows: int, clock, budget_s: float = 0.5) -> float:
    """The forward's share of a training step (forward and loss, then backward) of `model`
    on `rows` rows: the median of forwards alone over the median of whole steps, timed
    alternately (a slow spell hits both), within SHARE_RANGE; a third where it cannot run.
    A pipeline schedule's timeline follows it: a stage's forward must end before the next
    stage's starts, and on this CPU a small CNN's first stage spent about as long forward
    as back (5.2 and 4.7 ms), where a third would price 3.8 and 7.7. Measured once per
    model and shape in a process."""
    if any(p.is_meta for p in model.parameters()):
        return 1 / 3
    return _SHARES.get(model, _key(example_inputs, example_kwargs, batch, rows),
                       lambda: _measure_share(model, example_inputs, example_kwargs, batch,
                                              rows, clock, budget_s))


def _measure_share(model, example_inputs, example_kwargs, batch, rows, clock,
                   budget_s) -> float:
    with _rows_of(model, example_inputs, example_kwargs, batch, rows) as (args, kwargs, params):
        def step(backward: bool):
            for p in params:
                p.grad = None
            loss = _step_loss(model, args, kwargs)
            if backward:
                loss.backward()

        try:
            t = _warm_medians({"alone": lambda: step(False), "whole": lambda: step(True)},
                              clock, budget_s)
        except Exception:  # noqa: BLE001 - priced at a third
            return 1 / 3
    return min(SHARE_RANGE[1], max(SHARE_RANGE[0], t["alone"] / t["whole"]))


def _first_float(output) -> torch.Tensor:
    """The output to put a loss on: a tensor, or the first floating one inside a tuple or
    a Hugging Face ModelOutput (its logits)."""
    flat = output.to_tuple() if hasattr(output, "to_tuple") else output
    for leaf in pytree.tree_leaves(flat):
        if isinstance(leaf, torch.Tensor) and leaf.is_floating_point() and leaf.requires_grad:
            return leaf
    raise ValueError("no floating-point output that needs a gradient")


def _step_loss(model: nn.Module, args, kwargs) -> torch.Tensor:
    """A loss over the output's last dim, as a classifier's or a language model's
    cross-entropy costs: what every timed step here puts on the model's output."""
    return torch.log_softmax(_first_float(model(*args, **kwargs)).float(), -1).mean()


def _warm_medians(steps: dict, clock, budget_s: float) -> dict:
    """`medians_in_rounds` of `steps` after one warm-up call of each: at least 3 rounds,
    one where the warm-up outlasts a third of the budget (a large model on a CPU:
    planning already ran its step 6 times for the glue)."""
    begin = clock()
    for step in steps.values():
        step()
    least = 3 if clock() - begin < budget_s / 3 else 1
    return medians_in_rounds(steps, clock, least, budget_s)


def glue_factor(step_s: float | None, layers_s: float) -> float:
    """The real step over the sum of its layers, kept within [1, 1.5]: a step is never
    cheaper than its layers (a sum above it is the isolated timing's copies of inputs),
    and a larger ratio is a measurement gone wrong, not glue."""
    if step_s is None or layers_s <= 0:
        return 1.0
    return min(1.5, max(1.0, step_s / layers_s))
