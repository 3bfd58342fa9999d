"""The GPU compute model by shape: GEMM efficiency is bounded by the measured ceiling and a
bigger GEMM is never faster, tile and wave quantization on shapes worked by hand, and the
catalog prices a Linear on an H100 by its three GEMMs."""

import math
import random

from profiler.graph import Layer, TensorMeta
from strategies.catalog import CostContext, compute_s
from strategies.parse import parse_devices
from strategies.devices import DEVICES
from strategies.gpu_compute import gemm_efficiency, gemm_s, linear_s, tile_wave_efficiency

H100 = DEVICES["H100"]
A100 = DEVICES["A100-80GB"]


def test_gemm_efficiency_bounded_and_bigger_never_faster():
    """Property over 2,000 random GEMM shapes (seeded): efficiency in (0, ceiling]; growing
    any dim never makes a GEMM faster; growing K never lowers its rate."""
    rng = random.Random(0)
    for _ in range(2000):
        m, n, k = (rng.randint(1, 40_000) for _ in range(3))
        device, dtype = rng.choice([H100, A100]), rng.choice(["bfloat16", "float32"])
        eff = gemm_efficiency(m, n, k, device, dtype)
        assert 0 < eff <= device.shape.matmul_fraction + 1e-12, (m, n, k)
        grow = rng.randint(1, 5000)
        for bigger in ((m + grow, n, k), (m, n + grow, k), (m, n, k + grow)):
            assert gemm_s(*bigger, device, dtype) >= gemm_s(m, n, k, device, dtype), (m, n, k)
        # more work per tile: the rate never drops
        assert gemm_efficiency(m, n, k + grow, device, dtype) >= eff - 1e-12, (m, n, k)


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
