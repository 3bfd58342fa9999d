"""Training precision: the dtype the math runs in, and the dtype each tensor is kept and sent in.

The three precisions practitioners run (Lightning's names), as hyplan's executor runs them:

- "fp32": every tensor float32.
- "bf16-mixed": `torch.autocast(dtype=bfloat16)` around the forward. Matmuls and
  convolutions run at the device's bf16 rate and give bf16 outputs, so the activations
  kept for backward and the ones sent between devices (layout changes, tensor-parallel
  reductions, pipeline sends) are 2 bytes an element. The weights stay fp32 "master"
  copies with fp32 gradients and fp32 optimizer state; autocast keeps a bf16 copy of each
  weight it casts (cached for the forward, saved for backward): 2 more bytes a weight.
  FSDP2 layers use `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)` instead:
  sharded fp32 weights, gradients and state, all-gathered in bf16 (half the bytes), the
  bf16 weights living only while gathered (one layer at a time, not counted, as the
  gathered fp32 weights were not).
- "fp16-mixed": the same with float16, for devices with fp16 but no bf16 arithmetic
  (V100), and a loss scaler, as fp16's 5-bit exponent underflows small gradients.

Gradients are reduced in float32 under every precision (`reduce_dtype`): a sum over P ranks
in bf16 keeps 8 bits of mantissa for a value that grew by up to log2(P) bits, and fp32
gradient reduction is what FSDP2's MixedPrecisionPolicy recommends and torchtitan and
Megatron-LM do by default. The fp32 gradients DDP and FSDP2 hold are therefore sent as they
are, with no cast.

Approximation, stated: every floating activation a layer hands on is priced at the compute
dtype. Under autocast a few ops keep fp32 outputs (softmax, norms that upcast, a residual
add of an fp32 stream and a bf16 branch); their bytes are under-counted by half.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from profiler.graph import ModelGraph, TensorMeta

_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class Precision:
    """One training precision: what runs at which dtype, and its bytes per element."""

    name: str
    compute_dtype: str  # torch dtype name: autocast's dtype and the FLOP rate it runs at
    reduce_dtype: str = "float32"  # gradient reductions (DDP all-reduce, FSDP reduce-scatter)
    loss_scaling: bool = False  # fp16: gradients underflow without a loss scaler
    param_bytes: int = 4  # master weights, per element
    grad_bytes: int = 4
    state_bytes: int = 4  # per optimizer state slot (Adam: 2 slots)

    @property
    def mixed(self) -> bool:
        """The forward runs under autocast (not plain fp32)."""
        return self.compute_dtype != "float32"

    @property
    def activation_bytes(self) -> int:
        """Bytes per element of a floating activation, kept or sent."""
        return _ITEMSIZE[self.compute_dtype]

    def describe(self) -> str:
        """The precision in words, as explain() says it."""
        if not self.mixed:
            return "fp32 throughout"
        short = {"bfloat16": "bf16", "float16": "fp16"}[self.compute_dtype]
        return (f"{self.name}: {short} matmuls and activations under autocast; fp32 weights, "
                f"gradients, optimizer state and gradient reduction"
                + ("; loss scaling" if self.loss_scaling else ""))

    def activation_nbytes(self, tensor: TensorMeta) -> int:
        """Bytes of an fp32-traced activation as the executor keeps it (integers as they are)."""
        if tensor.dtype != "float32":
            return tensor.nbytes
        return tensor.nbytes * self.activation_bytes // 4

    def weight_copy_bytes(self, param_bytes: float) -> float:
        """The low-precision copy autocast keeps of `param_bytes` of fp32 weights (0 in fp32)."""
        return param_bytes * self.activation_bytes / 4 if self.mixed else 0.0

    def gather_bytes(self, param_bytes: float) -> float:
        """Bytes FSDP2 all-gathers for `param_bytes` of fp32 weights (in the param dtype)."""
        return param_bytes * self.activation_bytes / 4

    def reduce_bytes(self, param_bytes: float) -> float:
        """Bytes a gradient reduction of `param_bytes` of fp32 weights sends (reduce dtype)."""
        return param_bytes * _ITEMSIZE[self.reduce_dtype] / 4

    def weights_bytes(self, param_bytes: float, state_factor: int, sharded: bool) -> float:
        """Weights, gradients, optimizer state and (unless FSDP-`sharded`) the autocast copy,
        for `param_bytes` of fp32 weights held on this device."""
        elements = param_bytes / 4
        kept = elements * (self.param_bytes + self.grad_bytes + state_factor * self.state_bytes)
        return kept + (0.0 if sharded else self.weight_copy_bytes(param_bytes))


PRECISIONS: dict[str, Precision] = {
    "bf16-mixed": Precision("bf16-mixed", "bfloat16"),
    "fp16-mixed": Precision("fp16-mixed", "float16", loss_scaling=True),
    "fp32": Precision("fp32", "float32"),
}


def parse_precision(name: str | Precision) -> Precision:
    """The Precision called `name` ("bf16-mixed", "fp16-mixed" or "fp32")."""
    if isinstance(name, Precision):
        return name
    found = PRECISIONS.get(str(name).strip().lower())
    if found is None:
        raise ValueError(f"precision: {name!r} is not one of {', '.join(PRECISIONS)}")
    return found


def default_precision(device) -> Precision:
    """What a practitioner trains in on `device` (a strategies.DeviceSpec): bf16-mixed where
    it has bf16 arithmetic (A100, H100), fp16-mixed where fp16 runs faster than fp32 but bf16
    does not exist (V100's tensor cores), else fp32 (K20, K80, and CPUs unless asked)."""
    if device.kind == "cpu":
        return PRECISIONS["fp32"]
    rates = device.peak_flops
    if "bfloat16" in rates:
        return PRECISIONS["bf16-mixed"]
    if rates.get("float16", 0.0) > rates.get("float32", 0.0):
        return PRECISIONS["fp16-mixed"]
    return PRECISIONS["fp32"]


def check_supported(precision: Precision, device) -> None:
    """Refuse a precision whose compute dtype the device has no rate for."""
    if precision.compute_dtype not in device.peak_flops:
        usable = [p.name for p in PRECISIONS.values() if p.compute_dtype in device.peak_flops]
        raise ValueError(
            f"precision: {precision.name} computes in {precision.compute_dtype}, which "
            f"{device.name} has no arithmetic for (its rates: {', '.join(sorted(device.peak_flops))}); "
            f"use {' or '.join(usable)}")


def at_precision(graph: ModelGraph, precision: Precision) -> ModelGraph:
    """The graph with each layer's output sized as `precision` keeps it: what its memory,
    layout changes, reductions and pipeline sends are priced on. Model inputs stay as the
    user passes them (autocast casts them at the first matmul)."""
    if not precision.mixed:
        return graph
    layers = tuple(layer if layer.is_input else replace(
        layer, output=replace(layer.output, nbytes=precision.activation_nbytes(layer.output),
                              dtype=precision.compute_dtype if layer.output.dtype == "float32"
                              else layer.output.dtype))
        for layer in graph.layers)
    return replace(graph, layers=layers)
