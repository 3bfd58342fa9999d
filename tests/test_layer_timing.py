"""Layer timing runs each layer's whole forward and backward, input gradients included."""

import importlib

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from planner.profiled import trace_model

# the module (the package's `profiler.profile` attribute is the function of that name)
layer_timing = importlib.import_module("profiler.profile")


def test_timed_backward_includes_the_input_gradient(monkeypatch):
    # Count the FLOPs of what is timed instead of timing it: a Linear after another layer
    # must compute its input gradient too (3x its forward), as the real backward does.
    # (Timing once asked autograd for the gradient of the wrong leaves, and autograd
    # skipped the input gradient: every layer looked a third cheaper than it ran.)
    def flops_of(fn, *args, **kwargs):
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    monkeypatch.setattr(layer_timing, "median_time", flops_of)
    layer_timing.forget_layer_times()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 48))
    graph = trace_model(model, (torch.randn(8, 32),), tracer="fx")
    times = layer_timing.measure_times(graph, 8)
    layer_timing.forget_layer_times()
    forward = 2 * 8 * 64 * 48
    assert times["_2"] == 3 * forward  # forward, weight gradient, input gradient
    assert times["_0"] == 2 * 2 * 8 * 32 * 64  # the first layer: no input gradient
