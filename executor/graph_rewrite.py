"""A torch.fx plan applied to the traced graph: the rewriting `parallelize` dispatches to,
and a pipeline stage reuses on its own part of the graph (executor.pipeline).

Steps 1-5 of executor.parallelize's docstring: tensor-parallel styles, a `Reshard` node on
every edge whose layouts differ, the output gradient's scaling, the levers (FSDP2,
recomputation), then DDP over the data-parallel layers' weights. Where the graph writes in
place into what a tensor-parallel module or a `Reshard` hands on, that output is copied
first (executor.view_outputs).
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from executor.agree import traced_as_planned
from executor.levers import apply_levers
from executor.styles import (MeanOverRanks, Reshard, broadcast_replicated,
                             data_parallel_over, params_of, placement, summed_params,
                             tensor_parallel_style)
from executor.view_outputs import (own_written_outputs, silence_safe_view_warnings,
                                   view_safety)
from planner.handback import output_layout
from planner.plan import LayerPlan, Plan
from strategies.layouts import Layout


def device_of(plan: Plan) -> torch.device:
    """The device this rank computes on under `plan`."""
    if plan.mesh.device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(
                f"the plan is for {plan.num_devices} CUDA devices "
                f"({plan.cluster.device.name}) and this process sees none; run it where "
                f"torch.cuda.is_available(), or re-plan for these ranks (devices="
                f"'{plan.num_devices}xcpu')")
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(plan.mesh.device_type)


def parallelize_graph(model: nn.Module, plan: Plan, mesh: DeviceMesh | None = None,
                      leaf_modules=()) -> nn.Module:
    """This rank's traced `model` under a torch.fx `plan` (its precision is the caller's)."""
    gm = traced_as_planned(model, plan, leaf_modules).to(device_of(plan))
    mesh = mesh or init_device_mesh(plan.mesh.device_type, (plan.num_devices,))

    layers = {l.node: l for l in plan.layers}
    gives = {i.name: (Layout(i.layout), i.shape) for i in plan.inputs}
    gives.update({l.node: (Layout(l.output_layout), l.output_shape) for l in plan.layers})

    parallel = apply_tensor_parallel(gm, mesh, layers, gives)
    insert_reshards(gm, mesh, layers, gives, plan.global_batch)
    own_written_outputs(gm, parallel | reshard_paths(gm))
    broadcast_replicated(gm, params_of(plan, "replicate"))
    _apply_levers(gm, layers, mesh, plan)
    return data_parallel_over(gm, summed_params(plan))


def apply_tensor_parallel(gm: fx.GraphModule, mesh, layers: dict[str, LayerPlan],
                          gives, skip: set[str] = frozenset()) -> set[str]:
    """DTensor styles on the model-parallel layers' modules; returns their paths. `skip`:
    layers styled over another mesh (a 3-D plan's expert parallelism wider than tp,
    executor.experts.apply_carved)."""
    plan = {}
    for node in gm.graph.nodes:
        layer = layers.get(node.name)
        if (node.op != "call_module" or layer is None or not layer.model_parallel
                or node.name in skip):
            continue
        layout, shape = [gives[n.name] for n in node.all_input_nodes if n.name in gives][0]
        if _takes_rows(layer):  # its inputs resharded to rows first (insert_reshards)
            layout = Layout.BATCH
        plan[str(node.target)] = tensor_parallel_style(
            layer.strategy, Layout(layer.output_layout), placement(layout.forward, shape),
            layer.output_shape, gm.get_submodule(str(node.target)))
    if plan:
        parallelize_module(gm, mesh, plan)
    return set(plan)


def _takes_rows(layer: LayerPlan) -> bool:
    """A model-parallel layer that takes each rank's rows on every input (expert
    parallelism: hidden states, expert ids and weights alike): its inputs are resharded as
    a data-parallel layer's are, where its style would see only the first one's layout."""
    return layer.model_parallel and Layout(layer.input_layout) == Layout.BATCH


def _readers_agree(tuple_node: fx.Node, layers: dict[str, LayerPlan], shape, want_of) -> bool:
    """Do the planned readers of a tuple-yielding node (split, chunk, topk) all take it in
    one layout, so that resharding what it reads serves them all?"""
    wants = {want_of(layers[u.name], shape) for u in tuple_node.users if u.name in layers}
    return len(wants) <= 1


def _reshard_output(node: fx.Node, gives: dict, made: Layout, reshard) -> None:
    """`node` (a reader of a tuple made in layout `made`) runs on it as made; what it gives
    is resharded to the layout its plan says it gives before any other node reads it, and
    its readers see the resharded node as it (`gives`), to reshard it further."""
    given, shape = gives[node.name]
    if made == given:
        return
    users = list(node.users)
    out = reshard(node.next, node, given, given=(made, shape))
    for user in users:
        user.replace_input_with(node, out)
    gives[out.name] = gives[node.name]


def reshard_paths(gm: fx.GraphModule) -> set[str]:
    """The paths of the `Reshard` modules `insert_reshards` added to `gm`."""
    return {name for name, module in gm.named_children() if isinstance(module, Reshard)}


def _tuple_source(node: fx.Node, gives) -> fx.Node | None:
    """The planned tensor a tuple-yielding node (split, chunk) reads, when it reads one."""
    srcs = [n for n in node.all_input_nodes if n.name in gives]
    return srcs[0] if len(srcs) == 1 and len(node.all_input_nodes) == 1 else None


def _returned(output: fx.Node, gives) -> list[tuple[fx.Node, fx.Node]]:
    """(reader, tensor) for each planned tensor the graph returns: read by the output node
    itself, or by a tuple built for it (Inception-v3's InceptionOutputs(logits, aux))."""
    pairs, stack = [], [output]
    while stack:
        reader = stack.pop()
        for src in reader.all_input_nodes:
            if src.name in gives:
                pairs.append((reader, src))
            elif src.op == "call_function" and len(src.users) == 1:
                stack.append(src)
    return pairs


def insert_reshards(gm: fx.GraphModule, mesh, layers: dict[str, LayerPlan], gives,
                     plan_batch: int, final: bool = True, mean_over: int | None = None):
    """`final`: the graph's outputs are the model's (resharded to rows, or whole where the
    rows do not split; gradient scaled by 1/`mean_over`, default the mesh size); else they
    leave in their own layouts (a pipeline stage's outputs, which the next stage reshards
    itself)."""
    count = 0

    def reshard(before: fx.Node, src: fx.Node, dst_layout: Layout, given=None) -> fx.Node:
        nonlocal count
        layout, shape = given or gives[src.name]
        name = f"hyplan_reshard_{count}"
        count += 1
        gm.add_submodule(name, Reshard(mesh, layout, dst_layout, shape))
        with gm.graph.inserting_before(before):
            return gm.graph.call_module(name, (src,))

    def want_of(layer: LayerPlan, shape) -> Layout:
        want = Layout(layer.input_layout)
        if want == Layout.BATCH and (not shape or shape[0] != plan_batch):
            want = Layout.REPLICATE_PARTIAL_GRAD  # see planner.price.batch_free_takes
        return want

    for node in list(gm.graph.nodes):
        layer = layers.get(node.name)
        if layer is not None and (not layer.model_parallel or _takes_rows(layer)):
            for src in list(node.all_input_nodes):
                target = node
                if src.name not in gives:
                    inner = _tuple_source(src, gives) if src.op == "call_function" else None
                    if inner is None:
                        continue
                    if not _readers_agree(src, layers, gives[inner.name][1], want_of):
                        # its readers take it in different layouts (topk's values by rows,
                        # its indices whole): each reads it as made, its output resharded
                        _reshard_output(node, gives, gives[inner.name][0], reshard)
                        continue
                    target, src = src, inner  # split/chunk: reshard what it splits
                layout, shape = gives[src.name]
                want = want_of(layer, shape)
                if layout != want and src in target.all_input_nodes:
                    target.replace_input_with(src, reshard(target, src, want))
        if node.op == "output" and final:
            # rows that do not split over the mesh are handed back whole (planner.handback):
            # the mesh's ranks then compute one loss alike, and count once in the mean
            handed = output_layout(plan_batch, mesh.size())
            world = mean_over or mesh.size()
            if handed == Layout.REPLICATE:
                world //= mesh.size()
            gm.add_submodule("hyplan_mean_over_ranks", MeanOverRanks(world))
            for target, src in _returned(node, gives):
                out = src
                if gives[src.name][0] != handed:
                    out = reshard(target, src, handed)
                with gm.graph.inserting_before(target):
                    scaled = gm.graph.call_module("hyplan_mean_over_ranks", (out,))
                target.replace_input_with(src, scaled)
    gm.graph.lint()
    gm.recompile()


def _apply_levers(gm: fx.GraphModule, layers: dict[str, LayerPlan], mesh, plan: Plan) -> None:
    """fsdp layers: FSDP2 fully_shard; recomputed layers: checkpointed (executor.levers)."""
    targets = [(str(n.target), layers[n.name].strategy, layers[n.name].recompute)
               for n in gm.graph.nodes if n.op == "call_module" and n.name in layers
               and (layers[n.name].recompute or layers[n.name].strategy == "fsdp")]
    if targets:
        silence_safe_view_warnings(view_safety(gm, [path for path, strategy, _ in targets
                                                    if strategy == "fsdp"]))
        apply_levers(gm, targets, mesh, plan.training_precision)

