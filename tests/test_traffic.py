"""What a layer's memory-bound kernels move under autocast (profiler.traffic), checked by
hand on a small Hugging Face Llama: a Linear reading the float32 norm's output pays the
casts of that input and of its weight (and casts the gradients back), nothing in fp32;
the MLP's activation runs in bf16 (it reads a Linear's output); the residual stream stays
float32; an embedding reads the rows it gathers, not its table; a microbatch scales the
batch's bytes and keeps the weights'."""

import pytest
import torch
from torch import nn

from examples.hf_llama import build
from planner.search import _scaled
from profiler.export_trace import export, export_trace
from profiler.profile import count_flops_and_traffic
from profiler.trace import trace
from profiler.traffic import Seen, Traffic, accumulation, bytes_at, op_name, traffic
from strategies import gpu_compute
from strategies.devices import DEVICES

BATCH, SEQ, WIDTH, FFN = 2, 16, 64, 256


def _graph():
    model, (ids,), _ = build(BATCH, "cpu", layers=1, width=WIDTH, heads=4, kv_heads=4, seq=SEQ,
                             vocab=128)
    return export_trace(model, (ids,), {"use_cache": False})


def test_autocast_casts_dtypes_and_the_batchs_share():
    graph = _graph()
    layer = {l.name: l for l in graph.layers}
    tokens = BATCH * SEQ
    q = layer["model.layers.0.self_attn.q_proj"].attrs["traffic"]
    # bf16: the fp32 input (tokens x width) and the weight (width x width) each cast,
    # read 4 bytes and written 2, forward and (the gradients cast back) backward
    assert q["bfloat16"] == (tokens * WIDTH * 6, WIDTH * WIDTH * 6,
                             tokens * WIDTH * 6, WIDTH * WIDTH * 6, 2, 2)
    assert q["float32"] == (0, 0, 0, 0, 0, 0)  # no autocast, no casts
    act = next(l for l in graph.layers if l.kind in ("silu", "SiLUActivation")).attrs["traffic"]
    # reads the gate's bf16 output and writes bf16: 2 bytes each way, 4 in fp32
    assert act["bfloat16"][:2] == (tokens * FFN * 2 * 2, 0)
    assert act["float32"][:2] == (tokens * FFN * 4 * 2, 0)
    embedding = layer["model.embed_tokens"].attrs["traffic"]["bfloat16"]
    # forward: the ids and the gathered rows read and written, the batch's; backward: the
    # table's gradient zeroed (fixed) and the rows added into it
    assert embedding[:2] == (tokens * 8 + 2 * tokens * WIDTH * 4, 0)
    assert embedding[3] == 128 * WIDTH * 4
    residual = [l for l in graph.layers if l.kind == "add"
                and l.output.shape == (BATCH, SEQ, WIDTH)]
    # the residual add reads the fp32 stream and a bf16 projection, writes fp32
    assert any(l.attrs["traffic"]["bfloat16"][0] == tokens * WIDTH * (4 + 2 + 4)
               for l in residual)


def test_a_microbatch_scales_the_batchs_bytes_and_keeps_the_weights():
    graph = _graph()
    q = next(l for l in graph.layers if l.name == "model.layers.0.self_attn.q_proj")
    half = _scaled(q, BATCH, BATCH // 2)
    whole, part = q.attrs["traffic"]["bfloat16"], half.attrs["traffic"]["bfloat16"]
    assert part == (whole[0] / 2, whole[1], whole[2] / 2, whole[3], whole[4], whole[5])
    # priced on an H100: a data-parallel half holds the whole weight, a column shard half
    h100 = DEVICES["H100"]
    assert bytes_at(whole, 0.5, 1.0) == (sum(part[:4]), 4)
    assert bytes_at(whole, 0.5, 0.5)[0] == sum(whole[:4]) / 2
    # a Linear costs its three GEMMs plus its casts
    rows = BATCH * SEQ
    assert torch.isclose(
        torch.tensor(gpu_compute.layer_s(q, 1.0, "batch", h100, "bfloat16")),
        torch.tensor(gpu_compute.linear_s(rows, WIDTH, WIDTH, h100, "bfloat16")
                     + gpu_compute.traffic_s(q, 1.0, h100, "bfloat16")))


class _FanOut(nn.Module):
    """One activation read by two Linears: backward sums its two gradients."""

    def __init__(self):
        super().__init__()
        self.c, self.a, self.b = (nn.Linear(WIDTH, WIDTH) for _ in range(3))

    def forward(self, x):
        y = torch.relu(self.c(x))
        return self.a(y) + self.b(y)


def test_a_tensor_read_twice_pays_one_gradient_sum_and_fx_counts_like_export():
    """fx (count_flops_and_traffic, each node's ATen ops replayed) and torch.export price a
    model alike; the relu's output, read by two Linears, costs one sum of two gradients
    (read two, write one), paid by its second reader, so that a block's price does not
    depend on what reads its output after it (profiler.repeat_blocks copies blocks)."""
    x = torch.randn(BATCH * SEQ, WIDTH, requires_grad=False)
    model = _FanOut()
    _, fx_moved = count_flops_and_traffic(trace(model, (x,)))
    program = export(model, (x,), {})
    per_node = traffic(program, "float32", BATCH * SEQ)
    nodes = list(program.graph_module.graph.nodes)
    relu = next(n for n in nodes if op_name(n) == "relu")
    second = [n for n in nodes if op_name(n) == "linear"][2]  # b, the relu's second reader
    nbytes = x.numel() * 4
    # forward: read c's output, write y; backward: read dy and the input, write its gradient
    assert per_node[relu.name].as_attr() == (2 * nbytes, 0, 3 * nbytes, 0, 1, 1)
    assert per_node[second.name].as_attr() == (0, 0, 3 * nbytes, 0, 0, 1)
    assert fx_moved["relu"]["float32"] == per_node[relu.name].as_attr()
    assert fx_moved["b"]["float32"] == per_node[second.name].as_attr()
    assert accumulation(Seen(x, torch.float32, True, True), 1) == Traffic()


class _SortedPairs(nn.Module):
    """A router's pairs sorted by expert, as every mixture-of-experts family's dispatch
    does: the sort yields a tuple, whose items are read by getitem."""

    def forward(self, x):
        flat = x.reshape(-1)  # its dim 0 is not the batch's
        values, order = torch.sort(flat)
        return values * 2 + flat[order]


def test_what_a_sort_of_the_batch_yields_is_the_batchs():
    """The items of a tuple op (sort, topk) over the batch's tensors scale with the rows
    (before, they counted as weights: DeepSeek-V3's routed pairs, 2.4 TB a step that no
    microbatch shrank, priced its experts at 3.9 s per microbatch of one sequence)."""
    x = torch.randn(BATCH, WIDTH)
    program = export(_SortedPairs(), (x,), {})
    per_node = traffic(program, "float32", BATCH)
    nodes = [n for n in program.graph_module.graph.nodes if op_name(n) in ("mul", "index")]
    assert len(nodes) == 2
    for node in nodes:
        rows, fixed = per_node[node.name].as_attr()[:2]
        assert rows > 0 and fixed == 0, node.name


def test_a_mixture_of_experts_buffers_scale_with_the_rows():
    """An experts layer makes buffers over its tokens and (token, expert) pairs (grouped
    matmul's sorted pairs, the output it adds them into): the batch's bytes, not fixed ones
    as a weight's, so traced at twice the rows its fixed bytes stay and the batch's double
    (fixed, a microbatch was priced with the whole traced batch's buffers)."""
    from moe_zoo import MOE_ZOO
    from planner.profiled import trace_model

    def experts_traffic(rows):
        model = MOE_ZOO["mixtral"].make()
        ids = torch.zeros(rows, SEQ, dtype=torch.long)
        graph = trace_model(model, (ids,), {"use_cache": False}, (), "blocks")
        return next(l for l in graph.layers if l.kind == "MixtralExperts").attrs["traffic"]

    small, large = experts_traffic(2)["bfloat16"], experts_traffic(4)["bfloat16"]
    assert (large[1], large[3]) == (small[1], small[3])
    # (within a few bytes: a tensor of the experts' counts whose length is the batch's)
    assert (large[0], large[2]) == pytest.approx((2 * small[0], 2 * small[2]), rel=1e-3)
