"""Trace a model with torch.fx into a ModelGraph: layers, shapes and parameter sizes.

Shapes come from running the traced graph on meta tensors, so nothing of the batch (or of a
model built on the meta device) is allocated. torch.nn's own modules stay whole (fx's
default leaves); a user's module that fx cannot follow can be named a leaf too.
"""

from __future__ import annotations

import hashlib
import operator
from collections.abc import Iterable, Sequence
from dataclasses import replace

import torch
import torch.fx as fx
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

from profiler.graph import Layer, ModelGraph, TensorMeta, canonical_names, count_once
from profiler.saved import first_layer, per_output, run_recorded, with_saved


class TraceError(ValueError):
    """The model could not be traced; the message names the module and the fix."""


class _Tracer(fx.Tracer):
    """fx's tracer with extra leaf types, remembering the module it is inside of, so that a
    failure can name it."""

    def __init__(self, leaf_types: tuple[type, ...], leaf_names: frozenset[str]):
        super().__init__()
        self.leaf_types = leaf_types
        self.leaf_names = leaf_names
        self.stack: list[tuple[str, str]] = []
        self.failed_in: tuple[str, str] | None = None  # the innermost module that raised

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        if isinstance(m, self.leaf_types) or qualname in self.leaf_names:
            return True
        return super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        self.stack.append((self.path_of_module(m), type(m).__name__))
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            self.failed_in = self.failed_in or self.stack[-1]
            raise
        finally:
            self.stack.pop()


def fx_trace(model: nn.Module, leaf_modules: Iterable[type | str] = ()) -> fx.GraphModule:
    """Symbolically trace `model`. `leaf_modules` are module types or paths to keep whole.

    Raises TraceError naming the innermost module being traced when fx cannot follow it.
    """
    leaf_modules = tuple(leaf_modules)
    tracer = _Tracer(
        tuple(t for t in leaf_modules if isinstance(t, type)),
        frozenset(t for t in leaf_modules if isinstance(t, str)),
    )
    try:
        graph = tracer.trace(model)
    except Exception as error:  # fx raises TraceError, TypeError, RuntimeError, ...
        path, cls = tracer.failed_in or ("", type(model).__name__)
        name = f"module {path!r} ({cls})" if path else f"the model's own forward ({cls})"
        hint = (
            f"mark it as a leaf: planner.optimize(..., leaf_modules=[{cls}]) keeps it whole "
            f"(it is then replicated or data-parallel as one layer)"
            if path
            else "move the data-dependent Python (if/for on tensor values) into a submodule "
            "and mark that submodule as a leaf with leaf_modules=[...]"
        )
        raise TraceError(
            f"cannot trace {name}: {type(error).__name__}: {str(error).splitlines()[0]}. "
            f"Fix: {hint}"
        ) from error
    return fx.GraphModule(tracer.root, graph, type(model).__name__)


def fingerprint(gm: fx.GraphModule) -> str:
    """A hash of the traced structure (ops, targets, wiring, parameter counts)."""
    modules = dict(gm.named_modules())
    parts = []
    for node in gm.graph.nodes:
        params = ""
        if node.op == "call_module":
            params = str(sum(p.numel() for p in modules[node.target].parameters()))
        args = ",".join(a.name for a in node.all_input_nodes)
        parts.append(f"{node.name}:{node.op}:{_target_name(node)}:{args}:{params}")
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def fingerprint_modules(model: nn.Module) -> str:
    """A hash of the module tree (paths, classes, parameter shapes): what an exported plan
    is checked against, since the executor runs the module itself."""
    parts = [f"{n}:{type(m).__name__}" for n, m in model.named_modules()]
    parts += [f"{n}:{tuple(p.shape)}" for n, p in model.named_parameters()]
    return hashlib.sha256("|".join(parts).encode()).hexdigest()[:16]


def _target_name(node: fx.Node) -> str:
    if node.op in ("call_module", "get_attr", "call_method"):
        return str(node.target)
    if node.op == "call_function":
        return getattr(node.target, "__name__", str(node.target))
    return node.op


def to_meta(value):
    if isinstance(value, torch.Tensor):
        return torch.empty(value.shape, dtype=value.dtype, device="meta")
    if isinstance(value, (list, tuple)):
        return type(value)(to_meta(v) for v in value)
    if isinstance(value, dict):
        return {k: to_meta(v) for k, v in value.items()}
    return value


def _module_attrs(module: nn.Module) -> dict:
    """The shape facts strategies need (which dims can be split, and by how much)."""
    keys = ("in_features", "out_features", "in_channels", "out_channels", "groups",
            "num_embeddings", "embedding_dim", "nf", "nx", "num_heads", "heads", "n_head",
            "num_key_value_heads", "num_experts", "top_k")
    attrs = {k: getattr(module, k) for k in keys if isinstance(getattr(module, k, None), int)}
    if isinstance(getattr(module, "normalized_shape", None), tuple):  # LayerNorm, RMSNorm
        attrs["normalized_dims"] = len(module.normalized_shape)
    # attention that is not plainly causal (an encoder's, a sliding window) cannot be
    # split by sequence as executor.context_parallel runs it (planner.context_degrees)
    if isinstance(getattr(module, "is_causal", None), bool):
        attrs["is_causal"] = module.is_causal
    if isinstance(getattr(module, "sliding_window", None), int):
        attrs["sliding_window"] = module.sliding_window
    config = getattr(module, "config", None)  # Hugging Face modules keep their sizes there
    for key in ("num_attention_heads", "num_key_value_heads"):
        if isinstance(getattr(config, key, None), int):
            attrs[key] = getattr(config, key)
    return attrs


def trace(
    model: nn.Module,
    example_inputs: Sequence,
    example_kwargs: dict | None = None,
    leaf_modules: Iterable[type | str] = (),
) -> ModelGraph:
    """Trace `model` on `example_inputs` (their dim 0 is the global batch) into a ModelGraph.

    Shapes are propagated on meta tensors; parameters are read for their sizes only.
    """
    if not isinstance(example_inputs, (tuple, list)):
        example_inputs = (example_inputs,)
    tensors = [x for x in example_inputs if isinstance(x, torch.Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("example_inputs: pass at least one tensor whose dim 0 is the batch")
    gm = fx_trace(model, leaf_modules)
    modules = dict(gm.named_modules())
    meta_args = [to_meta(x) for x in example_inputs]
    meta_kwargs = to_meta(example_kwargs or {})

    values: dict[str, object] = {}
    layers: list[Layer] = []
    names = canonical_names(gm)
    placeholders = iter(meta_args)
    outputs: tuple[str, ...] = ()
    for node in gm.graph.nodes:
        if node.op == "output":
            outputs = tuple(n.name for n in node.all_input_nodes)
            continue
        if node.op == "placeholder":
            value = meta_kwargs[node.target] if node.target in meta_kwargs else next(placeholders, None)
        else:
            value = _run_meta(node, values, modules, gm)
        values[node.name] = value
        if isinstance(value, torch.Tensor) and node.op != "get_attr":
            layers.append(replace(_layer(node, value, modules, values),
                                  params=_params_read(node, gm, modules, names)))
    known = {layer.node for layer in layers}
    through = _tuple_sources(gm, values, known)
    layers = [replace(l, inputs=tuple(dict.fromkeys(
        j for i in l.inputs for j in ((i,) if i in known else through.get(i, ()))))) for l in layers]
    # a tuple returned whole is its tensors (Inception-v3's InceptionOutputs(logits, aux))
    outputs = tuple(dict.fromkeys(
        j for i in outputs for j in ((i,) if i in known else through.get(i, ()))))
    batch = tensors[0].shape[0]
    layers = count_once(layers, gm)
    fed = [values[n.name] for n in gm.graph.nodes if n.op == "placeholder"]
    ratios = saved_per_output(gm, layers, fed, modules)
    layers = with_saved(layers, ratios)
    return ModelGraph(type(model).__name__, tuple(layers), outputs, batch, fingerprint(gm),
                      module=gm, example_kwargs=dict(example_kwargs or {}))


def saved_per_output(gm: fx.GraphModule, layers: list[Layer], inputs: list,
                     modules: dict) -> dict[str, float]:
    """{layer node: bytes autograd keeps for backward that the layer produced, per byte of
    its output} (profiler.saved), the graph run once on fake CPU tensors with its modules'
    parameters as fake tensors requiring grad where theirs do; {} where some node cannot
    run on fake tensors (data-dependent Python in a leaf module: its layers then keep
    their outputs, the rule without a measurement)."""
    nodes = {l.node for l in layers}
    weights: dict[str, dict] = {}  # module path or get_attr target -> its fake tensors
    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def layer_of(n: fx.Node) -> str | None:
        return n.name if n.name in nodes else None

    def owner(n: fx.Node) -> str | None:
        return None if n.op == "get_attr" else first_layer(n, layer_of)

    def run(interp, n: fx.Node):
        if n.op == "get_attr":
            attr = operator.attrgetter(n.target)(gm)
            if n.target not in weights:
                weights[n.target] = {"": _on_cpu(_meta_weight(attr))}
            interp.recorder.produced(weights[n.target][""], None)
            return weights[n.target][""]
        if n.op == "call_module":
            if n.target not in weights:
                weights[n.target] = _on_cpu(meta_params(modules[n.target]))
            interp.recorder.produced(weights[n.target], None)
            args, kwargs = interp.fetch_args_kwargs_from_env(n)
            return torch.func.functional_call(modules[n.target], weights[n.target],
                                              tuple(args), kwargs)
        return fx.Interpreter.run_node(interp, n)

    try:
        with mode:
            saved = run_recorded(gm, _on_cpu(inputs), owner, run=run)
    except Exception:  # noqa: BLE001 - a module that cannot run on fake tensors
        return {}
    return per_output(saved, layers)


def _on_cpu(value):
    """Meta tensors as fake CPU tensors of the same shape, dtype and requires_grad (made
    inside a FakeTensorMode): a meta tensor runs ops as no device does, and what autograd
    saves follows the kernel a device picks (scaled_dot_product_attention on meta takes
    its math path and saves the whole score matrix, a CPU or GPU its flash kernel, which
    saves its output and a row statistic)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        fake = torch.empty(value.shape, dtype=value.dtype, device="cpu")
        return fake.requires_grad_(True) if value.requires_grad else fake
    if isinstance(value, (list, tuple)):
        return type(value)(_on_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _on_cpu(v) for k, v in value.items()}
    return value


def _meta_weight(value):
    """A bare attribute as a meta tensor, requiring grad where the parameter does."""
    meta = to_meta(value)
    if isinstance(value, nn.Parameter) and value.requires_grad:
        meta.requires_grad_(True)
    return meta


def _params_read(node: fx.Node, gm: fx.GraphModule, modules: dict,
                 names: dict[int, str]) -> tuple[str, ...]:
    """The parameters a node reads: its module's, or bare ones fetched by get_attr."""
    if node.op == "call_module":
        found = modules[node.target].parameters()
    else:
        found = [operator.attrgetter(n.target)(gm) for n in node.all_input_nodes
                 if n.op == "get_attr"]
    return tuple(dict.fromkeys(names[id(p)] for p in found
                               if isinstance(p, nn.Parameter) and id(p) in names))


def meta_params(module: nn.Module) -> dict[str, torch.Tensor]:
    """The module's parameters and buffers as meta tensors (parameters requiring grad)."""
    out = {}
    for key, value in module.state_dict(keep_vars=True).items():
        meta = to_meta(value)
        if isinstance(value, nn.Parameter) and value.requires_grad:
            meta.requires_grad_(True)
        out[key] = meta
    return out


def run_node(node: fx.Node, values: dict, modules: dict, gm: fx.GraphModule,
             params: dict | None = None):
    """Run one fx node on the values of its inputs (`values` maps node names to values);
    a module runs with `params` in place of its own (meta tensors when profiling)."""
    args = fx.node.map_arg(node.args, lambda n: values[n.name])
    kwargs = fx.node.map_arg(node.kwargs, lambda n: values[n.name])
    if node.op == "get_attr":
        return operator.attrgetter(node.target)(gm)
    if node.op == "call_module":
        module = modules[node.target]
        if params is None:
            return module(*args, **kwargs)
        return torch.func.functional_call(module, params, tuple(args), kwargs)
    if node.op == "call_method":
        return getattr(args[0], node.target)(*args[1:], **kwargs)
    return node.target(*args, **kwargs)


def materialize(value, device="cpu"):
    """Meta tensors as zeros on `device` (the CPU, or where the module that must see real
    values keeps its weights)."""
    if isinstance(value, torch.Tensor) and value.is_meta:
        return torch.zeros(value.shape, dtype=value.dtype, device=device)
    if isinstance(value, (list, tuple)):
        return type(value)(materialize(v, device) for v in value)
    if isinstance(value, dict):
        return {k: materialize(v, device) for k, v in value.items()}
    return value


def weights_device(module: nn.Module | None) -> torch.device:
    """Where a module keeps its weights: a GPU model's module that must run on real values
    runs there; the CPU for a module without any (or only meta ones)."""
    if module is not None:
        for tensor in (*module.parameters(), *module.buffers()):
            if not tensor.is_meta:
                return tensor.device
    return torch.device("cpu")


def _run_meta(node: fx.Node, values: dict, modules: dict, gm: fx.GraphModule):
    try:
        if node.op == "get_attr":
            return to_meta(run_node(node, values, modules, gm))
        if node.op == "call_module":
            try:
                return run_node(node, values, modules, gm, meta_params(modules[node.target]))
            except Exception:
                if any(p.is_meta for p in modules[node.target].parameters()):
                    raise
                home = weights_device(modules[node.target])
                real = {n.name: materialize(values[n.name], home) for n in node.all_input_nodes}
                with torch.no_grad():
                    return to_meta(run_node(node, real, modules, gm))
        return run_node(node, values, modules, gm)
    except Exception as error:
        cls = type(modules[node.target]).__name__ if node.op == "call_module" else ""
        where = f"module {node.target!r} ({cls})" if cls else f"{node.name!r}"
        raise TraceError(
            f"cannot propagate shapes through {where} on meta tensors: "
            f"{type(error).__name__}: {str(error).splitlines()[0]}. Fix: check the example "
            f"inputs' shapes, or build the model on the CPU so such a module can run on zeros"
        ) from error


def _tuple_sources(gm: fx.GraphModule, values: dict, known: set[str]) -> dict[str, tuple]:
    """For a node that yields a tuple of tensors (split, chunk): the layers it reads, so that
    the layers reading its items are joined to them (the tuple is no layer of its own)."""
    out: dict[str, tuple] = {}
    for node in gm.graph.nodes:
        if node.name in known or isinstance(values.get(node.name), torch.Tensor):
            continue
        srcs = []
        for n in node.all_input_nodes:
            srcs.extend((n.name,) if n.name in known else out.get(n.name, ()))
        out[node.name] = tuple(srcs)
    return out


def call_facts(node: fx.Node, in_shape) -> dict:
    """What strategies.rowwise needs to know of a function call: its integer arguments (the
    dims it works along), the shape of its first input, and for indexing whether the first
    index keeps every row."""
    def ints(a):
        if isinstance(a, bool):
            return None
        if isinstance(a, int):
            return a
        if isinstance(a, (list, tuple)) and a and all(isinstance(x, int) and not isinstance(x, bool) for x in a):
            return tuple(a)
        return None

    facts = {"int_args": tuple(ints(a) for a in node.args),
             "int_kwargs": {k: ints(v) for k, v in node.kwargs.items() if ints(v) is not None}}
    if in_shape is not None:
        facts["in_shape"] = tuple(in_shape)
    if node.kwargs.get("is_causal") is True:  # flash attention skips half the scores
        facts["is_causal"] = True
    if len(node.args) > 1 and not isinstance(node.args[1], (int, fx.Node)):
        index = node.args[1]
        first = index[0] if isinstance(index, tuple) and index else index
        facts["index_keeps_rows"] = first is Ellipsis or (
            isinstance(first, slice) and first == slice(None))
    return facts


def _shape_read(node: fx.Node) -> dict:
    """{"shape_read": True} where code reads the value's sizes (`x.shape`, `x.size()`):
    splitting it on a dim other than rows would hand that code a rank's size."""
    read = any((u.op == "call_method" and u.target in ("size", "numel"))
               or (u.op == "call_function" and u.target is getattr and u.args[1:2] == ("shape",))
               for u in node.users)
    return {"shape_read": True} if read else {}


def _layer(node: fx.Node, value: torch.Tensor, modules: dict, values: dict | None = None) -> Layer:
    inputs = tuple(n.name for n in node.all_input_nodes)
    if node.op == "call_module":
        module = modules[node.target]
        return Layer(
            name=str(node.target), node=node.name, op=node.op, kind=type(module).__name__,
            inputs=inputs, output=TensorMeta.of(value), module_type=type(module),
            attrs=_module_attrs(module) | _shape_read(node))
    kind = "input" if node.op == "placeholder" else _target_name(node)
    attrs = {}
    if node.op in ("call_function", "call_method"):
        shapes = [tuple(values[n.name].shape) for n in node.all_input_nodes
                  if isinstance((values or {}).get(n.name), torch.Tensor)]
        attrs = call_facts(node, shapes[0] if shapes else None) | _shape_read(node)
        attrs["in_shapes"] = tuple(shapes)
    return Layer(name=node.name, node=node.name, op=node.op, kind=kind, inputs=inputs,
                 output=TensorMeta.of(value), attrs=attrs)
