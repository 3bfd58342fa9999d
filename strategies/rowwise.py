"""Which parameter-free ops keep the batch in dim 0 and never mix rows, so that splitting
the batch by rows across devices gives each device exactly its rows of the output.

The same names serve both tracers: an fx function or tensor method (`transpose`,
`scaled_dot_product_attention`) and an ATen op from torch.export (`aten.transpose.int` is
`transpose`). Ops that take a dimension are row-wise only when that dimension is not 0;
the profiler records the op's integer arguments in `Layer.attrs` ("int_args", "dim") and
the shape of its first input ("in_shape"), and `keeps_rows` reads them here.

A user with an op of their own that is row-wise calls `register_rowwise("my_op")`.
"""

from __future__ import annotations

from profiler.graph import Layer, rows_in_dim0
from profiler.row_factors import TILES, VIEWS

# element-wise: every output element depends on the same element of each input
ELEMENTWISE = {
    "relu", "relu_", "gelu", "silu", "tanh", "sigmoid", "dropout", "contiguous", "clone",
    "leaky_relu", "hardswish", "neg", "exp", "log", "sqrt", "rsqrt", "pow", "abs", "erf",
    "add", "add_", "sub", "mul", "mul_", "truediv", "div", "where", "to", "type_as",
    "float", "half", "bfloat16", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge",
    "__and__", "__or__", "and_", "or_", "logical_and", "logical_or", "logical_not",
    "native_dropout", "alias", "detach", "_to_copy", "iadd", "getitem_tuple", "bitwise_and",
    "bitwise_or", "bitwise_not", "cos", "sin", "reciprocal", "square", "clamp", "scalar_tensor",
    "_assert_tensor_metadata", "lift_fresh_copy", "fill", "zeros_like", "ones_like",
    "full_like", "new_ones", "new_zeros",
    # factories sized from a batch tensor's shape: each rank makes its own rows
    "arange", "zeros", "ones", "full", "empty", "new_full", "new_empty",
    # mixture-of-experts routing between modules: in-place arithmetic on the scores
    # (DeepSeek-V3's `topk_weights /= denominator`), a write into a slice of a tensor
    # holding the same rows (its attention's `q[..., nope:] = q_pe`), integer division of
    # positions (Llama 4's chunked attention), an expert index's one-hot row
    "copy_", "div_", "sub_", "floor_divide", "remainder", "masked_fill_", "clamp_",
    "fill_", "zero_", "one_hot", "empty_like", "floor", "ceil", "round", "sign",
}
# row-local: each output row depends on the same input row only, along dims other than 0
# (the views, profiler.row_factors.VIEWS, among them)
ROW_LOCAL = VIEWS | {
    "expand", "expand_as", "unsqueeze", "squeeze", "layer_norm", "rms_norm", "group_norm", "linear", "conv1d", "conv2d",
    "embedding", "scaled_dot_product_attention", "matmul", "bmm", "baddbmm", "mm",
    "addmm", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "cat", "stack",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention",
    "split", "split_with_sizes", "chunk", "unbind", "getitem", "slice", "select", "narrow",
    "index_select", "softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "diff",
    "sum", "mean", "amax", "amin", "var", "transpose", "swapaxes", "permute", "t",
    "gather", "index", "triu", "tril", "repeat_interleave", "roll", "flip",
    "linalg_vector_norm", "norm", "pad", "constant_pad_nd",
    # resizing a map's height and width (MobileViT's patches)
    "interpolate", "upsample_bilinear2d", "upsample_nearest2d", "upsample_bicubic2d",
    # a rotary embedding's complex view adds or drops a last dim of two (Llama 4)
    "view_as_complex", "view_as_real",
    # routing: the top-k experts of each token along its scores, and writes into a
    # token's own scores (DeepSeek-V3's group mask, `group_mask.scatter_(1, group_idx, 1)`)
    "topk", "sort", "argsort", "argmax", "argmin", "scatter", "scatter_", "scatter_add",
    "scatter_add_", "logsumexp", "prod", "any", "all",
}
_BROADCASTS = {"getitem", "cat", "stack", "where", "expand", "expand_as"}
# ops whose `dim` argument must not be 0 (the batch); the others above are checked on shape
_DIM_ARG = {
    "split", "split_with_sizes", "chunk", "unbind", "select", "narrow", "index_select",
    "softmax", "log_softmax", "_softmax", "_log_softmax", "cumsum", "diff", "sum", "mean",
    "amax", "amin", "var", "cat", "stack", "gather", "roll", "flip", "slice",
    "linalg_vector_norm", "norm", "topk", "sort", "argsort", "argmax", "argmin", "scatter",
    "scatter_", "scatter_add", "scatter_add_", "logsumexp", "prod", "any", "all",
}
# where each op's dim arguments sit (positional index, default when left out)
_DIM_POSITIONS = {
    "transpose": ((1, None), (2, None)), "swapaxes": ((1, None), (2, None)),
    "split": ((2, 0),), "split_with_sizes": ((2, 0),), "chunk": ((2, 0),),
    "unbind": ((1, 0),), "select": ((1, None),), "narrow": ((1, None),),
    "index_select": ((1, None),), "softmax": ((1, None),), "log_softmax": ((1, None),),
    "_softmax": ((1, None),), "_log_softmax": ((1, None),), "cumsum": ((1, None),),
    "diff": ((2, -1),), "sum": ((1, None),), "mean": ((1, None),), "amax": ((1, None),),
    "amin": ((1, None),), "var": ((1, None),), "cat": ((1, 0),), "stack": ((1, 0),),
    "gather": ((1, None),), "roll": ((2, None),), "flip": ((1, None),), "slice": ((1, 0),),
    "linalg_vector_norm": ((2, None),), "norm": ((2, None),),
    "topk": ((2, -1),), "sort": ((1, -1),), "argsort": ((1, -1),), "argmax": ((1, None),),
    "argmin": ((1, None),), "scatter": ((1, None),), "scatter_": ((1, None),),
    "scatter_add": ((1, None),), "scatter_add_": ((1, None),), "logsumexp": ((1, None),),
    "prod": ((1, None),), "any": ((1, None),), "all": ((1, None),),
}
# F.pad's amounts come in pairs from the last dim backwards (MobileNetV2's and Swin's pads
# of height and width): it keeps the rows unless a pair reaches dim 0 and is not zero
_PADS = {"pad", "constant_pad_nd"}
_EXTRA: set[str] = set()


def _dims(kind: str, attrs: dict) -> list[int]:
    """The dims an op works along, read from the integer arguments the profiler kept."""
    args, kwargs = attrs.get("int_args", ()), attrs.get("int_kwargs", {})
    if kind == "permute":
        first = args[1] if len(args) > 1 else kwargs.get("dims")
        return list(first) if isinstance(first, tuple) else list(a for a in args[1:] if isinstance(a, int))
    out = []
    for (position, default), key in zip(_DIM_POSITIONS.get(kind, ()), ("dim", "dim1")):
        value = args[position] if position < len(args) else kwargs.get(key, kwargs.get("dim0", default))
        if isinstance(value, tuple):
            out.extend(value)
        elif isinstance(value, int):
            out.append(value)
    return out


def register_rowwise(*names: str) -> None:
    """Declare fx function / ATen op names as row-wise (their batch rows stay independent)."""
    _EXTRA.update(names)


def keeps_rows(layer: Layer, batch: int) -> bool:
    """True when `layer`, a parameter-free op, maps each batch row to the same output row
    (its entries, where dim 0 holds the rows merged with the dims after it:
    profiler.graph.TensorMeta.row_factor)."""
    kind = layer.kind
    shape = layer.output.shape
    if not layer.output.has_rows(batch):
        return False
    if kind in ELEMENTWISE or kind in _EXTRA:
        return True
    attrs = layer.attrs
    in_shape = attrs.get("in_shape")
    in_factor = (attrs.get("in_row_factors") or (None,))[0]
    out_factor = layer.output.row_factor
    if in_shape is not None and not rows_in_dim0(in_shape, batch, in_factor):
        # rows made from a tensor without them: broadcast, or tiled by the batch's size
        # where the tracer knows dim 0 is the rows (BLOOM's `alibi.repeat(batch, 1, 1)`)
        return kind in _BROADCASTS or (in_factor == 0 and kind in TILES)
    if kind not in ROW_LOCAL:
        return False
    if kind in VIEWS and out_factor is not None and in_factor is not None:
        return True  # both carry rows: a view merges them with the next dims, or splits
    if out_factor is not None and in_factor is not None and out_factor != in_factor:
        return False  # dim 0 changed its make-up otherwise: not the same rows
    ndim = len(in_shape) if in_shape else len(shape)
    dims = [d % ndim if ndim else d for d in _dims(kind, attrs)]
    if kind in ("transpose", "swapaxes"):
        return 0 not in dims
    if kind == "permute":
        return bool(dims) and dims[0] == 0
    if kind == "t":
        return False
    if kind in _DIM_ARG:
        return bool(dims) and 0 not in dims
    if kind == "getitem":
        return attrs.get("index_keeps_rows", True)
    if kind in _PADS:
        args = attrs.get("int_args", ())
        pads = args[1] if len(args) > 1 else attrs.get("int_kwargs", {}).get("pad")
        return isinstance(pads, tuple) and (len(pads) < 2 * ndim or not any(pads[-2:]))
    return True


_BINARY = {"add", "sub", "mul", "truediv", "div", "where", "add_", "mul_", "iadd"}


def featurewise_binary(layer: Layer) -> bool:
    """An element-wise op on inputs all of the output's shape (Llama's gate * up): it can
    follow feature-split inputs, each rank multiplying its own features. The rows are
    left out of the comparison: the 3-D search scales the output to a microbatch's rows
    (planner.search._scaled), not the recorded input shapes."""
    shapes = layer.attrs.get("in_shapes", ())
    out = tuple(layer.output.shape)
    return (layer.kind in _BINARY and len(shapes) >= 2 and len(set(shapes)) == 1
            and len(shapes[0]) == len(out) > 0 and tuple(shapes[0][1:]) == out[1:])
