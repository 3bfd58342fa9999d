"""What autograd keeps for backward, per layer (profiler.saved): measured on the traced
graph, it must equal what autograd holds when the model itself runs, storages counted
once, parameters left out."""

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from profiler.export_trace import export_trace
from profiler.trace import trace

ROWS, WIDTH = 8, 16
FLOAT = 4


def held_by_autograd(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the storages autograd keeps at the end of the model's own forward, and of
    what it returns, each storage once, its parameters' left out."""
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    weights |= {b.untyped_storage().data_ptr() for b in model.buffers()}
    saved: dict[int, int] = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    saved[out.untyped_storage().data_ptr()] = out.untyped_storage().nbytes()
    return sum(n for ptr, n in saved.items() if ptr not in weights)


def tanh_gelu(x):
    """Hugging Face's NewGELUActivation, written out."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


class TanhGELU(nn.Module):
    def forward(self, x):
        return tanh_gelu(x)


class MLP(nn.Module):
    def __init__(self, act: nn.Module):
        super().__init__()
        self.first, self.act, self.second = nn.Linear(WIDTH, WIDTH), act, nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.second(self.act(self.first(x)))


class Written(nn.Module):
    """The tanh GELU as separate ops of the model's own forward (fx sees each)."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)

    def forward(self, x):
        return self.second(tanh_gelu(self.first(x)))


def _by_name(graph) -> dict:
    return {layer.name: layer for layer in graph.layers}


def _total(graph) -> float:
    return sum(layer.activation_bytes for layer in graph.layers)


def _x() -> torch.Tensor:
    return torch.randn(ROWS, WIDTH)


HIDDEN = ROWS * WIDTH * FLOAT  # one hidden activation's bytes


@pytest.mark.parametrize("make", [lambda: MLP(nn.ReLU()), lambda: MLP(nn.ReLU(inplace=True)),
                                  lambda: MLP(TanhGELU()), Written],
                         ids=["relu", "relu-inplace", "gelu-module", "gelu-written"])
def test_layers_sum_to_what_autograd_holds(make):
    model, x = make(), _x()
    assert _total(trace(model, (x,))) == held_by_autograd(model, x)


def test_relu_keeps_its_output_and_the_linear_before_it_nothing():
    layers = _by_name(trace(MLP(nn.ReLU()), (_x(),)))
    # ReLU saves its result, which the next Linear saves as its input: one storage
    assert layers["first"].activation_bytes == 0
    assert layers["act"].activation_bytes == HIDDEN
    assert layers["x"].activation_bytes == HIDDEN  # the first Linear's input


def test_in_place_relu_keeps_the_storage_the_linear_made():
    layers = _by_name(trace(MLP(nn.ReLU(inplace=True)), (_x(),)))
    assert layers["first"].activation_bytes == HIDDEN
    assert layers["act"].activation_bytes == 0
    assert layers["act"].output.nbytes == HIDDEN  # the rule it replaces counted two


def test_tanh_gelu_keeps_four_of_its_outputs_size():
    """x, 0.5 x, tanh(...) and 1 + tanh(...): four, where the output rule counted one."""
    leaf = _by_name(trace(MLP(TanhGELU()), (_x(),), leaf_modules=[TanhGELU]))
    # inside the leaf: 0.5 x, tanh, 1 + tanh, and its output the next Linear saves
    assert leaf["act"].activation_bytes == 4 * HIDDEN
    assert leaf["first"].activation_bytes == HIDDEN  # x, saved by pow and by the mul
    written = trace(Written(), (_x(),))
    outputs = sum(l.output.nbytes for l in written.layers
                  if l.output.shape == (ROWS, WIDTH) and not l.is_input)
    assert _total(written) - _by_name(written)["x"].activation_bytes - ROWS * 4 * FLOAT \
        == 5 * HIDDEN < outputs


def test_parameters_are_not_counted():
    model = nn.Sequential(nn.Linear(WIDTH, 4096))  # a weight far larger than its batch
    layers = trace(model, (_x(),)).layers
    assert sum(l.activation_bytes for l in layers) == HIDDEN + ROWS * 4096 * FLOAT


def test_a_view_is_its_storage_once():
    class Viewed(nn.Module):
        def __init__(self):
            super().__init__()
            self.first, self.second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 4)

        def forward(self, x):
            h = torch.relu(self.first(x))
            return self.second(h.view(ROWS, 2, WIDTH // 2).flatten(1))

    model, x = Viewed(), _x()
    graph = trace(model, (x,))
    layers = _by_name(graph)
    assert layers["view"].activation_bytes == layers["flatten"].activation_bytes == 0
    assert layers["relu"].activation_bytes == HIDDEN
    assert _total(graph) == held_by_autograd(model, x)


def test_export_graphs_measure_the_same():
    model, x = MLP(nn.ReLU(inplace=True)), _x()
    graph = export_trace(model, (x,))
    assert _total(graph) == held_by_autograd(model, x)
    assert _by_name(graph)["act"].activation_bytes == 0


def test_kept_bytes_follow_the_rows():
    """A layer re-sized to a microbatch (planner.search._scaled) keeps the same share."""
    from planner.search import _scaled

    layer = _by_name(trace(MLP(TanhGELU()), (_x(),), leaf_modules=[TanhGELU]))["act"]
    half = _scaled(layer, ROWS, ROWS // 2)
    assert half.activation_bytes == layer.activation_bytes / 2


def test_unmeasured_layers_keep_their_output():
    layer = _by_name(trace(MLP(nn.ReLU()), (_x(),)))["first"]
    assert replace(layer, saved_per_output=None).activation_bytes == layer.output.nbytes


MIB = 2**20


def _held(layers, **kw):
    from strategies.step_memory import step_held_bytes

    return step_held_bytes(layers, "adamw", "cpu", **kw)


def test_gradients_and_activations_are_not_priced_alive_together():
    """A step zeroes its gradients before the forward: at the backward's start every
    activation and no gradient; at the optimizer step every gradient and no activation."""
    from strategies.step_memory import HeldLayer

    def layers(told: bool):
        # (weights' fp32 bytes, activations): a big first layer, activations behind it
        shape = [(8 * MIB, 2 * MIB), (0.0, 10 * MIB), (1 * MIB, 20 * MIB)]
        return [HeldLayer(g, bucketed=True, activation_bytes=a if told else None)
                for g, a in shape]

    gradients, loss, temps = 9 * MIB, 8 * MIB, 2 * 8 * MIB  # for-loop AdamW: 2 x largest
    summed = _held(layers(False), loss_bytes=loss)
    told = _held(layers(True), loss_bytes=loss)
    # the sum: gradients + activations + max(temporaries, loss); the backward's start holds
    # the most: activations + loss, no gradient
    assert summed - told == pytest.approx(gradients + temps - loss)
    # with little to keep for backward, the optimizer step holds the most: no activation
    light = [HeldLayer(8 * MIB, bucketed=True, activation_bytes=1 * MIB)]
    assert _held([HeldLayer(8 * MIB, bucketed=True)]) - _held(light) == pytest.approx(1 * MIB)


def test_the_backward_holds_what_is_made_and_what_is_left():
    """Gradients made early in the backward (the last layers') beside the activations the
    first layers still keep: the sum's bound is met where both are large at once."""
    from strategies.step_memory import HeldLayer, not_together_bytes

    # a CNN's shape: activations in the first layers, weights in the last
    cnn = [HeldLayer(0.0, activation_bytes=10.0), HeldLayer(10.0, activation_bytes=0.0)]
    assert not_together_bytes(cnn, temps=0.0, start=0.0, during=0.0) == 0.0
    # the other way round the two never meet
    mlp = [HeldLayer(10.0, activation_bytes=0.0), HeldLayer(0.0, activation_bytes=10.0)]
    assert not_together_bytes(mlp, temps=0.0, start=0.0, during=0.0) == 10.0


def test_what_only_the_readers_keep_is_told_apart():
    """Layer.users_saved_per_output: of a layer's kept bytes, the storages only the layers
    reading it save (its output as the next Linear's input), none it saves itself: what a
    layout change before every reader replaces by its copy."""
    relu = _by_name(trace(MLP(nn.ReLU()), (_x(),)))
    # the ReLU saves its own result: the Linear after it saving it too frees nothing
    assert relu["act"].users_saved_per_output == 0
    assert relu["x"].users_saved_per_output == 1.0  # the first Linear's input, only
    gelu = _by_name(trace(MLP(TanhGELU()), (_x(),), leaf_modules=[TanhGELU]))
    # the first Linear's output: saved by the GELU alone; the GELU's: by the second Linear
    assert gelu["first"].users_saved_per_output == gelu["first"].saved_per_output == 1.0
    assert gelu["act"].users_saved_per_output == 1.0
    assert gelu["act"].saved_per_output == 4.0


def test_a_layout_change_before_every_reader_frees_the_output():
    """strategies.step_memory.replaced_bytes: the share of a layer's priced activations
    its readers kept, where every edge from it makes a copy; none where one edge does not
    (that reader keeps the output itself) or the layer saves nothing for its readers."""
    from strategies.step_memory import replaced_bytes

    # the GELU: 4 of its output's size kept, 1 by its reader; priced 8 on this device
    assert replaced_bytes(8.0, 4.0, 1.0, [1.0]) == 2.0
    assert replaced_bytes(8.0, 4.0, 1.0, [1.0, 0.0]) == 0.0  # one reader, no copy
    assert replaced_bytes(8.0, 4.0, 0.0, [1.0]) == 0.0  # a ReLU keeps its own output
    assert replaced_bytes(8.0, 4.0, None, [1.0]) == 0.0  # not measured
    assert replaced_bytes(8.0, 4.0, 1.0, []) == 0.0  # no reader: a model output
