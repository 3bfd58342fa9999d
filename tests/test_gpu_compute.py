"""The GPU compute model by shape: GEMM efficiency is bounded by the measured ceiling and a
bigger GEMM is never faster, tile and wave quantization on shapes worked by hand, and the
catalog prices a Linear on an H100 by its three GEMMs."""

import math
import random

from profiler.graph import Layer, TensorMeta
from profiler.calibrate import ComputeRates
from strategies import calibrated
from strategies.calibrated import device_spec
from strategies.catalog import CostContext, compute_s
from strategies.parse import parse_devices
from strategies.devices import DEVICES
from strategies.gpu_compute import gemm_efficiency, gemm_s, linear_s, tile_wave_efficiency

H100 = DEVICES["H100"]
A100 = DEVICES["A100-80GB"]


def test_gemm_efficiency_bounded_and_bigger_never_faster():
    """Property over 2,000 random GEMM shapes (seeded): efficiency in (0, ceiling]; growing
    any dim never makes a GEMM faster; growing K never lowers its rate. Half-precision dims
    are drawn aligned (multiples of 8): growing an unaligned dim to an aligned one is
    faster, as on the GPU (test_an_unaligned_half_precision_gemm_falls_off_the_ceiling)."""
    rng = random.Random(0)
    for _ in range(2000):
        device, dtype = rng.choice([H100, A100]), rng.choice(["bfloat16", "float32"])
        step = 8 if dtype == "bfloat16" else 1
        m, n, k = (step * rng.randint(1, 40_000 // step) for _ in range(3))
        eff = gemm_efficiency(m, n, k, device, dtype)
        assert 0 < eff <= device.shape.matmul_fraction + 1e-12, (m, n, k)
        grow = step * rng.randint(1, 5000 // step)
        for bigger in ((m + grow, n, k), (m, n + grow, k), (m, n, k + grow)):
            assert gemm_s(*bigger, device, dtype) >= gemm_s(m, n, k, device, dtype), (m, n, k)
        # more work per tile: the rate never drops
        assert gemm_efficiency(m, n, k + grow, device, dtype) >= eff - 1e-12, (m, n, k)


def test_an_unaligned_half_precision_gemm_falls_off_the_ceiling():
    """GPT-2's head (16384 x 50257 x 768): on an H100 its three bf16 GEMMs ran CUTLASS's
    align1 kernels at 123 TFLOP/s, not ~700; the vocabulary padded to 50304 (a multiple of
    8) runs aligned. fp32 has no such cliff in the model."""
    unaligned = gemm_s(16384, 50257, 768, H100, "bfloat16")
    padded = gemm_s(16384, 50304, 768, H100, "bfloat16")
    assert unaligned > 5 * padded
    assert math.isclose(2 * 16384 * 50257 * 768 / unaligned / 1e12, 123, rel_tol=0.06)
    assert gemm_s(16384, 50257, 768, H100, "float32") < 1.01 * gemm_s(16384, 50304, 768,
                                                                        H100, "float32")


def test_tile_and_wave_quantization_by_hand():
    shape = H100.shape  # 132 SMs, 128 x 256 tiles
    # 16384 x 4096 output: 128 x 16 = 2048 tiles, ceil(2048 / 132) = 16 waves
    assert math.isclose(tile_wave_efficiency(16384, 4096, shape), 2048 / (16 * 132))
    # 133 full tiles: one more than the SMs, so a second wave with one tile in it
    assert math.isclose(tile_wave_efficiency(128, 256 * 133, shape), 133 / 264)
    # one row short of a tile: the ragged tile costs a whole one
    assert math.isclose(tile_wave_efficiency(127, 256, shape), 127 / (132 * 128))
    # 132 aligned tiles: one full wave, nothing wasted
    assert tile_wave_efficiency(128 * 12, 256 * 11, shape) == 1.0


def test_large_aligned_gemm_runs_at_the_measured_ceiling():
    # 132 tiles x 8 waves, K = 8192: compute-bound, no quantization loss
    m, n, k = 128 * 12 * 8, 256 * 11, 8192
    assert math.isclose(gemm_efficiency(m, n, k, H100, "bfloat16"), 792.1 / 989)


def test_tiny_gemm_costs_the_launch_floor():
    assert gemm_s(8, 8, 8, H100, "bfloat16") == H100.shape.launch_s


def test_catalog_prices_a_linear_on_h100_by_its_three_gemms():
    cluster = parse_devices("8xH100").model_copy(update={"dtype": "bfloat16"})
    layer = Layer(name="fc", node="fc", op="call_module", kind="Linear", inputs=("x",),
                  output=TensorMeta((16, 8192, 4096), "float32", 16 * 8192 * 4096 * 4),
                  attrs={"in_features": 4096, "out_features": 4096},
                  param_bytes=4096 * 4096 * 4, param_count=4096 * 4096)
    ctx = CostContext(cluster=cluster, ranks=8, batch=16)
    rows = 16 * 8192 // 8
    assert math.isclose(compute_s(layer, 1 / 8, ctx),
                        linear_s(rows, 4096, 4096, cluster.device, "bfloat16"))
    # a column shard: 1/8 of the output features over all the rows
    assert math.isclose(compute_s(layer, 1 / 8, ctx, "out"),
                        linear_s(16 * 8192, 512, 4096, cluster.device, "bfloat16"))


def test_views_cost_nothing_and_elementwise_ops_stream_memory():
    cluster = parse_devices("H100").at_precision("fp32")  # 4-byte activations
    ctx = CostContext(cluster=cluster, ranks=1, batch=2)
    n = 2 * 8192 * 4096
    out = TensorMeta((2, 8192, 4096), "float32", n * 4)
    view = Layer(name="v", node="v", op="call_function", kind="view", inputs=("x",), output=out)
    relu = Layer(name="r", node="r", op="call_function", kind="relu", inputs=("x",), output=out)
    assert compute_s(view, 1.0, ctx) == 0.0
    # read input + write output forward, read both + write the gradient backward: 5 passes
    expected = 5 * n * 4 / (cluster.device.memory_bandwidth_bytes_per_s * 0.9)
    assert math.isclose(compute_s(relu, 1.0, ctx), expected)


H200_RATES = ComputeRates(name="NVIDIA H200", kind="cuda", threads=16, matmul_flops=51e12,
                          conv2d_flops=20e12, copy_bytes_per_s=4.2e12, memory_bytes=140e9,
                          half_flops={"bfloat16": 690e12, "float16": 700e12},
                          multiprocessors=132, attention_flops=345e12, launch_s=6.5e-6)


def test_a_calibrated_gpu_is_priced_by_shape_at_its_measured_ceilings():
    """A GPU's calibrated profile (the rates an H200 measured, 2026-11-26) prices by shape:
    a large aligned bf16 GEMM at the measured 8192-cube rate, flash attention at its
    measured share of it, nothing under the measured launch; not the 1024-cube rate that
    once priced a 953 M Llama's step 3x too slow."""
    spec = device_spec(H200_RATES)
    assert spec.shape is not None and not spec.op_flops
    assert spec.shape.sm_count == 132 and math.isclose(spec.shape.attention_fraction, 0.5)
    m = n = k = 132 * 128  # one full wave of 128 x 256 tiles, twice over in n
    assert math.isclose(gemm_s(m, 2 * n, k, spec, "bfloat16"), 2 * m * 2 * n * k / 690e12,
                        rel_tol=1e-9)
    assert gemm_s(8, 8, 8, spec, "bfloat16") == 6.5e-6


def test_a_gpus_first_use_calibration_makes_a_profile_that_plans(monkeypatch):
    """The whole quick calibration of one GPU (its compute measurements replaced by the
    H200's rates, as this machine has no GPU) gives a profile that plans a model: the path
    a user's first `optimize(model, 1, ...)` on a GPU machine takes."""
    import torch

    import planner

    monkeypatch.setattr(calibrated, "measure_compute", lambda threads, kind: H200_RATES)
    profile = calibrated.calibrate(processes=(1,), quick=True, log=lambda *_: None)
    cluster = profile.cluster(1, 1)
    assert cluster.device.shape.sm_count == 132
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    plan = planner.optimize(model, cluster, (torch.randn(32, 64),), precision="bf16-mixed",
                            measure=False)
    assert 0 < plan.predicted.step_time_s < 1e-3


def test_a_head_parallel_rank_moves_its_share_of_the_weights():
    """A head-parallel attention rank holds 1/tp of the projections, so it casts and
    accumulates 1/tp of them (the trace's weight traffic, `ff` and `bf`), not the whole
    module's on every rank, as a data-parallel rank of it does. Before: 310B on tp 8 with
    1-row microbatches, 12.9 GB a microbatch charged to every rank, 2.6x its MLP."""
    from strategies.catalog import split_compute_s
    from strategies.gpu_compute import memory_bound_s, traffic_s
    from strategies.transformer import HeadParallel

    cluster = parse_devices("8xA100-80GB").at_precision("bf16-mixed")
    hidden, heads, rows, weight = 4096, 32, 2048, 6e9  # a weight traffic of 6 GB each way
    layer = Layer(name="attn", node="attn", op="call_module", kind="GPT2Attention",
                  inputs=("x",), output=TensorMeta((1, rows, hidden), "float32",
                                                  rows * hidden * 4),
                  attrs={"num_attention_heads": heads,
                         "traffic": {"bfloat16": (1e9, weight, 1e9, weight, 4, 4)}},
                  param_bytes=4 * hidden * hidden * 4, param_count=4 * hidden * hidden)
    ctx = CostContext(cluster=cluster, ranks=8, batch=1)
    device = cluster.device
    assert math.isclose(traffic_s(layer, 1 / 8, device, "bfloat16", "shard"),
                        memory_bound_s((2e9 + 2 * weight) / 8, 8, device, elementwise=True))
    assert math.isclose(traffic_s(layer, 1 / 8, device, "bfloat16", "batch"),
                        memory_bound_s(2e9 / 8 + 2 * weight, 8, device, elementwise=True))
    priced = HeadParallel().cost(layer, ctx).compute_s
    assert math.isclose(priced, split_compute_s(layer, ctx, "shard"))
    # the whole weights' traffic on every rank would cost 7/8 of it more
    assert split_compute_s(layer, ctx, "batch") - priced > 0.8 * memory_bound_s(
        2 * weight, 8, device, elementwise=True) * 7 / 8
