"""`parallelize`: rewrite a model for this rank under a Plan, with PyTorch's own engine.

In a fixed order, like torchtitan's parallelize functions:
1. check the plan belongs to this model and this world size, and every rank holds it;
2. tensor parallelism: model-parallel layers get DTensor parallel styles, told the layout
   their input arrives in;
3. layout changes: a `Reshard` node on every other edge whose layouts differ, and on the
   way out, where each rank gets back the rows it passed;
4. gradient scaling: the output gradient is divided by the world size once, so all
   gradient reductions are sums;
5. data parallelism: DDP over the data-parallel layers' weights (the others are ignored by
   it), summing gradients;
6. precision: the forward under autocast, outputs in fp32 (executor.precision).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.fx as fx
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor.parallel import parallelize_module

from executor.agree import PlanMismatch, check_model, check_same_plan, traced_as_planned
from executor.styles import (MeanOverRanks, Reshard, broadcast_replicated,
                             data_parallel_over, params_of, placement, tensor_parallel_style)
from planner.plan import LayerPlan, Plan
from strategies.layouts import Layout


def check_world(plan: Plan, world_size: int) -> None:
    if world_size != plan.num_devices:
        raise PlanMismatch(
            f"world size mismatch: the plan is for {plan.num_devices} devices, this run has "
            f"{world_size} processes; launch {plan.num_devices} (torchrun --nproc-per-node "
            f"{plan.num_devices}) or re-plan with devices={world_size}")


def _device(plan: Plan) -> torch.device:
    if plan.mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(plan.mesh.device_type)


def parallelize(model: nn.Module, plan: Plan, *, mesh: DeviceMesh | None = None,
                leaf_modules=()) -> nn.Module:
    """This rank's version of `model` under `plan`. Call on every rank after
    `torch.distributed.init_process_group`, with the same model (same initial weights) on
    each; the result trains in an unchanged loop (see `shard_batch` for the inputs)."""
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("parallelize: no process group; launch with torchrun and call "
                           "torch.distributed.init_process_group() first")
    check_world(plan, dist.get_world_size())
    check_same_plan(plan)  # before any other collective: different plans would deadlock
    if plan.mesh.device_type == "cpu":
        from profiler.allocator import keep_freed_memory

        keep_freed_memory()  # the memory policy the plan's layer times were measured under
    if plan.is_mesh_3d and plan.tracer == "export":  # stages of a decoder's own modules
        from executor.hf_stages import parallelize_decoder_3d

        return parallelize_decoder_3d(model, plan)
    if plan.is_mesh_3d:  # pipeline x data x tensor: this rank's stage
        from executor.pipeline import parallelize_3d

        return parallelize_3d(model, plan, leaf_modules=leaf_modules)
    if plan.tracer == "export":
        return _in_precision(_parallelize_exported(model, plan, mesh), plan)
    gm = traced_as_planned(model, plan, leaf_modules).to(_device(plan))
    mesh = mesh or init_device_mesh(plan.mesh.device_type, (plan.num_devices,))

    layers = {l.node: l for l in plan.layers}
    gives = {i.name: (Layout(i.layout), i.shape) for i in plan.inputs}
    gives.update({l.node: (Layout(l.output_layout), l.output_shape) for l in plan.layers})

    _apply_tensor_parallel(gm, mesh, layers, gives)
    _insert_reshards(gm, mesh, layers, gives, plan.global_batch)
    broadcast_replicated(gm, params_of(plan, "replicate"))
    _apply_levers(gm, layers, mesh, plan)
    return _in_precision(data_parallel_over(gm, params_of(plan, "data_parallel")), plan)


def _in_precision(module: nn.Module, plan: Plan) -> nn.Module:
    """The module (inside DDP, where DDP wraps it) runs its forward in the plan's precision."""
    from executor.precision import run_in_precision

    inner = getattr(module, "module", module)  # DDP keeps the model as .module
    run_in_precision(inner, plan.training_precision, plan.mesh.device_type)
    return module


def _parallelize_exported(model: nn.Module, plan: Plan, mesh) -> nn.Module:
    """A plan from torch.export: strategies applied by module path (executor.modules)."""
    from executor.modules import parallelize_modules

    check_model(model, plan)
    model = model.to(_device(plan))
    mesh = mesh or init_device_mesh(plan.mesh.device_type, (plan.num_devices,))
    return parallelize_modules(model, plan, mesh)


def _apply_tensor_parallel(gm: fx.GraphModule, mesh, layers: dict[str, LayerPlan], gives):
    plan = {}
    for node in gm.graph.nodes:
        layer = layers.get(node.name)
        if node.op != "call_module" or layer is None or not layer.model_parallel:
            continue
        layout, shape = [gives[n.name] for n in node.all_input_nodes if n.name in gives][0]
        plan[str(node.target)] = tensor_parallel_style(
            layer.strategy, Layout(layer.output_layout), placement(layout.forward, shape),
            layer.output_shape, gm.get_submodule(str(node.target)))
    if plan:
        parallelize_module(gm, mesh, plan)


def _tuple_source(node: fx.Node, gives) -> fx.Node | None:
    """The planned tensor a tuple-yielding node (split, chunk) reads, when it reads one."""
    srcs = [n for n in node.all_input_nodes if n.name in gives]
    return srcs[0] if len(srcs) == 1 and len(node.all_input_nodes) == 1 else None


def _insert_reshards(gm: fx.GraphModule, mesh, layers: dict[str, LayerPlan], gives,
                     plan_batch: int, final: bool = True, mean_over: int | None = None):
    """`final`: the graph's outputs are the model's (resharded to rows, gradient scaled by
    1/`mean_over`, default the mesh size); else they leave in their own layouts (a
    pipeline stage's outputs, which the next stage reshards itself)."""
    count = 0

    def reshard(before: fx.Node, src: fx.Node, dst_layout: Layout) -> fx.Node:
        nonlocal count
        layout, shape = gives[src.name]
        name = f"hyplan_reshard_{count}"
        count += 1
        gm.add_submodule(name, Reshard(mesh, layout, dst_layout, shape))
        with gm.graph.inserting_before(before):
            return gm.graph.call_module(name, (src,))

    for node in list(gm.graph.nodes):
        layer = layers.get(node.name)
        if layer is not None and not layer.model_parallel:
            for src in list(node.all_input_nodes):
                target = node
                if src.name not in gives:
                    inner = _tuple_source(src, gives) if src.op == "call_function" else None
                    if inner is None:
                        continue
                    target, src = src, inner  # split/chunk: reshard what it splits
                want = Layout(layer.input_layout)
                layout, shape = gives[src.name]
                if want == Layout.BATCH and (not shape or shape[0] != plan_batch):
                    want = Layout.REPLICATE_PARTIAL_GRAD  # see planner.choices.batch_free_takes
                if layout != want and src in target.all_input_nodes:
                    target.replace_input_with(src, reshard(target, src, want))
        if node.op == "output" and final:
            world = mean_over or mesh.size()
            gm.add_submodule("hyplan_mean_over_ranks", MeanOverRanks(world))
            for src in list(node.all_input_nodes):
                if src.name not in gives:
                    continue
                out = src
                if gives[src.name][0] != Layout.BATCH:
                    out = reshard(node, src, Layout.BATCH)
                with gm.graph.inserting_before(node):
                    scaled = gm.graph.call_module("hyplan_mean_over_ranks", (out,))
                node.replace_input_with(src, scaled)
    gm.graph.lint()
    gm.recompile()


def _apply_levers(gm: fx.GraphModule, layers: dict[str, LayerPlan], mesh, plan: Plan) -> None:
    """fsdp layers: FSDP2 fully_shard; recomputed layers: checkpointed (executor.levers)."""
    from executor.levers import apply_levers

    targets = [(str(n.target), layers[n.name].strategy, layers[n.name].recompute)
               for n in gm.graph.nodes if n.op == "call_module" and n.name in layers
               and (layers[n.name].recompute or layers[n.name].strategy == "fsdp")]
    if targets:
        apply_levers(gm, targets, mesh, plan.training_precision)

