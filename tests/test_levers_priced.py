"""The kernel levers priced (strategies.kernel_levers): torch.compile's fusion takes a run of
element-wise layers to one read of what enters it and one write of what leaves it (bytes
counted by hand), float8 halves a large GEMM and prices a Linear as torchao measured it,
float8 tensorwise gathers TP activations in one byte, async TP leaves of a fused TP
collective what exposed_s says, and levers off change no price."""

import numpy as np
import pytest
import torch
from torch import nn

from planner.price import EdgeKind, edge_cost, price, tp_context
from planner.profiled import profiled_graph
from strategies.async_tp import copy_bytes, exposed_s
from strategies.catalog import RowParallel
from strategies.collectives import all_gather_s, reduce_scatter_s
from strategies.devices import DEVICES
from strategies.float8 import tp_gather_bytes
from strategies.fusion import EAGER, fused, groups
from strategies.gpu_compute import float8_linear_s, gemm_s, layer_s, linear_s
from strategies.kernel_levers import Levers
from strategies.layouts import Layout
from strategies.parse import parse_devices

H100 = DEVICES["H100"]
ROWS, HIDDEN = 64, 32


class GatedMLP(nn.Module):
    """Two Linears with a run of three element-wise ops between them."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(HIDDEN, HIDDEN), nn.Linear(HIDDEN, HIDDEN)

    def forward(self, x):
        h = self.up(x)
        return self.down(h * torch.sigmoid(h) * 2.0)


def _graph():
    graph, _ = profiled_graph(GatedMLP(), "1xH100", (torch.randn(ROWS, HIDDEN),))
    return graph


def test_a_run_of_elementwise_layers_reads_and_writes_once():
    """sigmoid, mul, mul between the Linears fuse into one group. Forward reads up's
    output and writes the last mul's (64 x 32 bf16 each: 4,096 bytes); backward reads the
    output's gradient and the saved input and writes the input's gradient (3 x 4,096),
    one kernel each way; eager moved more."""
    graph = _graph()
    [group] = groups(graph)
    assert [l.kind for l in group] == ["sigmoid", "mul", "mul"]
    compiled = fused(graph)
    members = [compiled.layer(l.node) for l in group]
    total = [sum(m.attrs["traffic"]["bfloat16"][i] for m in members) for i in range(6)]
    tensor = ROWS * HIDDEN * 2
    assert total[0] + total[1] == pytest.approx(2 * tensor)  # forward: one read, one write
    assert total[2] + total[3] == pytest.approx(3 * tensor)  # backward
    assert total[4] == pytest.approx(1) and total[5] == pytest.approx(1)
    eager = [sum(m.attrs[EAGER]["bfloat16"][i] for m in members) for i in range(4)]
    assert sum(eager) > sum(total[:4])
    up = compiled.layer(graph.layers[1].node)
    assert up.attrs["traffic"] == graph.layers[1].attrs["traffic"]  # a GEMM is untouched


def test_float8_halves_a_large_gemm_and_prices_torchaos_examples():
    """The float8 GEMM takes half the bf16 one's time (1979 vs 989 TFLOP/s at the same
    share); a whole Float8Linear with its casts within torchao's published H100 speedups
    (torchao/float8/README.md): 0.80x at M, K, N = 1024, 2048, 1024 and 1.39x at 4096,
    8192, 16384, within 15%."""
    big = (16384, 8192, 8192)
    assert gemm_s(*big, H100, "float8") / gemm_s(*big, H100, "bfloat16") == pytest.approx(
        989 / 1979, rel=1e-3)
    for (m, k, n), published in (((1024, 2048, 1024), 0.80), ((4096, 8192, 16384), 1.39)):
        bf16_s = linear_s(m, n, k, H100, "bfloat16")
        speedup = bf16_s / float8_linear_s(m, n, k, H100, "bfloat16")
        assert speedup == pytest.approx(published, rel=0.15)


def test_float8_refuses_a_device_without_it_and_a_bad_recipe():
    with pytest.raises(ValueError, match="float8: A100-80GB has no float8"):
        float8_linear_s(4096, 4096, 4096, DEVICES["A100-80GB"], "bfloat16")
    with pytest.raises(ValueError, match="float8: 'blockwise' is not a torchao recipe"):
        Levers(float8="blockwise")


def test_async_tp_leaves_the_copies_past_the_remote_matmuls_and_its_memory_pass():
    """torch's fused ops overlap the tp - 1 remote shards' copies with their matmuls and
    leave the local copy (all-gather) or the partials' sum (reduce-scatter) outside."""
    assert exposed_s(8.0, 100.0, 8) == 0.0
    assert exposed_s(8.0, 100.0, 8, copy_s=0.5) == pytest.approx(0.5)
    assert exposed_s(8.0, 4.0, 8) == pytest.approx(8.0 - 3.5)
    assert exposed_s(8.0, 0.0, 8) == pytest.approx(8.0)
    assert exposed_s(8.0, 100.0, 1) == 8.0
    assert copy_bytes("all_gather", 800.0, 8) == 200.0  # the local shard read and written
    assert copy_bytes("reduce_scatter", 800.0, 8) == 900.0  # 8 partials read, one written


def _row_split_down(levers):
    """`down` (32 x 32, converted by torchtitan's filter) row-parallel over 2 H100s, its
    output reduce-scattered by rows, priced with `levers`."""
    layer = next(l for l in _graph().layers if l.name == "down")
    cluster = parse_devices("2xH100").model_copy(update={"levers": levers})
    ctx = tp_context(cluster, 2, ROWS, "adam")
    return layer, ctx, price(layer, RowParallel(gives=Layout.BATCH), ctx)


def test_float8_tensorwise_gathers_tp_activations_in_one_byte_and_async_tp_hides_them():
    """A row-parallel layer's reduce-scatter stays bf16 and its gradient's all-gather
    sends half the bytes under tensorwise (torchao's Float8RowwiseParallel), not rowwise;
    async TP then leaves of each what exposed_s says beside the layer's own GEMM."""
    layer, ctx, off = _row_split_down(Levers())
    n, link = layer.output.nbytes, ctx.link
    whole = reduce_scatter_s(n, 2, link) + all_gather_s(n, 2, link)
    assert off.cost.communication_s == pytest.approx(whole)
    assert tp_gather_bytes(n, True, Levers(float8="tensorwise")) == n / 2
    assert tp_gather_bytes(n, True, Levers(float8="rowwise")) == n
    *_, tensorwise = _row_split_down(Levers(float8="tensorwise"))
    assert tensorwise.cost.communication_s == pytest.approx(
        reduce_scatter_s(n, 2, link) + all_gather_s(n / 2, 2, link))
    *_, rowwise = _row_split_down(Levers(float8="rowwise"))
    assert rowwise.cost.communication_s == pytest.approx(whole)
    _, ctx, hidden = _row_split_down(Levers(async_tp=True))
    gemm = gemm_s(ROWS, HIDDEN, HIDDEN // 2, H100, "bfloat16")
    pass_s = [copy_bytes(c, n, 2) / (H100.memory_bandwidth_bytes_per_s
                                     * H100.shape.memory_fraction)
              for c in ("reduce_scatter", "all_gather")]
    assert hidden.cost.communication_s == pytest.approx(
        exposed_s(reduce_scatter_s(n, 2, link), gemm, 2, pass_s[0])
        + exposed_s(all_gather_s(n, 2, link), gemm, 2, pass_s[1]))
    assert hidden.microbatch_s < off.microbatch_s


def test_an_edge_into_a_column_split_gathers_float8_and_leaves_its_scatter_whole():
    """Rows gathered into a column-parallel Linear: one byte an element under tensorwise
    (PrepareFloat8ModuleInput); async TP fuses that gather with the Linear's GEMM, and its
    input gradient's reduce-scatter (a sum of matmuls, not fused) stays as priced."""
    n, link = ROWS * HIDDEN * 2, parse_devices("2xH100").link(2)
    kind = EdgeKind((Layout.BATCH,), (Layout.REPLICATE_PARTIAL_GRAD,), (True,), n, 2, ROWS,
                    True, into_module=True, into_gemm=(ROWS, HIDDEN // 2, HIDDEN),
                    into_float8=True)

    def edge(levers):
        return edge_cost(kind, parse_devices("2xH100").model_copy(
            update={"levers": levers}))[0, 0]

    scatter = reduce_scatter_s(n, 2, link)
    assert edge(Levers()) == pytest.approx(all_gather_s(n, 2, link) + scatter)
    assert edge(Levers(float8="tensorwise")) == pytest.approx(
        all_gather_s(n / 2, 2, link) + scatter)
    gemm = gemm_s(ROWS, HIDDEN // 2, HIDDEN, H100, "bfloat16")
    copy_s = copy_bytes("all_gather", n, 2) / (H100.memory_bandwidth_bytes_per_s
                                               * H100.shape.memory_fraction)
    assert edge(Levers(async_tp=True)) == pytest.approx(
        exposed_s(all_gather_s(n, 2, link), gemm, 2, copy_s) + scatter)


def test_levers_off_change_no_price_and_compile_lowers_it():
    """Every layer's price with the levers off is bit-identical to the price without them;
    the cluster keeps the precision's own all-gather bytes; compile lowers it (float8 does
    not on shapes this small: launch floors, as torchao's small example)."""
    graph = _graph()
    for layer in graph.layers:
        for split in ("batch", "out"):
            assert layer_s(layer, 0.5, split, H100, "bfloat16", Levers()) == layer_s(
                layer, 0.5, split, H100, "bfloat16")
    plain = parse_devices("8xH100")
    off = plain.model_copy(update={"levers": Levers()})
    assert off.training_precision == plain.training_precision
    tensorwise = plain.model_copy(update={"levers": Levers(float8="tensorwise")})
    assert tensorwise.training_precision.gather_bytes(4.0) == 1.0  # float8: 1 byte/weight
    compiled = fused(graph)
    levers = Levers(compile=True)
    eager_s = sum(layer_s(l, 1.0, "batch", H100, "bfloat16") for l in graph.layers)
    fast_s = sum(layer_s(l, 1.0, "batch", H100, "bfloat16", levers) for l in compiled.layers)
    assert fast_s < eager_s


def test_a_plan_priced_with_compile_is_faster_and_says_the_lever_is_priced_only():
    """Through planner.optimize: levers off give the very step time of a cluster that names
    none; compile lowers it, and explain() names the lever and says the executor does not
    apply it."""
    import planner

    x = torch.randn(ROWS, HIDDEN)
    plain = parse_devices("2xH100")

    def plan(cluster):
        return planner.optimize(GatedMLP(), cluster, example_inputs=(x,))

    eager = plan(plain)
    off = plan(plain.model_copy(update={"levers": Levers()}))
    compiled = plan(plain.model_copy(update={"levers": Levers(compile=True)}))
    assert off.predicted.step_time_s == eager.predicted.step_time_s
    assert compiled.predicted.step_time_s < eager.predicted.step_time_s
    said = compiled.explain()
    assert "Kernel levers priced: torch.compile" in said and "priced only" in said
    assert "Kernel levers" not in eager.explain()


def test_float8_tensorwise_casts_a_sequence_parallel_tp_operand_on_its_shard():
    """torchtitan's float8 TP (tensorwise) casts a column-parallel input, and a row-parallel
    output's gradient, on the rank's 1/tp tokens before the float8 all-gather: amax and one
    orientation on the shard (6 - 1 bytes an element compiled), then the gathered tensor
    transposed (2 bytes an element); the other operands as before. Rowwise, or TP without
    sequence parallelism, casts whole."""
    from strategies.float8 import cast_bytes

    rows, out, inp, tp = 8192, 1024, 4096, 8
    whole = cast_bytes(rows, out, inp, "tensorwise", True)
    assert whole == 6 * (rows * inp + rows * out + out * inp)
    shard = cast_bytes(rows, out, inp, "tensorwise", True, input_shard=1 / tp)
    assert shard == pytest.approx(5 * rows * inp / tp + 2 * rows * inp
                                  + 6 * (rows * out + out * inp))
    grad = cast_bytes(rows, out, inp, "tensorwise", True, grad_shard=1 / tp)
    assert grad == pytest.approx(5 * rows * out / tp + 2 * rows * out
                                 + 6 * (rows * inp + out * inp))
    assert cast_bytes(rows, out, inp, "rowwise", True, input_shard=1 / tp) == cast_bytes(
        rows, out, inp, "rowwise", True)
    # through layer_s: a column split (out) casts its input on the shard, a row split (in)
    # its output's gradient; on a large GEMM that is less time than casting whole
    big = (8 * 8192, 8192, 8192)
    assert float8_linear_s(*big, H100, "bfloat16", input_shard=1 / tp) < float8_linear_s(
        *big, H100, "bfloat16")
    from strategies.gpu_compute import traffic_s

    layer = next(l for l in _graph().layers if l.name == "up")
    f8 = Levers(compile=True, float8="tensorwise")
    glue = traffic_s(layer, 1 / 2, H100, "bfloat16", "out") or 0.0
    assert layer_s(layer, 1 / 2, "out", H100, "bfloat16", f8) == float8_linear_s(
        ROWS, HIDDEN // 2, HIDDEN, H100, "bfloat16", "tensorwise", True,
        input_shard=1 / 2) + glue


def test_sequence_parallel_keeps_torchtitans_token_split_variants_only():
    """Priced as torchtitan's TP (Levers.sequence_parallel), a torch.export graph keeps a
    norm on its tokens (not whole), a row-parallel layer reduce-scattering into tokens (not
    all-reducing), and a column-parallel layer as it is; without the lever the module
    executor's rule drops every token split, as before."""
    from planner.offers import module_executor_options
    from strategies.catalog import ColumnParallel, Replicate
    from strategies.sequence import SequenceParallel

    norm = next(l for l in _graph().layers if l.name == "up")  # a call_module layer
    options = [Replicate(), SequenceParallel(), ColumnParallel(),
               RowParallel(gives=Layout.REPLICATE), RowParallel(gives=Layout.SEQUENCE)]
    kept = module_executor_options(norm, options, sequence=True)
    assert [(s.name, s.gives) for s in kept] == [
        ("sequence_parallel", Layout.SEQUENCE), ("column_parallel", Layout.FEATURE),
        ("row_parallel", Layout.SEQUENCE)]
    plain = module_executor_options(norm, options)
    assert [(s.name, s.gives) for s in plain] == [
        ("replicate", Layout.REPLICATE), ("column_parallel", Layout.FEATURE),
        ("row_parallel", Layout.REPLICATE)]
    assert Levers(sequence_parallel=True).any and "sequence parallel" in Levers(
        sequence_parallel=True).describe()


def test_a_sequence_shard_gathered_for_two_modules_is_gathered_once():
    """torchtitan's PrepareModuleInput gathers a feed-forward's input once for w1 and w3 (and
    reduce-scatters their summed gradient once): priced as torchtitan runs it, each of the
    two edges from a sequence-sharded norm into a column-parallel Linear carries half of
    the all-gather and the reduce-scatter; one reader carries them whole."""
    from dataclasses import replace as _replace

    n, link = ROWS * HIDDEN * 2, parse_devices("2xH100").link(2)
    kind = EdgeKind((Layout.SEQUENCE,), (Layout.REPLICATE_PARTIAL_GRAD,), (True,), n, 2, ROWS,
                    True, into_module=True)
    cluster = parse_devices("2xH100").model_copy(
        update={"levers": Levers(sequence_parallel=True)})
    whole = edge_cost(kind, cluster)[0, 0]
    assert whole == pytest.approx(all_gather_s(n, 2, link) + reduce_scatter_s(n, 2, link)
                                  + cluster.dtensor_reshard_overhead_s, rel=0.05)
    assert edge_cost(_replace(kind, readers=2), cluster)[0, 0] == pytest.approx(whole / 2)


def test_a_recomputed_block_keeps_its_input_on_its_sequence_shard():
    """A block checkpointed whole keeps the hidden state entering it; where its first layer
    takes that state by tokens (a sequence-parallel norm, torchtitan's Shard(1) checkpoint)
    it keeps 1/tp of it, and whole where it takes it whole."""
    from types import SimpleNamespace

    from planner.pipeline.block_recompute import _with_recomputed, kept_per_option
    from planner.pipeline.stages import LayerOptions
    from strategies.catalog import Replicate
    from strategies.sequence import SequenceParallel

    options = LayerOptions("norm", 0, ("replicate", "sequence_parallel"), np.zeros(2),
                           np.zeros(2), np.zeros(2), np.array([8.0, 2.0]))
    layer = next(l for l in _graph().layers if l.name == "up")
    built = SimpleNamespace(layers=[layer], costs=[[SimpleNamespace(compute_s=0.0)] * 2],
                            strategies=[(Replicate(), SequenceParallel())])
    tp, kept = 4, 1000.0
    per_option = kept_per_option(built.strategies[0], kept, tp)
    assert per_option == [1000.0, 250.0]
    out = _with_recomputed(options, built, 0, per_option)
    assert list(out.activation_bytes) == [8.0, 2.0, 1000.0, 250.0]
    assert list(out.recomputed) == [False, False, True, True]
