"""GPU compute by shape: what one layer's forward + backward costs on a GPU with a `GPUShape`.

A flat "peak x 0.6" misprices both ends: a large GEMM runs at ~80-86% of peak, a small or
ragged one far below, a LayerNorm at memory bandwidth and a tiny op at the launch floor.
Here each layer is priced by what it runs:

- a Linear: three GEMMs, forward (M x N x K, M the rows, N the output and K the input
  features) and the two of backward (input gradient M x K x N, weight gradient N x K x M),
  plus what autocast casts for them (its weight, a float32 input, their gradients back).
  Each GEMM is tiled into `tile_m x tile_n` output tiles that the SMs compute in waves:

      tiles = ceil(M / tm) * ceil(N / tn),   waves = ceil(tiles / SMs)
      compute_s = waves * 2 * tm * tn * K / (peak * matmul_fraction / SMs)
      gemm_s = max(compute_s, bytes / achievable bandwidth, launch_s)

  so a ragged last tile (tile quantization) and a last wave that leaves SMs idle (wave
  quantization) cost what they cost, and a large aligned GEMM runs at `matmul_fraction`
  of peak (the best rate measured, MAMF); a half-precision GEMM with a dim off 8 elements
  at `unaligned_fraction` of that (cuBLAS's align1 kernels);
- an attention block (a leaf with heads): its q, k, v and output projections as GEMMs,
  and scaled-dot-product attention by its FLOPs at FlashAttention's measured rate
  (causal: half the score matrix; backward 2.5x forward, FlashAttention-2's count), plus
  the memory traffic of the elementwise work around it (rotary embedding, reshapes);
- everything else streams memory: the bytes and kernels profiler.traffic counted for the
  layer under the compute dtype (autocast's dtypes and casts, the backward, gradient
  sums) at `elementwise_fraction` of the copy bandwidth, never below the launch floor per
  kernel; views launch nothing and cost nothing. A graph without those counts falls back
  to a roofline at the compute dtype's element size.

The kernel levers a cluster carries (strategies.kernel_levers): float8 prices each Linear
torchtitan converts by `float8_linear_s` (strategies.float8: the float8 rate, the casts);
torch.compile reaches this file only as the graph's traffic, fused by strategies.fusion.

Checked on a lent H100 (benchmarks/gpu_lent.py, benchmarks/results/gpu-h100.txt): a
953 M Llama's and GPT-2's one-GPU bf16 training steps priced -8% and -6% of what hyplan's
run measured, -3% and +8% of the same step written by hand. Figures and their sources
are in strategies.devices.
"""

from __future__ import annotations

import math
from functools import partial

from profiler.graph import Layer
from profiler.traffic import bytes_at
from strategies.devices import DeviceSpec, GPUShape
from strategies import float8
from strategies.kernel_levers import Levers

ELEMENT_BYTES = {"float32": 4, "tfloat32": 4, "bfloat16": 2, "float16": 2, "float8": 1}
# ops that only re-describe a tensor (a view) launch no kernel
VIEW_KINDS = {
    "view", "_unsafe_view", "reshape", "unsqueeze", "squeeze", "expand", "transpose", "t",
    "permute", "slice", "select", "alias", "detach", "getitem", "split", "chunk", "unbind",
    "narrow", "as_strided", "flatten", "unflatten", "size", "dropout", "identity",
    "Identity", "Dropout", "Flatten", "lift_fresh_copy",
}
SDPA_KINDS = {"scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
              "_scaled_dot_product_efficient_attention", "_scaled_dot_product_cudnn_attention"}
# FlashAttention-2 counts backward as 2.5x forward (five matmuls to forward's two)
ATTENTION_BACKWARD = 2.5


def element_bytes(dtype: str) -> int:
    return ELEMENT_BYTES.get(dtype, 4)


def _peak(device: DeviceSpec, dtype: str) -> float:
    device.achievable_flops(dtype)  # raises, naming the known dtypes
    return device.peak_flops[dtype]


def tile_wave_efficiency(m: int, n: int, shape: GPUShape) -> float:
    """Useful share of the SM time a GEMM with an m x n output takes: its tiles over the
    tile slots of the waves it needs (1.0 when tiles fill every wave exactly)."""
    tiles = math.ceil(m / shape.tile_m) * math.ceil(n / shape.tile_n)
    waves = math.ceil(tiles / shape.sm_count)
    return m * n / (waves * shape.sm_count * shape.tile_m * shape.tile_n)


def gemm_s(m: int, n: int, k: int, device: DeviceSpec, dtype: str) -> float:
    """Seconds of one (m x k) @ (k x n) GEMM: waves of tiles at the measured matmul ceiling,
    the bytes it must move at memory bandwidth, or the launch floor, whichever is longest."""
    if min(m, n, k) <= 0:
        return 0.0
    shape = device.shape
    per_sm = _peak(device, dtype) * shape.matmul_fraction / shape.sm_count
    tiles = math.ceil(m / shape.tile_m) * math.ceil(n / shape.tile_n)
    waves = math.ceil(tiles / shape.sm_count)
    compute = waves * 2 * shape.tile_m * shape.tile_n * k / per_sm
    if is_unaligned(m, n, k, dtype):  # no 16-byte-aligned tensor-core kernel fits it
        compute /= shape.unaligned_fraction
    moved = (m * k + k * n + m * n) * element_bytes(dtype)
    memory = moved / (device.memory_bandwidth_bytes_per_s * shape.memory_fraction)
    return max(compute, memory, shape.launch_s)


def is_unaligned(m: int, n: int, k: int, dtype: str) -> bool:
    """A half-precision GEMM whose dims are not all multiples of 8 elements (16 bytes):
    cuBLAS falls back to kernels that load one element at a time (GPT-2's 50,257-word
    vocabulary; padding it to 50,304 is the usual fix)."""
    size = element_bytes(dtype)
    return size < 4 and any(d % (16 // size) for d in (m, n, k))


def gemm_efficiency(m: int, n: int, k: int, device: DeviceSpec, dtype: str) -> float:
    """The GEMM's FLOP rate as a fraction of the device's peak, as this model prices it."""
    return 2 * m * n * k / _peak(device, dtype) / gemm_s(m, n, k, device, dtype)


def linear_s(rows: int, out_features: int, in_features: int, device: DeviceSpec,
             dtype: str) -> float:
    """Forward and both backward GEMMs of a Linear over `rows` rows."""
    m, n, k = rows, out_features, in_features
    return (gemm_s(m, n, k, device, dtype)  # forward: y = x W^T
            + gemm_s(m, k, n, device, dtype)  # input gradient: dx = dy W
            + gemm_s(n, k, m, device, dtype))  # weight gradient: dW = dy^T x


def float8_linear_s(rows: int, out_features: int, in_features: int, device: DeviceSpec,
                    dtype: str, recipe: str = "tensorwise", compiled: bool = True,
                    input_shard: float = 1.0, grad_shard: float = 1.0) -> float:
    """A torchao Float8Linear's three GEMMs at the float8 rate and the casts of its operands,
    forward + backward (strategies.float8; `input_shard`, `grad_shard`: float8.cast_bytes)."""
    if "float8" not in device.peak_flops:
        raise ValueError(f"float8: {device.name} has no float8 tensor cores (its rates: "
                         f"{', '.join(sorted(device.peak_flops))}); use an H100 or newer, "
                         f"or leave float8 off")
    m, n, k = rows, out_features, in_features
    gemms = (gemm_s(m, n, k, device, "float8") + gemm_s(m, k, n, device, "float8")
             + gemm_s(n, k, m, device, "float8")) / float8.gemm_share(recipe)
    kernels = 3 * (2 if compiled else 3)  # amax and cast per operand (eager: abs too)
    casts = memory_bound_s(float8.cast_bytes(m, n, k, recipe, compiled,
                                             input_shard=input_shard, grad_shard=grad_shard),
                           kernels, device, elementwise=True)
    return gemms + casts


def memory_bound_s(moved_bytes: float, kernels: int, device: DeviceSpec,
                   elementwise: bool = False) -> float:
    """Streaming `moved_bytes` at the best copy's bandwidth (eager elementwise kernels: at
    their measured share of it), never under the launch floor of `kernels` kernels."""
    shape = device.shape
    rate = device.memory_bandwidth_bytes_per_s * shape.memory_fraction
    if elementwise:
        rate *= shape.elementwise_fraction
    return max(moved_bytes / rate, kernels * shape.launch_s)


def traffic_s(layer: Layer, fraction: float, device: DeviceSpec, dtype: str,
              split: str = "batch") -> float | None:
    """The layer's memory-bound kernels, forward and backward, as the trace counted them
    under this compute dtype (profiler.traffic: autocast's dtypes, its casts, each kernel):
    the batch's bytes scale with `fraction`, a weight's too where the split shards it;
    None for a layer no trace counted (one built by hand)."""
    moved = layer.attrs.get("traffic", {}).get(dtype)
    if moved is None:
        return None
    nbytes, kernels = bytes_at(moved, fraction, 1.0 if split == "batch" else fraction)
    if not kernels:
        return 0.0
    return memory_bound_s(nbytes, kernels, device, elementwise=True)


def _numel(layer: Layer) -> int:
    itemsize = max(1, layer.output.nbytes // max(1, math.prod(layer.output.shape)))
    return layer.output.nbytes // itemsize


def attention_dims(layer: Layer) -> tuple[int, int, int] | None:
    """(query heads, key/value heads, head dim) of an attention block (a leaf with heads
    and weights); None for any other layer."""
    q_heads, kv_heads = _heads(layer)
    if not (q_heads and layer.param_count and len(layer.output.shape) == 3):
        return None
    hidden = layer.output.shape[-1]
    # bias-free projections hold hidden x head_dim x (2 q_heads + 2 kv_heads) weights
    return q_heads, kv_heads, max(1, round(layer.param_count / (hidden * (2 * q_heads
                                                                          + 2 * kv_heads))))


def _heads(layer: Layer) -> tuple[int, int]:
    a = layer.attrs
    q = a.get("num_attention_heads", a.get("num_heads", a.get("n_head", a.get("heads", 0))))
    return q, a.get("num_key_value_heads", q)


def linear_dims(layer: Layer) -> tuple[int, int] | None:
    """(in, out) features of a Linear-like layer (torch Linear, GPT-2's Conv1D)."""
    a = layer.attrs
    if "in_features" in a and "out_features" in a:
        return a["in_features"], a["out_features"]
    if "nx" in a and "nf" in a:
        return a["nx"], a["nf"]
    return None


def attention_s(layer: Layer, fraction: float, device: DeviceSpec, dtype: str,
                split: str = "batch", levers: Levers = Levers()) -> float:
    """An attention block's projections, its flash attention and the elementwise work
    around them, forward + backward, on `fraction` of its batch (or of its heads); the
    projections in float8 where `levers` ask (strategies.float8)."""
    batch, seq, hidden = layer.output.shape
    q_heads, kv_heads, head_dim = attention_dims(layer)
    rows = max(1, round(batch * seq * fraction))
    projection = linear_s
    if levers.float8:
        projection = partial(float8_linear_s, recipe=levers.float8, compiled=levers.compile)
    projections = (projection(rows, q_heads * head_dim, hidden, device, dtype)
                   + 2 * projection(rows, kv_heads * head_dim, hidden, device, dtype)
                   + projection(rows, hidden, q_heads * head_dim, device, dtype))
    shape = device.shape
    causal_forward = 2 * batch * seq * seq * q_heads * head_dim * fraction  # half of 4·b·s²·h·d
    flash = causal_forward * (1 + ATTENTION_BACKWARD) / (
        _peak(device, dtype) * shape.attention_fraction)
    flash = max(flash, 2 * shape.launch_s)
    glue = traffic_s(layer, fraction, device, dtype, split)
    if glue is None:
        # rotary embedding, transposes and casts: q, k, v and the output read and written
        # about once each way in forward, twice in backward
        qkvo = rows * (2 * q_heads + 2 * kv_heads) * head_dim * element_bytes(dtype)
        glue = memory_bound_s(3 * 2 * qkvo, 12, device)
    return projections + flash + glue


def _input_numel(layer: Layer) -> int:
    """Elements the op reads: each input (a broadcast bias counts small), none taken larger
    than the output, since the traced input shapes are the whole batch's while the output
    may be a shard's or a microbatch's."""
    out = _numel(layer)
    shapes = layer.attrs.get("in_shapes")
    if shapes:
        return sum(min(math.prod(s), out) for s in shapes)
    return out


def layer_s(layer: Layer, fraction: float, split: str, device: DeviceSpec, dtype: str,
            levers: Levers = Levers()) -> float:
    """Forward + backward seconds of `fraction` of `layer`'s work, split by "batch" rows or
    by "out" / "in" features, on a GPU priced by shape; a Linear in float8 where `levers`
    ask (strategies.float8; compile's fusion is in the graph's traffic, strategies.fusion)."""
    if layer.is_input:
        return 0.0
    if layer.kind in VIEW_KINDS:  # no kernel of its own; a second view of a tensor sums
        return traffic_s(layer, fraction, device, dtype, split) or 0.0  # their gradients
    shape = device.shape
    dims = linear_dims(layer)
    if dims is not None and layer.output.shape:
        fin, fout = dims
        rows = max(1, _numel(layer) // max(1, fout))
        if split == "out":
            fout = max(1, round(fout * fraction))
        elif split == "in":
            fin = max(1, round(fin * fraction))
        else:
            rows = max(1, round(rows * fraction))
        # plus what autocast casts for it (its weight, a float32 input) and back
        glue = traffic_s(layer, fraction, device, dtype, split) or 0.0
        if float8.converts(layer, levers, fin, fout):
            # tensorwise TP as torchtitan runs it (float8.tp_gather_bytes): a column-parallel
            # input, a row-parallel output's gradient, cast on the rank's tokens
            # (float8.cast_bytes)
            shard = fraction if levers.float8 == "tensorwise" else 1.0
            return float8_linear_s(rows, fout, fin, device, dtype, levers.float8,
                                   levers.compile,
                                   input_shard=shard if split == "out" else 1.0,
                                   grad_shard=shard if split == "in" else 1.0) + glue
        return linear_s(rows, fout, fin, device, dtype) + glue
    if attention_dims(layer) is not None:
        return attention_s(layer, fraction, device, dtype, split, levers)
    moved = traffic_s(layer, fraction, device, dtype, split)
    flops = (layer.fwd_flops + layer.bwd_flops) * fraction
    if layer.kind in SDPA_KINDS:  # flash attention by its FLOPs, casts around it streamed
        if layer.attrs.get("is_causal"):  # counted whole; the kernel skips half the scores
            flops /= 2
        flash = flops / (_peak(device, dtype) * shape.attention_fraction)
        return max(flash, 2 * shape.launch_s) + (moved or 0.0)
    if moved is not None:  # a matmul's FLOPs (0 for elementwise ops) and its traffic
        return flops / (_peak(device, dtype) * shape.matmul_fraction) + moved
    size = element_bytes(dtype)
    out = _numel(layer) * fraction
    if layer.kind == "Embedding":
        # gather rows forward; backward writes a dense gradient of the whole table (of the
        # rank's rows of it, split by vocabulary)
        moved = 3 * out * size + layer.param_bytes * (fraction if split == "shard" else 1.0)
        return memory_bound_s(moved, 3, device)
    # forward reads the inputs and writes the output; backward reads the output's
    # gradient and the inputs and writes the inputs' gradients
    moved = (3 * _input_numel(layer) * fraction + 2 * out) * size
    compute = flops / (_peak(device, dtype) * shape.matmul_fraction)
    return max(compute, memory_bound_s(moved, 2, device))
