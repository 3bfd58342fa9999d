"""Apply a plan made from a torch.export graph: by module path, on the module itself.

A model torch.fx cannot trace (Hugging Face transformers) cannot be rewritten as an fx
graph either, so this runs the model's own forward, as torchtitan does: each layer that is
a module gets its strategy by path (DTensor parallel styles for the model-parallel ones),
and the layout changes the plan priced are made in forward hooks at module boundaries
(the planner only lets layouts change there, see planner.price.edge_cost). Ops outside
modules run on what each rank holds: its rows.

Order, as in executor.parallelize: check, tensor parallelism, layout hooks, gradient
scaling, replicated weights from rank 0, data parallelism (DDP over the data-parallel
layers' weights, summing).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils import _pytree as pytree

from executor.inputs import main_input
from executor.styles import (MeanOverRanks, Reshard, broadcast_replicated,
                             data_parallel_over, dead_params, params_of, placement,
                             tensor_parallel_style)
from executor.view_outputs import own_output
from planner.price import READS_METADATA_ONLY
from planner.handback import output_layout
from planner.plan import LayerPlan, Plan
from profiler.graph import rows_in_dim0
from strategies.layouts import Layout


def module_path(model: nn.Module, layer: LayerPlan) -> str | None:
    """The path of the module a layer is a call of, or None for an op outside modules."""
    path = layer.name.split("#")[0]
    try:
        model.get_submodule(path)
    except AttributeError:
        return None
    return path if path else None


def _gather_rows(mesh, local_rows: int, value):
    """Other tensor arguments split by rows (a mask computed from each rank's ids): whole."""
    if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == local_rows:
        return DTensor.from_local(value, mesh, [Shard(0)], run_check=False).full_tensor()
    if isinstance(value, tuple):
        return tuple(_gather_rows(mesh, local_rows, v) for v in value)
    return value


def _owned(reshard: Reshard) -> Reshard:
    """A layout change whose output the model's code may write in place (ResNet's `hidden
    += residual`): a copy of DTensor's view (executor.view_outputs.own_output)."""
    reshard.register_forward_hook(own_output)
    return reshard


def _pre_hook(reshard: Reshard | None, mesh, gather_others: bool):
    def hook(module, args, kwargs):
        where = main_input(args, kwargs)
        if where is None:
            return None
        x = args[0] if where == 0 else kwargs[where]
        rows = x.shape[0]
        if reshard is not None:
            x = reshard(x)
        rest = args[1:] if where == 0 else args
        others = {k: v for k, v in kwargs.items() if k != where}
        if gather_others and x.shape[0] != rows:
            rest = tuple(_gather_rows(mesh, rows, v) for v in rest)
            others = {k: _gather_rows(mesh, rows, v) for k, v in others.items()}
        if where == 0:
            return (x, *rest), others
        return rest, {**others, where: x}
    return hook


def _post_hook(reshard: Reshard):
    def hook(module, args, output):
        if isinstance(output, torch.Tensor):
            return reshard(output)
        if isinstance(output, tuple) and output and isinstance(output[0], torch.Tensor):
            return (reshard(output[0]), *output[1:])
        return output
    return hook


def _scale_outputs(world: int):
    scale = MeanOverRanks(world)

    def f(t):
        return scale(t) if isinstance(t, torch.Tensor) and t.requires_grad else t

    def hook(module, args, output):
        if isinstance(output, Mapping):  # a Hugging Face ModelOutput
            for key in list(output.keys()):
                output[key] = pytree.tree_map_only(torch.Tensor, f, output[key])
            return output
        return pytree.tree_map_only(torch.Tensor, f, output)
    return hook


def parallelize_modules(model: nn.Module, plan: Plan, mesh: DeviceMesh) -> nn.Module:
    """This rank's `model` under an exported `plan` (see the module docstring)."""
    paths = {l.node: module_path(model, l) for l in plan.layers}
    held = apply_module_layouts(model, plan.layers, plan.inputs, plan.outputs,
                                plan.global_batch, mesh, paths)
    # a whole output: every rank computes the one loss, counted once in the mean
    model.register_forward_hook(_scale_outputs(mesh.size() if held == Layout.BATCH else 1))

    broadcast_replicated(model, params_of(plan, "replicate"))
    from executor.levers import apply_levers

    apply_levers(model, [(paths[l.node], l.strategy, l.recompute) for l in plan.layers
                         if paths[l.node] is not None and (l.recompute or l.strategy == "fsdp")],
                 mesh, plan.training_precision)
    partial = partial_outside_modules(plan.layers, paths)
    _refuse_mixed_gradients(plan, paths, partial)
    return data_parallel_over(model, (params_of(plan, "data_parallel") | partial)
                              - dead_params(plan))


def _refuse_mixed_gradients(plan: Plan, paths: dict[str, str | None], partial: set[str]):
    """A parameter read by a replicated module (its gradient complete on every rank) and by
    ops between modules that meet the rows (theirs each rank's share) has no one right sum:
    MobileBERT's head reads its tied word embedding as `decoder.weight.t()` beside the
    embedding module, and its plans moved that weight 1e-3 away from one process's. Said
    before a step, not found after training."""
    whole = {name for layer in plan.layers
             if paths[layer.node] is not None and layer.strategy == "replicate"
             for name in layer.params}
    mixed = sorted(partial & whole)
    if mixed:
        readers = [l.name for l in plan.layers if mixed[0] in l.params]
        raise ValueError(
            f"plan: parameter {mixed[0]!r} is read by a replicated module and by ops between "
            f"modules that meet the batch's rows ({', '.join(readers)}): its gradient would "
            f"be complete from one and each rank's share from the others, which no one sum "
            f"makes right. hyplan cannot split this model's rows yet; train it on one device")


def partial_outside_modules(layers: list[LayerPlan], paths: dict[str, str | None]) -> set[str]:
    """Bare parameters read by ops outside modules whose gradients are partial sums over the
    ranks' rows, to be summed with the data-parallel layers' (DDP, summing): a replicated
    op's output (Gemma's RMSNorm `1 + weight`, inlined by torch.export) that reaches an
    op taking rows, through ops outside modules alone. Such ops cannot change layouts
    (`apply_module_layouts`), so the gradient that comes back is each rank's share;
    summed at its parameter, as the planner priced the change on the edge. A module
    taking rows sums what it hands back itself (its pre-hook), so it ends the walk. Left
    unsummed, Gemma's norm weights moved by half their value apart from one process's
    after 3 steps."""
    readers = _readers(layers)
    return {name for layer in layers
            if paths[layer.node] is None and layer.params
            and layer.strategy not in ("data_parallel", "sequence_parallel")
            and Layout(layer.output_layout) in (Layout.REPLICATE, Layout.REPLICATE_PARTIAL_GRAD)
            and _meets_rows(layer.node, readers, paths, at_modules=False)
            for name in layer.params}


def _readers(layers: list[LayerPlan]) -> dict[str, list[LayerPlan]]:
    """{node: the layers that read its output}."""
    readers: dict[str, list[LayerPlan]] = {}
    for layer in layers:
        for src in layer.inputs:
            readers.setdefault(src, []).append(layer)
    return readers


def _meets_rows(node: str, readers: dict, paths: dict[str, str | None], at_modules: bool,
                seen: frozenset = frozenset()) -> bool:
    """Does `node`'s value meet rows split across ranks, directly or through ops outside
    modules: at a reader that takes rows, an op, or with `at_modules` a module too? The
    walk goes on through ops only (a module that takes it whole, model-parallel say, sums
    its own partials: not a split of rows)."""
    for r in readers.get(node, []):
        module = paths[r.node] is not None
        if r.node in seen or (module and not at_modules):
            continue
        if Layout(r.input_layout) == Layout.BATCH:
            return True
        if not module and _meets_rows(r.node, readers, paths, at_modules, seen | {r.node}):
            return True
    return False


def apply_module_layouts(model: nn.Module, layers: list[LayerPlan], inputs, outputs,
                         batch: int, mesh: DeviceMesh, paths: dict[str, str | None],
                         here=None) -> Layout:
    """Tensor parallelism and the layout changes at module boundaries of an exported
    plan's `layers` over `mesh`, where `batch` rows are split over it; `paths` maps each
    layer's node to its module path (None: an op outside modules). `here(layer)` says
    whether this call applies a layer's style and hooks (a pipeline stage applies its own
    layers', executor.hf_stages); the layouts are derived from all of `layers`. Returns
    the layout the model's code holds module outputs in: rows, or whole where the rows
    do not split over the mesh (planner.handback). A plan's layouts are refused before
    any hook is installed."""
    layouts = derive_layouts(layers, inputs, outputs, batch, mesh.size(), paths)
    check_ops_between_modules(layers, layouts, paths)
    calls = hooked_calls(layers, layouts, paths, here)
    install_layout_hooks(model, calls, layouts, mesh)
    return layouts.held


@dataclass(frozen=True)
class ModuleLayouts:
    """The layouts an exported plan's values travel in: `gives`, each value's layout,
    shape and row factor as its producer makes it; `handed`, the layout it is handed on
    in; `held`, the layout the model's own code holds module outputs in (rows, or whole
    where `batch` rows do not split over the mesh: planner.handback)."""
    gives: dict[str, tuple[Layout, list[int], int | None]]
    readers: dict[str, list[LayerPlan]]
    handed: dict[str, Layout]
    held: Layout
    batch: int

    def wanted(self, src: str, reader: LayerPlan) -> Layout:
        """The layout `reader` takes `src` in: a value without the batch's rows, where
        the reader takes rows, is whole with a per-rank partial gradient."""
        want = Layout(reader.input_layout)
        _, shape, factor = self.gives[src]
        if want == Layout.BATCH and not rows_in_dim0(shape, self.batch, factor):
            return Layout.REPLICATE_PARTIAL_GRAD
        return want


def derive_layouts(layers: list[LayerPlan], inputs, outputs, batch: int, ranks: int,
                   paths: dict[str, str | None]) -> ModuleLayouts:
    """What each value hands on, `batch` rows split over `ranks`: an input and an op
    outside modules their own layout (ops there cannot change layouts), a module the one
    its readers outside modules take (`_handed_on`)."""
    gives = {i.name: (Layout(i.layout), i.shape, None) for i in inputs}
    gives.update({l.node: (Layout(l.output_layout), l.output_shape, l.row_factor)
                  for l in layers})
    handed: dict[str, Layout] = {}
    layouts = ModuleLayouts(gives, _readers(layers), handed, output_layout(batch, ranks), batch)
    outputs = set(outputs)
    for layer in layers:
        handed[layer.node] = (Layout(layer.output_layout) if paths[layer.node] is None
                              else _handed_on(layer, layouts, outputs, paths))
    for i in inputs:
        handed[i.name] = Layout(i.layout)
    # a module's output without the batch (a position table) that meets rows: its gradient
    # is a per-rank partial, summed where the value leaves its module
    for layer in layers:
        if (paths[layer.node] is not None and handed[layer.node] == Layout.REPLICATE
                and not rows_in_dim0(layer.output_shape, batch, layer.row_factor)
                and _meets_rows(layer.node, layouts.readers, paths, at_modules=True)):
            handed[layer.node] = Layout.REPLICATE_PARTIAL_GRAD
    return layouts


def _handed_on(layer: LayerPlan, layouts: ModuleLayouts, outputs: set[str],
               paths: dict[str, str | None]) -> Layout:
    """The one layout a module hands its output on in: the layout its readers outside
    modules take, if not its own; refused where they want two."""
    readers = layouts.readers.get(layer.node, [])
    outside = {layouts.wanted(layer.node, r) for r in readers
               if paths[r.node] is None and r.kind not in READS_METADATA_ONLY}
    # rows whole: readers that all take it feature-split get each rank's feature shard,
    # a local tensor (planner.price._through_rows; torchtitan's colwise MLP); only
    # element-wise ops between modules take it so outside modules
    local = ({Layout(r.input_layout) for r in readers} == {Layout.FEATURE}
             and layouts.held != Layout.BATCH)
    if layer.node in outputs or (rows_in_dim0(layer.output_shape, layouts.batch, layer.row_factor)
                                 and not local):
        # a module's output is what the model's own code holds next: it may read its
        # sizes to shape another tensor (`hidden_states.shape[0]` to view q, k, v), so
        # every batch-sized tensor the code sees is split by rows alike (or whole
        # alike, where the rows do not split over the mesh: planner.handback)
        outside.add(layouts.held)
    if len(outside) > 1:
        raise ValueError(f"plan: layer {layer.name!r} feeds ops that want {sorted(outside)}; "
                         f"re-plan (the module executor makes one change per module output)")
    return outside.pop() if outside else Layout(layer.output_layout)


def check_ops_between_modules(layers: list[LayerPlan], layouts: ModuleLayouts,
                              paths: dict[str, str | None]) -> None:
    """Refuse, by name, an op outside modules that needs one of its inputs in another
    layout than the one it arrives in: only a module's hooks change layouts. An op that
    reads only its input's dtype and device reads any layout as it is, and a whole value
    is whole to its reader whether or not its gradient is summed yet."""
    whole = (Layout.REPLICATE, Layout.REPLICATE_PARTIAL_GRAD)
    for layer in layers:
        if paths[layer.node] is not None or layer.kind in READS_METADATA_ONLY:
            continue
        for src in layer.inputs:
            if src not in layouts.handed:
                continue
            arrives, want = layouts.handed[src], layouts.wanted(src, layer)
            if arrives != want and not (arrives in whole and want in whole):
                raise ValueError(
                    f"plan: op {layer.name!r} wants {want.value} from {src!r}, which "
                    f"arrives {arrives.value}; the module executor changes layouts only at "
                    f"modules: re-plan with this hyplan")


def hooked_calls(layers: list[LayerPlan], layouts: ModuleLayouts,
                 paths: dict[str, str | None], here=None) -> dict[str, tuple[LayerPlan, str]]:
    """{module path: (the layer it is a call of, its main input)}: the modules this call
    hooks (`here`), each once. A module called more than once (ALBERT's shared layer:
    "path", "path#2", ...) must need the same hand-over at every call, and a
    model-parallel one cannot hand on a partial gradient: both refused by name."""
    calls: dict[str, tuple[LayerPlan, str]] = {}
    handovers: dict[str, tuple] = {}
    for layer in layers:
        path = paths[layer.node]
        if path is None or (here is not None and not here(layer)):
            continue
        main = next((s for s in layer.inputs if s in layouts.gives), None)
        if main is None:
            continue
        handover = (layer.strategy, layouts.handed[main], layouts.wanted(main, layer),
                    Layout(layer.output_layout), layouts.handed[layer.node])
        if path in handovers:
            if handovers[path] != handover:
                raise ValueError(f"plan: module {path!r} is called more than once, and its "
                                 f"calls need different layout changes ({handovers[path]} vs "
                                 f"{handover}); re-plan with this hyplan")
            continue
        handovers[path] = handover
        calls[path] = (layer, main)
    styled = {path for path, (layer, _) in calls.items() if layer.model_parallel}
    for layer in layers:
        partial = layouts.handed[layer.node] == Layout.REPLICATE_PARTIAL_GRAD
        if paths[layer.node] in styled and partial:
            raise ValueError(f"plan: {layer.name!r}: unsupported output hand-over")
    return calls


def install_layout_hooks(model: nn.Module, calls: dict[str, tuple[LayerPlan, str]],
                         layouts: ModuleLayouts, mesh: DeviceMesh) -> None:
    """Each hooked module's hand-over: a model-parallel module gets its DTensor parallel
    style, told the layout its input arrives in and the one it hands on; any other a
    forward pre-hook that changes its input to the layout it takes and, where it hands on
    another layout than its own, a forward hook that changes its output."""
    tp_styles = {}
    for path, (layer, main) in calls.items():
        module = model.get_submodule(path)
        arrives, shape = layouts.handed[main], layouts.gives[main][1]
        handed = layouts.handed[layer.node]
        if layer.model_parallel:
            tp_styles[path] = tensor_parallel_style(
                layer.strategy, handed, placement(arrives.forward, shape), layer.output_shape,
                module)
            continue
        want = layouts.wanted(main, layer)
        if arrives == Layout.REPLICATE_PARTIAL_GRAD and want == Layout.REPLICATE:
            arrives = want  # already summed where it left its module
        reshard_in = _owned(Reshard(mesh, arrives, want, shape)) if arrives != want else None
        module.register_forward_pre_hook(
            _pre_hook(reshard_in, mesh, gather_others=want != Layout.BATCH), with_kwargs=True)
        own = Layout(layer.output_layout)
        if handed != own:
            module.register_forward_hook(
                _post_hook(_owned(Reshard(mesh, own, handed, layer.output_shape))))
    if tp_styles:
        parallelize_module(model, mesh, tp_styles)
        # after the styles' own hooks, on what they hand on: no graph here says which
        # outputs the model's code writes in place (Falcon's `mlp_output += ...`), so each
        # view is copied
        for path in tp_styles:
            model.get_submodule(path).register_forward_hook(own_output)
