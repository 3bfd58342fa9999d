"""float8 matmuls priced: torchao's tensorwise and rowwise training recipes on FP8 tensor cores.

torchao's `Float8Linear` runs a Linear's three GEMMs (forward, input gradient, weight
gradient) on float8 operands with bf16 outputs, through `torch._scaled_mm`. Each operand
is scaled into float8's range first: its absolute maximum is reduced (over the whole
tensor for "tensorwise", over each row for "rowwise"), then it is cast, once in each
orientation a GEMM needs (`_scaled_mm` takes its first operand row-major and its second
column-major, and the weight gradient reads the input and the output gradient
transposed). So a float8 Linear costs:

- its GEMMs at the float8 rate (H100: 1979 TFLOP/s dense, twice bf16's), tiles and waves
  as a bf16 GEMM, at the same measured share of peak (strategies.gpu_compute's
  `float8_linear_s` prices a Float8Linear with the facts here);
  rowwise at `ROWWISE_GEMM_SHARE` of that (its scales are applied in the kernel's
  epilogue, CUTLASS's rowwise kernel);
- the casts as memory traffic: per operand element, an amax pass (read 2 bytes) and a
  cast writing both orientations (read 2, write 1 + 1): `CAST_BYTES_PER_ELEMENT`; eager,
  the absolute value is its own kernel too (`EAGER_CAST_BYTES_PER_ELEMENT`); the input,
  the weight and the output gradient each once per step; under tensorwise TP, a
  column-parallel input and a row-parallel output's gradient on the rank's sequence
  shard before their float8 all-gather, the gathered tensor then transposed
  (`cast_bytes`' `input_shard`, `grad_shard`);
- tensorwise with FSDP: the weight is cast on its shard before the all-gather, which
  then sends 1 byte an element, half of bf16's (torchtitan's `enable_fsdp_float8_all_gather`;
  `Float8Gather`); rowwise gathers bf16 and casts the whole weight.

- tensorwise with TP: the all-gathers into a converted Linear send float8 (torchao's
  `Float8ColwiseParallel`, `Float8RowwiseParallel` and `PrepareFloat8ModuleInput`, which
  torchtitan's `apply_tp` uses for every transformer block when the recipe is tensorwise:
  the input is cast before its Shard -> Replicate redistribute, and a row-parallel
  output's gradient is cast to e5m2 before the backward all-gather); the reduce-scatters
  of matmul outputs and of input gradients stay bf16. Rowwise: every TP collective in
  bf16 ("For now, float8 all-gather with TP is only supported for tensorwise float8
  scaling recipes", torchtitan's parallelize_llama.py at 820504e, the commit of its async
  TP table; its float8.md: "for float8 with rowwise scaling, all distributed
  communication is done in high precision"). `tp_gather_bytes`.

torchtitan converts every Linear but the output projection (`filter_fqns = ["output"]`),
and only those whose dims are multiples of 16 (`_scaled_mm`'s requirement).
Figures and sources: strategies.devices (FLOAT8_*).
"""

from __future__ import annotations

from dataclasses import dataclass

from strategies.devices import (FLOAT8_CAST_BYTES, FLOAT8_EAGER_CAST_BYTES,
                                FLOAT8_ROWWISE_GEMM_SHARE)
from strategies.kernel_levers import Levers
from strategies.precision import Precision

# the module names torchtitan leaves in bf16 (its float8 converter's default filter; the
# output projection is "output" in torchtitan's Llama and "lm_head" in Hugging Face's)
NOT_CONVERTED = ("output", "lm_head")
# torch._scaled_mm needs every dim a multiple of 16
ALIGN = 16


def converts(layer, levers: Levers, in_features: int, out_features: int) -> bool:
    """Does torchtitan's float8 converter swap this Linear for a Float8Linear?"""
    if not levers.float8:
        return False
    last = layer.name.rsplit(".", 1)[-1]
    return last not in NOT_CONVERTED and in_features % ALIGN == 0 and out_features % ALIGN == 0


def gemm_share(recipe: str) -> float:
    """A float8 GEMM's rate as a share of a bf16-like GEMM's at the float8 peak."""
    return FLOAT8_ROWWISE_GEMM_SHARE if recipe == "rowwise" else 1.0


def cast_bytes(rows: int, out_features: int, in_features: int, recipe: str,
               compiled: bool, weight_fraction: float = 1.0, input_shard: float = 1.0,
               grad_shard: float = 1.0) -> float:
    """Bytes the scaling and casting of one Float8Linear's operands move in a step: the
    input (rows x in), the output gradient (rows x out) and the weight (out x in; where
    tensorwise casts it on an FSDP shard, `weight_fraction` of it, then transposes the
    gathered float8 weight: read 1, write 1 an element). `input_shard`, `grad_shard`:
    under tensorwise with sequence-parallel TP, the share of the rows on which the input
    (column-parallel) or the output gradient (row-parallel) is cast before its float8
    all-gather (`_shard_cast_bytes`)."""
    per = FLOAT8_CAST_BYTES if compiled else FLOAT8_EAGER_CAST_BYTES
    weight = out_features * in_features
    if recipe != "tensorwise":
        return per * (rows * (in_features + out_features) + weight)
    moved = (_shard_cast_bytes(rows * in_features, input_shard, per)
             + _shard_cast_bytes(rows * out_features, grad_shard, per))
    return moved + per * weight * weight_fraction + 2 * weight * (weight_fraction < 1)


def _shard_cast_bytes(elements: int, shard: float, per: float) -> float:
    """An operand of `elements` cast whole (`per` bytes an element: both orientations), or
    on its sequence shard before a float8 all-gather: torchao's PrepareFloat8ModuleInput
    and Float8ColwiseParallel cast a column-parallel input on its Shard(1) tokens ("we
    perform fp8 allgather only once"), Float8RowwiseParallel's NoopFwToFloat8BwDynamic
    casts the output gradient on its Shard(1) tokens (torchao float8_tensor_parallel.py,
    which torchtitan's apply_tp uses under tensorwise): amax and one orientation on the
    shard (`per` less the second orientation's byte), then the gathered float8 tensor
    transposed for the other GEMM (read 1, write 1 an element)."""
    if shard >= 1:
        return per * elements
    return (per - 1) * elements * shard + 2 * elements


@dataclass(frozen=True)
class Float8Gather(Precision):
    """A precision whose FSDP all-gathers send float8 weights (1 byte an element): torchao
    tensorwise with `enable_fsdp_float8_all_gather`. Every gathered weight is priced so,
    the embedding and the output projection (bf16 in torchtitan, ~13% of Llama 3 8B's
    weights) included: an over-discount of their gathers, stated."""

    def gather_bytes(self, param_bytes: float) -> float:
        return param_bytes / 4


def tp_gather_bytes(nbytes: float, converted: bool, levers: Levers) -> float:
    """Bytes a TP all-gather of a bf16 activation (or its gradient) of `nbytes` sends
    into a Linear that torchtitan converted (`converted`): 1 byte an element under the
    tensorwise recipe (half of bf16's 2), else as it is."""
    return nbytes / 2 if converted and levers.float8 == "tensorwise" else nbytes


def gathering(precision: Precision, levers: Levers) -> Precision:
    """`precision`, with float8 all-gathers where the tensorwise recipe is on."""
    if levers.float8 != "tensorwise" or not precision.mixed:
        return precision
    fields = {f: getattr(precision, f) for f in precision.__dataclass_fields__}
    return Float8Gather(**fields)
