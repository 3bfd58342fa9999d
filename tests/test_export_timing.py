"""Layers of a torch.export graph (Hugging Face models) are timed on this machine's CPU as
fx layers are: each layer's own forward and backward, at the rows one rank runs."""

import importlib

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import planner
from planner.profiled import profiled_graph, trace_model
from zoo import ZOO, _hf

export_timing = importlib.import_module("profiler.export_timing")
layer_timing = importlib.import_module("profiler.profile")  # the module, not the function


def _llama(width: int, vocab: int = 256):
    return _hf("LlamaConfig", "LlamaForCausalLM", vocab_size=vocab, hidden_size=width,
               intermediate_size=4 * width, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, max_position_embeddings=64, bos_token_id=0,
               eos_token_id=0, pad_token_id=0)()


def test_timed_ops_are_each_layers_forward_and_backward(monkeypatch):
    # Count the FLOPs of what is timed instead of timing it: every matmul layer of GPT-2
    # runs its forward, its weight gradient and its input gradient (3x its forward), at
    # half the batch on 2 processes, as a data-parallel rank does.
    def flops_of(fn, *args, **kwargs):
        with FlopCounterMode(display=False) as counter:
            fn()
        return float(counter.get_total_flops())

    monkeypatch.setattr(export_timing, "_TIMES", {})
    monkeypatch.setattr(layer_timing, "median_time", flops_of)
    monkeypatch.setattr(layer_timing, "_TIMES", {})
    # (the whole-layer shard timing runs a module under FlopCounterMode's module hooks,
    # which autograd.grad on a fresh module does not support: tested by the fx path)
    monkeypatch.setattr(layer_timing, "measure_shards", lambda *args: {})
    entry = ZOO["gpt2"]
    model, inputs = entry.make(), entry.batch(0)[:1]
    graph = trace_model(model, inputs, {"use_cache": False})
    graph = layer_timing.profile(graph, measure=True, measure_batch=2, model=model,
                                 example_inputs=inputs)
    timed = [l for l in graph.layers if not l.is_input]
    assert all(l.measured_s is not None and l.measured_batch == 2 for l in timed)
    matmuls = [l for l in timed if l.kind in ("Conv1D", "Linear")]
    assert len(matmuls) == 2 * 2 + 1  # c_fc and c_proj of 2 blocks, the head
    for layer in matmuls:  # the graph counted these at the whole batch of 4
        assert layer.measured_s == 3 * layer.fwd_flops / 2, layer.name


@pytest.mark.serial
def test_llama_layers_measured_in_flop_order():
    # wide enough that each matmul's FLOPs, not the per-call overhead, set its time: at
    # width 128 the MLP (2x the head's FLOPs) and the head both took ~0.6 ms on a slow host
    # and came out in either order
    torch.manual_seed(0)
    model = _llama(width=512, vocab=1024)
    ids = torch.randint(0, 1024, (4, 32))
    graph, _ = profiled_graph(model, "2xcpu", (ids,), {"use_cache": False})
    timed = [l for l in graph.layers if not l.is_input]
    assert all(l.measured_s > 0 and l.measured_batch == 2 for l in timed)
    by_name = {l.name: l for l in timed}
    mlp, norm = by_name["model.layers.0.mlp.up_proj"], by_name["model.layers.0.post_attention_layernorm"]
    head = by_name["lm_head"]
    assert mlp.fwd_flops == 2 * head.fwd_flops and norm.fwd_flops == 0  # 4w x w, 2w x w
    assert mlp.measured_s > head.measured_s > norm.measured_s
    assert set(head.measured_shards) == {"whole", "out", "in"}  # tensor-parallel shapes


def test_planner_prices_hf_layers_from_measurements():
    torch.manual_seed(0)
    model = _llama(width=64)
    ids = torch.randint(0, 256, (4, 16))
    plan = planner.baseline(model, "2xcpu", "ddp", example_inputs=(ids,),
                            example_kwargs={"use_cache": False}, optimizer="sgd")
    graph, _ = profiled_graph(model, "2xcpu", (ids,), {"use_cache": False})
    measured = {l.name: l.measured_s for l in graph.layers if not l.is_input}
    head = next(l for l in plan.layers if l.name == "lm_head")
    # a data-parallel layer's compute is its time measured at one rank's rows (times the
    # machine's sharing factor, the same for every such layer)
    ratios = {l.name: l.compute_s / measured[l.name] for l in plan.layers
              if l.param_bytes and measured.get(l.name)}
    assert head.compute_s > 0 and len(set(round(r, 9) for r in ratios.values())) == 1


def test_whole_step_leaves_the_model_as_it_was():
    # the glue measurement runs the user's model for real: its gradients and BatchNorm
    # statistics must be what they were before planning
    from torch import nn

    from profiler.profile import timed
    from profiler.whole_step import glue_factor, whole_step_s

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))
    grad = torch.ones_like(model[0].weight)
    model[0].weight.grad = grad
    before = model[1].running_mean.clone()
    step_s = whole_step_s(model, (torch.randn(8, 16),), {}, 8, 4, timed)
    assert step_s is not None and step_s > 0
    assert model[0].weight.grad is grad and model[3].weight.grad is None
    assert torch.equal(model[1].running_mean, before)
    assert glue_factor(step_s, step_s / 1.2) == pytest.approx(1.2)
    assert glue_factor(step_s, 2 * step_s) == 1.0 and glue_factor(None, 1.0) == 1.0
    assert glue_factor(10 * step_s, step_s) == 1.5


def test_a_model_planned_twice_in_a_process_is_priced_the_same(monkeypatch):
    """The whole step (the glue on every layer) is measured once per model and shape in a
    process, as layer times are cached by shape: a second planning of the same model, a
    baseline beside optimize(), reads the same times, never a second noisy sample of the
    machine (which had priced one program 36 ms as a baseline and 50 ms as hyplan's)."""
    from torch import nn

    whole_step = importlib.import_module("profiler.whole_step")
    calls = []
    measure = whole_step.whole_step_s

    def counted(*args, **kwargs):
        calls.append(args[3:5])
        return measure(*args, **kwargs)

    monkeypatch.setattr(whole_step, "whole_step_s", counted)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(32, 64)
    first, _ = profiled_graph(model, "2xcpu", (x,))
    second, _ = profiled_graph(model, "2xcpu", (x,))
    assert calls == [(32, 16)]
    assert [l.measured_s for l in first.layers] == [l.measured_s for l in second.layers]
    profiled_graph(model, "4xcpu", (x,))  # other rows: measured at them
    assert calls == [(32, 16), (32, 8)]


def test_split_backward_is_measured_once_and_leaves_the_model_as_it_was():
    """The zero-bubble schedules' split backward (torch's stage_backward_input, then
    stage_backward_weight) timed against one backward on the model itself: at least 1,
    once per model and shape in a process, the model's gradients and buffers untouched."""
    from torch import nn

    from profiler.profile import layer_clock
    from profiler.whole_step import split_backward_ratio

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 64), nn.BatchNorm1d(64), nn.GELU(), nn.Linear(64, 64),
                          nn.GELU(), nn.Linear(64, 4))
    grad = torch.ones_like(model[0].weight)
    model[0].weight.grad = grad
    before = model[1].running_mean.clone()
    x = torch.randn(8, 16)
    ratio = split_backward_ratio(model, (x,), {}, 8, 4, layer_clock(), budget_s=0.2)
    assert 1.0 <= ratio <= 2.0
    assert model[0].weight.grad is grad and model[3].weight.grad is None
    assert torch.equal(model[1].running_mean, before)
    assert split_backward_ratio(model, (x,), {}, 8, 4, lambda: 0.0) == ratio  # cached
    graph, _ = profiled_graph(model, "2xcpu", (x,))
    assert graph.split_backward >= 1.0
