"""`parallelize`: rewrite a model for this rank under a Plan, with PyTorch's own engine.

Check, then dispatch: every plan is first checked (it belongs to this world size, and every
rank holds it); then a context-parallel plan goes to executor.context_parallel, a pipeline
plan to executor.pipeline, a torch.export plan to
executor.modules (strategies applied by module path), and a torch.fx plan to
executor.graph_rewrite, which rewrites the traced graph in a fixed order, like torchtitan's
parallelize functions:
1. check the plan belongs to this model (the traced graph's fingerprint);
2. tensor parallelism: model-parallel layers get DTensor parallel styles, told the layout
   their input arrives in (split by tokens, Shard(1), after sequence-parallel norms);
3. layout changes: a `Reshard` node on every other edge whose layouts differ, and on the
   way out, where each rank gets back the rows it passed;
4. gradient scaling: the output gradient is divided by the world size once, so all
   gradient reductions are sums;
5. data parallelism: DDP over the data- and sequence-parallel layers' weights (the others
   are ignored by it), summing gradients;
6. precision: the forward under autocast, outputs in fp32 (executor.precision).
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from executor.agree import PlanMismatch, check_model, check_same_plan
from executor.context_parallel import parallelize_plan
from executor.graph_rewrite import device_of, parallelize_graph
from executor.hf_stages import parallelize_decoder_3d
from executor.modules import parallelize_modules
from executor.pipeline import parallelize_3d
from executor.precision import run_in_precision
from planner.plan import Plan
from profiler.allocator import keep_freed_memory


def check_world(plan: Plan, world_size: int) -> None:
    if world_size != plan.num_devices:
        raise PlanMismatch(
            f"world size mismatch: the plan is for {plan.num_devices} devices, this run has "
            f"{world_size} processes; launch {plan.num_devices} (torchrun --nproc-per-node "
            f"{plan.num_devices}) or re-plan with devices={world_size}")


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
        keep_freed_memory()  # the memory policy the plan's layer times were measured under
    if plan.context_parallel is not None:  # every sequence split over a cp group
        check_model(model, plan, leaf_modules)
        return _in_precision(parallelize_plan(model, plan, mesh), plan)
    if plan.is_mesh_3d and plan.tracer == "export":  # stages of a decoder's own modules
        return parallelize_decoder_3d(model, plan)
    if plan.is_mesh_3d:  # pipeline x data x tensor: this rank's stage
        return parallelize_3d(model, plan, leaf_modules=leaf_modules)
    if plan.tracer == "export":
        return _in_precision(_parallelize_exported(model, plan, mesh), plan)
    return _in_precision(parallelize_graph(model, plan, mesh, leaf_modules), plan)


def _in_precision(module: nn.Module, plan: Plan) -> nn.Module:
    """The module (inside DDP, where DDP wraps it) runs its forward in the plan's precision."""
    inner = getattr(module, "module", module)  # DDP keeps the model as .module
    run_in_precision(inner, plan.training_precision, plan.mesh.device_type)
    return module


def _parallelize_exported(model: nn.Module, plan: Plan, mesh) -> nn.Module:
    """A plan from torch.export: strategies applied by module path (executor.modules)."""
    check_model(model, plan)
    model = model.to(device_of(plan))
    mesh = mesh or init_device_mesh(plan.mesh.device_type, (plan.num_devices,))
    return parallelize_modules(model, plan, mesh)
