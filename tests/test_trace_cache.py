"""A model is traced once per structure and input shapes in a process
(planner.profiled.trace_model): planning it again, or a baseline beside it, reads the same
graph, and anything a trace depends on (shapes, a module swapped, a tie, the inputs'
shapes) traces it again."""

import gc

import torch
from torch import nn

import models
import planner
from planner import profiled
from planner.profiled import trace_model


def test_a_model_planned_twice_is_traced_once(monkeypatch):
    model = models.build("mlp")
    x, _ = models.batch("mlp", 16, 0)
    calls = []
    real = profiled._trace
    monkeypatch.setattr(profiled, "_trace", lambda *a: calls.append(1) or real(*a))
    first = planner.optimize(model, "2xV100", example_inputs=(x,), measure=False)
    second = planner.baseline(model, "2xV100", "ddp", example_inputs=(x,), measure=False)
    again = planner.optimize(model, "2xV100", example_inputs=(x,), measure=False)
    assert len(calls) == 1
    assert again.predicted == first.predicted and again.layers == first.layers
    assert second.num_devices == 2


def test_what_a_trace_depends_on_traces_again():
    model = models.build("mlp")
    x, _ = models.batch("mlp", 16, 0)
    graph = trace_model(model, (x,))
    assert trace_model(model, (x,)) is graph
    assert trace_model(model, (x[:8],)) is not graph  # the inputs' shapes
    assert trace_model(model, (x,), tracer="export") is not graph
    before = trace_model(model, (x,))
    model[1] = nn.Tanh()  # a module swapped, no parameter changed
    assert trace_model(model, (x,)) is not before
    before = trace_model(model, (x,))
    with torch.no_grad():
        model[0].weight.mul_(2)  # values only: the same graph
    assert trace_model(model, (x,)) is before
    model.eval()
    assert trace_model(model, (x,)) is not before


def test_a_tie_made_traces_again_and_a_dropped_model_frees_its_graphs():
    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10, bias=False))
    ids = torch.randint(0, 10, (4, 3))
    untied = trace_model(model, (ids,))
    model[1].weight = model[0].weight  # tied: one parameter, counted once
    tied = trace_model(model, (ids,))
    assert tied is not untied
    assert sum(l.param_bytes for l in tied.layers) < sum(l.param_bytes for l in untied.layers)
    gc.collect()
    count = len(profiled._traced)
    del model
    gc.collect()
    assert len(profiled._traced) == count - 1
