"""The bytes each layer's memory-bound kernels move, and how many kernels it launches, in a
training step under each precision.

On a GPU the GEMMs and flash attention are priced by their FLOPs (strategies.gpu_compute);
everything else streams memory: norms, activations, residual adds, rotary embeddings, and
the casts autocast inserts. What those move depends on the dtype each tensor has *under
autocast*, not the float32 the model was traced in: a Linear's output is bf16, a residual
stream that began as a float32 embedding stays float32, an RMSNorm that upcasts runs in
float32, and every float32 weight or activation a GEMM reads is first cast to bf16. On an
H100, a 953 M-parameter Llama's bf16-mixed step spent 91 of 194 ms in such kernels, which
a count at the compute dtype's element size (two kernels a layer) priced at 12 ms.

`step` simulates autocast's dtype rules for one ATen op (torch.amp's op lists: ops that run
in the low-precision dtype, ops that run in float32, the rest promote; an explicit
`.to(dtype)` is what it says) and counts the forward bytes read and written by kernels that
are not GEMMs or attention (a GEMM's own reads are in its FLOP price; only the casts of its
inputs count here), and the backward's: each input needing a gradient reads the output's
gradient, reads what the op saved and writes its own gradient, cast back where its dtype
differs (a same-shape add passes the gradient through, no kernel); a tensor read by several
ops has their gradients summed. Views move nothing. `traffic` walks an exported ATen graph
with it (profiler.export_trace); `Recorder` and `replay` do the same for the ATen ops each
torch.fx node runs on meta tensors (profiler.profile), so both tracers price alike.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# autocast's lower-precision ops (CUDA and CPU lists, torch.amp docs "Autocast Op
# Reference"): they run in bf16/fp16 and their floating inputs are cast to it; their own
# kernels (GEMMs, convolutions, attention) are priced by FLOPs elsewhere
LOW_PRECISION = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "mv", "addmv", "addr",
    "einsum", "conv1d", "conv2d", "conv3d", "convolution", "_convolution", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d", "conv_transpose3d", "prelu", "linalg_vecdot",
    "chain_matmul", "linalg_multi_dot", "scaled_dot_product_attention",
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
}
# fused on a GPU, but decomposed into their math on meta tensors (what a Recorder sees)
OPAQUE = {"scaled_dot_product_attention"}
# autocast's float32 ops (CUDA list): inputs cast up to float32, output float32
FLOAT32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow", "softplus", "layer_norm", "native_layer_norm",
    "group_norm", "native_group_norm", "norm", "frobenius_norm", "nuclear_norm",
    "cosine_similarity", "nll_loss", "nll_loss2d", "kl_div", "l1_loss", "smooth_l1_loss",
    "huber_loss", "mse_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist",
    "renorm", "logsumexp", "prod", "cumprod", "cumsum", "sum", "softmax", "_softmax",
    "log_softmax", "_log_softmax", "cross_entropy", "cross_entropy_loss",
}
# ops whose gradient is the output's gradient as it is (no kernel when shapes match)
PASS_THROUGH = {"add", "sub", "clone", "contiguous", "reshape", "flatten", "cat",
                "slice_scatter", "_unsafe_view", "alias", "copy"}
# reductions: backward writes the input's gradient from the (small) output's, one kernel
REDUCTIONS = {"mean", "sum", "amax", "amin", "max", "min", "var", "std", "var_mean",
              "logsumexp", "norm", "all", "any"}
CASTS = {"to", "_to_copy", "type_as"}
# ops that copy only when their input is not laid out contiguously (a transposed head
# layout before the output projection), else return a view
COPY_IF_STRIDED = {"contiguous", "reshape", "flatten"}
# a kernel-free op (shape bookkeeping) that torch does not mark as a view
NO_KERNEL = {"_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride", "getitem",
             "_assert_scalar", "lift_fresh_copy", "detach", "zeros_like", "empty_like"}
LOW_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}
# the precisions a trace counts; float16 moves what bfloat16 does (the same element size)
COUNTED = ("float32", "bfloat16")


def with_float16(per_precision: dict) -> dict:
    """A layer's traffic attr: {precision: Traffic.as_attr()} of the counted precisions,
    float16 read as bfloat16."""
    return {**per_precision, "float16": per_precision["bfloat16"]}


@dataclass(frozen=True)
class Traffic:
    """Bytes moved and kernels launched by one node (or a layer's nodes, summed). Bytes of
    the batch's tensors scale with the rows a rank runs (`*_rows`); the rest (weights and
    their casts, a rotary table) do not (`*_fixed`)."""

    forward_rows: float = 0.0
    forward_fixed: float = 0.0
    backward_rows: float = 0.0
    backward_fixed: float = 0.0
    forward_kernels: int = 0
    backward_kernels: int = 0

    def __add__(self, other: "Traffic") -> "Traffic":
        return Traffic(*(a + b for a, b in zip(self.as_attr(), other.as_attr())))

    def as_attr(self) -> tuple:
        return (self.forward_rows, self.forward_fixed, self.backward_rows,
                self.backward_fixed, self.forward_kernels, self.backward_kernels)


def bytes_at(moved: tuple, rows_fraction: float, fixed_fraction: float) -> tuple[float, int]:
    """(bytes, kernels) of a layer's traffic attr for a rank that runs `rows_fraction` of
    the traced rows and holds `fixed_fraction` of its weights."""
    fr, ff, br, bf, kf, kb = moved
    return (fr + br) * rows_fraction + (ff + bf) * fixed_fraction, kf + kb


def scaled_rows(moved: tuple, f: float) -> tuple:
    """The traffic attr of the layer on `f` of its traced rows (planner.search's microbatch)."""
    fr, ff, br, bf, kf, kb = moved
    return (fr * f, ff, br * f, bf, kf, kb)


def op_name(target) -> str:
    """'linear' for aten.linear.default (an fx node's target or a dispatched op)."""
    target = getattr(target, "target", target)
    packet = getattr(target, "_overloadpacket", None)
    return getattr(packet, "__name__", None) or getattr(target, "__name__", str(target))


@dataclass(frozen=True)
class Seen:
    """What the simulation knows of one tensor: its shape (a meta or fake tensor), the
    dtype it has under autocast, whether it needs a gradient and whether it is the
    batch's (scales with the rows a rank runs)."""

    value: torch.Tensor
    dtype: torch.dtype
    grad: bool = False
    batched: bool = False

    @property
    def nbytes(self) -> float:
        return float(self.value.numel()) * self.dtype.itemsize


def constant(value: torch.Tensor, batch: int, rows: Collection[int] = ()) -> Seen:
    """A tensor the graph made itself (a mask, a range): its own dtype, the batch's where
    its leading dim is the batch, or (`rows`) that of a tensor of the batch's the same
    node holds: a mixture of experts' buffers over its tokens or (token, expert) pairs,
    which grow with the rows as they do, not fixed as a weight is."""
    return Seen(value, value.dtype, False, _leads_rows(value, batch, rows))


def _leads_rows(value: torch.Tensor, batch: int, rows: Collection[int]) -> bool:
    return value.dim() > 0 and (value.shape[0] == batch or value.shape[0] in rows)


def _promote(dtypes: list[torch.dtype], fallback: torch.dtype) -> torch.dtype:
    floating = [d for d in dtypes if d.is_floating_point]
    if not floating:
        return fallback
    widest = floating[0]
    for d in floating[1:]:
        widest = torch.promote_types(widest, d)
    return widest


def cast_target(args, kwargs) -> torch.dtype | None:
    """The dtype a `.to(...)` / `_to_copy` asks for, if any."""
    wanted = (kwargs or {}).get("dtype")
    return wanted or next((a for a in args[1:] if isinstance(a, torch.dtype)), None)


def step(name: str, is_view: bool, wanted: torch.dtype | None, value: torch.Tensor,
         inputs: list[Seen], low: torch.dtype | None, batch: int,
         rows: Collection[int] = ()) -> tuple[Traffic, Seen]:
    """One op under autocast to `low` (None: no autocast): what its kernels move and the
    record of its output (the batch's as `constant` says, `rows` the leading dims of the
    node's tensors of the batch)."""
    grad = any(i.grad for i in inputs)
    batched = any(i.batched for i in inputs) or (
        not grad and _leads_rows(value, batch, rows))
    in_dtypes = [i.dtype for i in inputs]
    # the dimensioned inputs decide promotion (a 0-dim tensor counts as a scalar)
    shaped = [i.dtype for i in inputs if i.value.dim() > 0] or in_dtypes
    traced = value.dtype
    if not traced.is_floating_point:
        mine = traced
    elif name in CASTS:
        mine = wanted or (in_dtypes[0] if in_dtypes else traced)
    elif low is not None and name in LOW_PRECISION:
        mine = low
    elif low is not None and name in FLOAT32:
        mine = torch.float32
    else:
        mine = _promote(shaped, traced) if shaped else traced
    out = Seen(value, mine, grad and mine.is_floating_point, batched)
    if name in CASTS:  # a real cast where the dtype changes, else a view
        is_view = not in_dtypes or in_dtypes[0] == mine
    elif name in COPY_IF_STRIDED and inputs:
        is_view = inputs[0].value.is_contiguous()
    if name in NO_KERNEL or is_view:
        return Traffic(), out
    return _moved(name, out, inputs, low), out


def _split(pairs) -> tuple[float, float]:
    """(bytes of the batch's tensors, bytes of the rest) of (batched, bytes) pairs."""
    rows = sum(b for batched, b in pairs if batched)
    return rows, sum(b for _, b in pairs) - rows


def _moved(name: str, out: Seen, inputs: list[Seen], low) -> Traffic:
    if name in LOW_PRECISION or (low is not None and name in FLOAT32):
        target = low if name in LOW_PRECISION else torch.float32
        forward, backward = [], []
        kernels = back = 0
        for i in inputs:  # autocast casts each floating input not yet in its dtype
            if target is not None and i.dtype.is_floating_point and i.dtype != target:
                moved = i.nbytes + i.value.numel() * target.itemsize
                forward.append((i.batched, moved))
                kernels += 1
                if i.grad:  # the cast's backward casts the gradient back
                    backward.append((i.batched, moved))
                    back += 1
        casts = Traffic(*_split(forward), *_split(backward), kernels, back)
        if name in LOW_PRECISION:
            return casts
        # a float32-list op (a norm, a softmax) streams in float32 after its casts
        up = [Seen(i.value, torch.float32, i.grad, i.batched)
              if i.dtype.is_floating_point else i for i in inputs]
        return _elementwise(name, out, up) + casts
    if name == "embedding":  # a gather: reads the rows it writes, not the whole table
        table, ids = inputs[0], inputs[1]
        rows = out.nbytes
        backward = [(False, table.nbytes), (out.batched, 2 * rows)] if table.grad else []
        # backward: a dense gradient, the table zeroed and the rows added into it
        return Traffic(*_split([(out.batched, 2 * rows), (ids.batched, ids.nbytes)]),
                       *_split(backward), 1, 2 if table.grad else 0)
    return _elementwise(name, out, inputs)


def _elementwise(name: str, out: Seen, inputs: list[Seen]) -> Traffic:
    """A memory-bound op: forward reads its inputs and writes its output; backward, per
    input needing a gradient, reads the output's gradient and what was saved and writes
    the input's gradient (passed through without a kernel by a same-shape add)."""
    written = (out.batched, out.nbytes)
    reads = [(i.batched, i.nbytes) for i in inputs]
    backward, back = [], 0
    saved = reads if name not in PASS_THROUGH and name not in REDUCTIONS else []
    for i, read in zip(inputs, reads):
        if not i.grad:
            continue
        if i.dtype != out.dtype:  # the gradient is cast back to the input's dtype
            backward.append((i.batched, i.value.numel() * (out.dtype.itemsize
                                                           + i.dtype.itemsize)))
            back += 1
        if name in PASS_THROUGH and tuple(i.value.shape) == tuple(out.value.shape):
            continue  # the gradient flows on as it is
        backward += [written, *saved, read]
        back += 1
    return Traffic(*_split(reads + [written]), *_split(backward), 1, back)


# --- an exported ATen graph (profiler.export_trace) ------------------------------------------

def _tensor(node) -> torch.Tensor | None:
    value = node.meta.get("val") if isinstance(node, fx.Node) else None
    return value if isinstance(value, torch.Tensor) else None


def traffic(program: torch.export.ExportedProgram, precision: str,
            batch: int) -> dict[str, Traffic]:
    """{node name: its Traffic} for every op of the exported graph under `precision`'s
    compute dtype ("float32": no autocast; "bfloat16" / "float16": autocast to it), the
    batch's tensors (computed from the user's inputs, or made in the batch's shape, as an
    attention mask is) apart from the rest (weights, their casts, tables of constants)."""
    low = LOW_DTYPES.get(precision)
    signature = program.graph_signature
    params, users = set(signature.inputs_to_parameters), set(signature.user_inputs)
    seen: dict[str, Seen] = {}
    out: dict[str, Traffic] = {}
    # leading dims of the batch's tensors met so far (rows, tokens, a mixture of experts'
    # (token, expert) pairs): a tensor made in one of them is the batch's (`constant`)
    rows: set[int] = set()
    tuples: dict[str, tuple[bool, bool]] = {}  # a tuple op's (needs a gradient, batch's)
    for node in program.graph_module.graph.nodes:
        value = _tensor(node)
        if node.op == "placeholder":
            if value is not None:
                seen[node.name] = Seen(value, value.dtype,
                                       node.name in params and value.dtype.is_floating_point,
                                       node.name in users)
                _note_rows(rows, seen[node.name])
            continue
        if node.op != "call_function":
            continue
        if value is None:  # a tuple (sort, topk, split): its items are read by getitem
            ins = [seen[n.name] for n in node.all_input_nodes if n.name in seen]
            tuples[node.name] = (any(i.grad for i in ins), any(i.batched for i in ins))
            continue
        inputs = [seen.get(n.name) or constant(_tensor(n), batch, rows)
                  for n in node.all_input_nodes if _tensor(n) is not None]
        # an item of a tuple is the batch's where the tuple's inputs are (a sort of the
        # routed pairs: its order, and all that it indexes, scale with the rows)
        inputs += [Seen(value, value.dtype, *tuples[n.name])
                   for n in node.all_input_nodes if n.name in tuples]
        moved, seen[node.name] = step(
            op_name(node), bool(getattr(node.target, "is_view", False)),
            cast_target(node.args, node.kwargs), value, inputs, low, batch, rows)
        _note_rows(rows, seen[node.name])
        out[node.name] = moved
    # gradients summed where a tensor fans out: each reader after the first adds its own
    # (paid by the reader, so a block's price does not depend on what follows the block)
    first: dict[str, str] = {}
    for node in program.graph_module.graph.nodes:
        if node.op != "call_function" or node.name not in out:
            continue
        for src in dict.fromkeys(node.all_input_nodes):
            record = seen.get(src.name)
            if record is None:
                continue
            if src.name in first:
                out[node.name] = out[node.name] + accumulation(record, 2)
            else:
                first[src.name] = node.name
    return out


def _note_rows(rows: set[int], record: Seen) -> None:
    if record.batched and record.value.dim() > 0:
        rows.add(record.value.shape[0])


def accumulation(record: Seen, readers: int) -> Traffic:
    """Backward sums the gradients of a tensor read by several ops: one add per reader
    after the first, reading two gradients and writing one."""
    if not record.grad or readers < 2:
        return Traffic()
    moved = (readers - 1) * 3 * record.nbytes
    return Traffic(0.0, 0.0, *((moved, 0.0) if record.batched else (0.0, moved)), 0,
                   readers - 1)


def layer_traffic(per_node: dict[str, Traffic], nodes) -> Traffic:
    total = Traffic()
    for n in nodes:
        total = total + per_node.get(n.name, Traffic())
    return total


# --- a torch.fx graph (profiler.profile.count_flops runs each node on meta tensors) -------------

class Recorder(TorchDispatchMode):
    """Records the ATen ops one fx node runs: (name, is a view, cast target, its output
    tensors, its input tensors), for `replay` to price under each precision."""

    def __init__(self):
        super().__init__()
        self.ops: list[tuple] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        result = func(*args, **(kwargs or {}))
        ins = [a for a in pytree.tree_leaves((args, kwargs or {})) if isinstance(a, torch.Tensor)]
        outs = [o for o in pytree.tree_leaves(result) if isinstance(o, torch.Tensor)]
        self.ops.append((op_name(func), bool(getattr(func, "is_view", False)),
                         cast_target(args, kwargs), outs, ins))
        return result


def replay(ops: list[tuple], known: dict[int, Seen], low, batch: int) -> Traffic:
    """The Traffic of recorded ops, given what is known of their inputs (by tensor id; the
    rest are the node's own constants). `known` gains each output's record. A constant
    or output with as many leading rows as a tensor of the batch's the node has met
    (`rows`: its tokens, a mixture of experts' (token, expert) pairs) is the batch's too."""
    total = Traffic()
    readers: dict[int, int] = {}
    rows = {t.shape[0] for _, _, _, _, ins in ops for t in ins
            if t.dim() > 0 and getattr(known.get(id(t)), "batched", False)}
    for name, is_view, wanted, outs, ins in ops:
        inputs = [known.get(id(t)) or constant(t, batch, rows) for t in ins]
        for t in ins:
            readers[id(t)] = readers.get(id(t), 0) + 1
        for i, value in enumerate(outs):
            moved, record = step(name, is_view, wanted, value, inputs, low, batch, rows)
            known[id(value)] = record
            _note_rows(rows, record)
            if i == 0:  # one kernel writes all its outputs (split's views: none)
                total = total + moved
    for key, count in readers.items():  # gradients summed inside the node
        if key in known:
            total = total + accumulation(known[key], count)
    return total
