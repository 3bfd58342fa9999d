"""Run a 3-D plan (pipeline x data x tensor) with PyTorch's own engine.

In a fixed order, like torchtitan's parallelize functions:
1. the DeviceMesh (pp, dp, tp), ranks laid out as the plan's groups say;
2. this rank's stage: the traced graph cut at the plan's stage boundaries into one
   GraphModule per stage, whose inputs are the values live across the cut before it and
   whose outputs are those live across the cut after it (each value travels in the layout
   its producer gave it; the consumer's own layout changes are inside its stage);
3. tensor parallelism inside the stage over the tp sub-mesh, with the 1-D machinery of
   executor.parallelize (DTensor parallel styles and Reshard nodes); the last stage hands
   back rows and scales the output gradient by 1/(dp·tp), so every gradient reduction is
   a sum; an experts layer whose EP group is wider than tp ("expert_parallel:epK", K
   consecutive ranks of the stage) is styled over that group instead
   (executor.experts.apply_carved);
4. the schedule: torch.distributed.pipelining's PipelineStage over the pp group, one per
   chunk this rank holds (pp x chunks stages; looped r, r + pp, ... or V-shaped r,
   2pp - 1 - r, as planner.pipeline.schedules places them), run by the plan's schedule class
   (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
   ScheduleZBVZeroBubble, ScheduleDualPipeV; all divide gradients by the microbatch
   count); with one stage, a plain loop over microbatches;
5. data parallelism: after backward, each gradient is summed over the ranks that share its
   weights: the dp group for tensor-parallel and replicated layers, dp x tp for layers
   data-parallel inside the tp group. A layer the plan shards over dp (`dp_shard`) is
   FSDP2 `fully_shard` of its module over the dp sub-mesh instead (beside DTensor tensor
   parallelism over tp: a 2-D (dp, tp) mesh), which reduce-scatters its gradients itself.
   An HSDP layer (`hsdp`) is `fully_shard` over the 2-D (dp_replicate, dp_shard) mesh the
   dp dim is made of: sharded inside a node, its gradient shard all-reduced across nodes
   once per step. A carved EP group's experts are summed over the dp·tp/K ranks of the
   stage holding the same ones, in the same buckets once a step, or `fully_shard` over
   them where the plan shards the layer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.fx as fx
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.pipelining import (
    PipelineStage, Schedule1F1B, ScheduleDualPipeV, ScheduleGPipe, ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble, ScheduleZBVZeroBubble,
)
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from executor.agree import traced_as_planned
from executor.experts import (apply_carved, carved_degree, shard_carved,
                              stage_meshes)
from executor.graph_rewrite import (apply_tensor_parallel, device_of, insert_reshards,
                                   reshard_paths)
from executor.levers import apply_levers
from executor.precision import LossScaler, run_in_precision
from executor.styles import summed_params
from executor.view_outputs import (own_written_outputs, silence_safe_view_warnings,
                                   view_safety)
from strategies.collectives import DDP_BUCKET_BYTES, DDP_BUCKET_CAP_BYTES
from planner.plan import Plan
from planner.pipeline.stages import stage_ranks
from strategies.layouts import Layout

SCHEDULE_CLASSES = {"1F1B": Schedule1F1B, "GPipe": ScheduleGPipe,
                    "Interleaved1F1B": ScheduleInterleaved1F1B,
                    "InterleavedZeroBubble": ScheduleInterleavedZeroBubble,
                    "ZBVZeroBubble": ScheduleZBVZeroBubble, "DualPipeV": ScheduleDualPipeV}
MULTI_STAGE = ("Interleaved1F1B", "InterleavedZeroBubble", "ZBVZeroBubble", "DualPipeV")


def split_stages(gm: fx.GraphModule, stage_of: dict[str, int], pp: int) -> list[fx.GraphModule]:
    """One GraphModule per stage. `stage_of` maps the plan's layer nodes to stages; inputs
    belong to stage 0; other nodes (get_attr, tuple-valued calls, shape reads) are copied
    into every stage that needs them. Stage k takes, as placeholders named after their
    producers, the tensors made before it and used in it or later; it returns those made
    up to it and used after it (the last stage returns the model's output)."""
    nodes = list(gm.graph.nodes)
    owner = {}
    for n in nodes:
        if n.op == "placeholder":
            owner[n.name] = 0
        elif n.name in stage_of:
            owner[n.name] = stage_of[n.name]
    output = next(n for n in nodes if n.op == "output")

    def needed(k: int) -> tuple[set[str], set[str]]:
        """(nodes computed in stage k, tensors it receives)."""
        inside, live_in = set(), set()
        stack = [n for n in nodes if owner.get(n.name) == k and n.op != "placeholder"]
        if k == 0:
            inside |= {n.name for n in nodes if n.op == "placeholder"}
        if k == pp - 1:
            stack += [n for n in output.all_input_nodes if owner.get(n.name) is None]
        while stack:
            n = stack.pop()
            if n.name in inside:
                continue
            inside.add(n.name)
            for i in n.all_input_nodes:
                if i.name in owner and owner[i.name] != k:
                    assert owner[i.name] < k, f"{i.name} feeds an earlier stage"
                    live_in.add(i.name)
                elif i.name not in owner:
                    stack.append(i)  # a helper node: compute it here too
        if k == pp - 1:
            live_in |= {n.name for n in output.all_input_nodes
                        if n.name in owner and owner[n.name] != k}
        return inside, live_in

    plans = [needed(k) for k in range(pp)]
    order = {n.name: i for i, n in enumerate(nodes)}
    # crossing[k]: tensors made in stages <= k and needed by a later stage, in graph order
    crossing = []
    for k in range(pp - 1):
        names = set().union(*(plans[j][1] for j in range(k + 1, pp)))
        crossing.append(sorted((n for n in names if owner[n] <= k), key=order.get))

    by_name = {n.name: n for n in nodes}
    stages = []
    for k in range(pp):
        inside, _ = plans[k]
        graph = fx.Graph()
        env: dict[fx.Node, fx.Node] = {}
        inputs = crossing[k - 1] if k > 0 else [n.name for n in nodes if n.op == "placeholder"]
        for name in inputs:
            env[by_name[name]] = graph.placeholder(name)
        for n in nodes:
            if n.name in inside and n.op != "placeholder" and n.op != "output":
                env[n] = graph.node_copy(n, lambda a: env[a])
        if k == pp - 1:
            graph.output(fx.node.map_arg(output.args[0], lambda a: env[a]))
        else:
            outs = [env[by_name[name]] for name in crossing[k]]
            graph.output(outs[0] if len(outs) == 1 else tuple(outs))
        graph.lint()
        stages.append(fx.GraphModule(gm, graph, f"stage{k}"))
    return stages


def plain_tuple_output(stage: nn.Module) -> type | None:
    """A last stage whose model returns a namedtuple (Inception-v3's `InceptionOutputs`:
    its logits and its auxiliary classifier's) made to return a plain tuple, and the
    namedtuple's type, for MicrobatchLoss to hand the loss the model's own output; None,
    and the stage left as it is, for any other output. torch.distributed.pipelining takes a
    stage's output as a tensor or a plain tuple of them: anything else it wraps in a
    1-tuple, and after the backward it detaches each element (`t._is_view()`), which a
    namedtuple has not."""
    if not isinstance(stage, fx.GraphModule):
        return None
    output = next(n for n in stage.graph.nodes if n.op == "output")
    value = output.args[0]
    if isinstance(value, tuple) and type(value) is not tuple and hasattr(value, "_fields"):
        kind, fields = type(value), tuple(value)  # fx kept the namedtuple of nodes
    elif (isinstance(value, fx.Node) and value.op == "call_function"
          and isinstance(value.target, type) and issubclass(value.target, tuple)
          and hasattr(value.target, "_fields") and len(value.users) == 1):
        kind = value.target  # fx recorded the namedtuple's construction: a call
        named = dict(zip(kind._fields, value.args), **value.kwargs)
        if set(named) != set(kind._fields):
            return None  # a default left out: not rebuilt here
        fields = tuple(named[f] for f in kind._fields)
    else:
        return None
    output.args = (fields,)
    if isinstance(value, fx.Node):
        stage.graph.erase_node(value)
    stage.recompile()
    return kind


def _merged(chunks: list[fx.GraphModule]) -> nn.Module:
    """One module whose parameters are the chunks', under the model's own names (a chunk
    holds its submodules at their original paths), so a rank with two chunks names its
    parameters as the single-process model does."""
    holder = nn.Module()
    for chunk in chunks:
        for name, param in chunk.named_parameters():
            *path, leaf = name.split(".")
            owner = holder
            for part in path:
                if not hasattr(owner, part):
                    owner.add_module(part, nn.Module())
                owner = getattr(owner, part)
            owner.register_parameter(leaf, param)
    return holder


class MicrobatchLoss:
    """The loss a pipeline schedule applies to each microbatch's output on the last stage:
    the loss function of the step under way, scaled by its loss scaler under fp16.

    The schedule is built with the stages, at `parallelize`, as torchtitan builds its
    own; the loss function is first known at `executor.train_step`, which may be handed
    another one (or another optimizer, so another scaler) each step. So the schedule holds
    this object for good, and `StageModel.run_schedule` says what it computes for one step.
    """

    def __init__(self) -> None:
        self.loss_fn: Callable | None = None
        self.scaler: LossScaler | None = None
        self.output_type: type | None = None  # see plain_tuple_output

    @contextlib.contextmanager
    def using(self, loss_fn: Callable, scaler: LossScaler | None) -> Iterator[None]:
        self.loss_fn, self.scaler = loss_fn, scaler
        try:
            yield
        finally:  # the user's loss function is not kept past its step
            self.loss_fn = self.scaler = None

    def __call__(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.loss_fn is not None, "a pipeline schedule ran outside StageModel.run_schedule"
        if self.output_type is not None:
            output = self.output_type(*output)
        loss = self.loss_fn(output, target)
        return loss if self.scaler is None else self.scaler.scale(loss)


def pipeline_schedule(plan: Plan, stages: list[PipelineStage], loss_fn: Callable
                      ) -> PipelineScheduleSingle | PipelineScheduleMulti:
    """The plan's schedule over this rank's stages (one, or one per chunk for the
    multi-stage schedules), as torchtitan's build_pipeline_schedule makes it. Gradients
    stay sums over the microbatches (`scale_grads=False`): the schedule's own scaling
    divides per stage, so twice for a weight two of a rank's stages share (a tied
    embedding and head at the two ends of a V); StageModel.run_schedule divides once per
    parameter instead."""
    name = plan.pipeline.schedule
    return SCHEDULE_CLASSES[name](stages if name in MULTI_STAGE else stages[0],
                                  n_microbatches=plan.microbatches, loss_fn=loss_fn,
                                  scale_grads=False)


class StageModel(nn.Module):
    """This rank's part of a 3-D plan: its stages' modules (one per chunk, each
    tensor-parallel over its tp group), the process groups, and the schedule that runs
    them. `parameters()` are the ones this rank updates; train with `executor.train_step`.

    With more than one pipeline rank, `pipeline_stages` (one PipelineStage per chunk, over
    the pp group) and `schedule` (the plan's schedule class over them) are built here,
    with the stages; with one, both are empty and train_step runs the microbatches
    through `forward` itself."""

    def __init__(self, chunks: list[fx.GraphModule], indices: list[int], plan: Plan, mesh,
                 stage_index: int, device, stage_group, sharded: frozenset[str] = frozenset(),
                 carved: dict | None = None):
        super().__init__()
        self.chunks, self.chunk_indices = chunks, indices  # not registered: see `stage`
        self.stage = chunks[0] if len(chunks) == 1 else _merged(chunks)
        self.plan, self.mesh, self.stage_index, self.device = plan, mesh, stage_index, device
        self.pp, self.dp, self.tp = (plan.mesh.size(d) for d in ("pp", "dp", "tp"))
        num_stages = self.pp * (plan.pipeline.chunks if plan.pipeline else 1)
        self.has_first, self.has_last = 0 in indices, num_stages - 1 in indices
        self.dp_group = mesh.get_group("dp")
        self.stage_group = stage_group  # the dp x tp ranks of this stage
        self.tp_rank = mesh.get_local_rank("tp")
        self.dp_rank = mesh.get_local_rank("dp")
        # rows (or tokens) split over dp x tp: data- and sequence-parallel layers'
        # parameters (their module's or bare ones) hold partial gradients over the stage group
        split_rows = summed_params(plan) if self.tp > 1 else set()
        self.sum_over_stage, self.sum_over_dp = [], []
        # a tied embedding's and head's copies on the first and last pipeline ranks, and
        # the group of those two ranks at this (dp, tp) position (executor.hf_stages)
        self.tied_copies, self.tied_group = [], None
        # experts of an EP group wider than tp (executor.experts.apply_carved): summed over
        # the ranks of the stage holding the same experts, {id(group): (group, params)}
        self.sum_over_experts: dict[int, tuple] = {}
        carved = carved or {}
        for name, param in self.stage.named_parameters():
            if name in sharded:
                continue  # FSDP2 reduce-scatters it over dp in backward
            if name in carved:
                group = carved[name]
                if group is not None:
                    self.sum_over_experts.setdefault(id(group), (group, []))[1].append(param)
                continue
            (self.sum_over_stage if name in split_rows else self.sum_over_dp).append(param)
        self.pipeline_stages: list[PipelineStage] = []
        self.schedule: PipelineScheduleSingle | PipelineScheduleMulti | None = None
        self.microbatch_loss = MicrobatchLoss()
        if self.pp > 1:
            if self.has_last:  # the model's namedtuple output rebuilt for the loss
                self.microbatch_loss.output_type = plain_tuple_output(
                    chunks[indices.index(num_stages - 1)])
            group = mesh.get_group("pp")
            self.pipeline_stages = [PipelineStage(chunk, k, num_stages, device, group=group)
                                    for k, chunk in zip(indices, chunks)]
            self.schedule = pipeline_schedule(plan, self.pipeline_stages, self.microbatch_loss)

    def forward(self, *args):
        return self.chunks[0](*args)

    def run_schedule(self, inputs: list[torch.Tensor], targets: list[torch.Tensor],
                     loss_fn: Callable, scaler: LossScaler | None = None) -> list[torch.Tensor]:
        """Forward and backward of every microbatch through the pipeline, `loss_fn` (scaled
        by `scaler`) on the last stage's outputs. `inputs` and `targets`: this rank's rows
        of all the microbatches, in order (read on the first and the last stage). Leaves
        each gradient the mean over the microbatches; returns the last stage's losses, one
        per microbatch, as scaled (none on the other ranks)."""
        assert self.schedule is not None, "one pipeline rank: train_step runs no schedule"
        if len(targets) > 1:
            raise ValueError("batch: a pipelined plan takes one target tensor")
        losses: list[torch.Tensor] = []
        kwargs = {"target": targets[0], "losses": losses} if self.has_last else {}
        with self.microbatch_loss.using(loss_fn, scaler):
            # return_outputs=False: the last stage keeps no microbatch's output past its
            # loss (torch's output_chunks would hold all m of them through the step)
            self.schedule.step(*(inputs if self.has_first else ()), return_outputs=False,
                               **kwargs)
        # each parameter once, though two of this rank's stages may share it
        shared = {id(p): p for s in self.pipeline_stages for p in s.submod.parameters()}
        for p in shared.values():
            if p.grad is not None:
                p.grad.div_(self.plan.microbatches)
        return losses

    def tie(self, copies: list[nn.Parameter], group) -> None:
        """Sum the gradients of `copies` (a tied weight's, held on the first and the last
        pipeline rank) over `group` after the dp sums (executor.hf_stages)."""
        self.tied_copies, self.tied_group = copies, group

    @property
    def is_last(self) -> bool:
        """This rank computes the loss (holds the last stage)."""
        return self.has_last

    def sync_gradients(self) -> None:
        """Sum each gradient over the ranks that hold a copy of its weights, in DDP's
        buckets (what planner.price charges: one all-reduce per bucket, not per weight):
        over dp, over the stage's dp x tp, and a carved EP group's experts over the ranks
        holding the same ones."""
        sums = [(self.sum_over_dp, self.dp_group, self.dp),
                (self.sum_over_stage, self.stage_group, self.dp * self.tp)]
        sums += [(params, group, dist.get_world_size(group))
                 for group, params in self.sum_over_experts.values()]
        for params, group, size in sums:
            if size > 1:
                sum_in_buckets(_local_grads(params), group)
        if self.tied_group is not None:  # after the dp sums: the two copies' totals added
            for p in self.tied_copies:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                g = p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad
                dist.all_reduce(g, group=self.tied_group)


def _local_grads(params: list[nn.Parameter]) -> list[torch.Tensor]:
    """Each parameter's gradient as the plain tensor this rank holds (a DTensor's local
    shard), zeros where backward left none: every rank of a group sums the same list."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad._local_tensor if isinstance(p.grad, DTensor) else p.grad)
    return grads


def sum_in_buckets(grads: list[torch.Tensor], group) -> None:
    """All-reduce (sum) `grads` in place over `group` as DDP packs them: in reverse order
    (backward's), into flat buckets of one dtype, the first up to 1 MB, the rest up to
    25 MB; one collective per bucket."""
    bucket: list[torch.Tensor] = []
    size, cap = 0, DDP_BUCKET_BYTES

    def flush() -> None:
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        for g, summed in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            g.copy_(summed)

    for g in reversed(grads):
        nbytes = g.numel() * g.element_size()
        if bucket and (g.dtype != bucket[0].dtype or size + nbytes > cap):
            flush()
            bucket, size, cap = [], 0, DDP_BUCKET_CAP_BYTES
        bucket.append(g)
        size += nbytes
    if bucket:
        flush()


def parallelize_3d(model: nn.Module, plan: Plan, *, leaf_modules=()) -> StageModel:
    """This rank's StageModel under a 3-D `plan`; every rank calls it with the same model."""
    gm = traced_as_planned(model, plan, leaf_modules)
    device = device_of(plan)
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    mesh, stage_index, stage_groups, num_stages, mine = pipeline_ranks(plan)

    stage_of = {l.node: l.stage for l in plan.layers}
    split = split_stages(gm, stage_of, num_stages)
    layers = {l.node: l for l in plan.layers}
    gives = {i.name: (Layout(i.layout), i.shape) for i in plan.inputs}
    gives.update({l.node: (Layout(l.output_layout), l.output_shape) for l in plan.layers})
    gives = {k: (layout, _rows(shape, plan)) for k, (layout, shape) in gives.items()}
    tp_mesh = mesh["tp"]
    called = {n.name: str(n.target) for n in gm.graph.nodes if n.op == "call_module"}
    # every rank makes every carved EP group's, in one order
    meshes = stage_meshes(plan, lambda layer: gm.get_submodule(called[layer.node])
                          if layer.node in called else None)
    modules = []
    sharded: set[str] = set()
    carved: dict = {}
    views: dict[str, bool] = {}  # FSDP2's view warning: every chunk's verdict, then silenced
    for k in mine:
        module = split[k].to(device)
        experts = carved_calls(module, layers, tp)
        parallel = apply_tensor_parallel(module, tp_mesh, layers, gives,
                                         skip={layer.node for _, layer in experts})
        carved.update(apply_carved(module, experts, meshes, tp))
        insert_reshards(module, tp_mesh, layers, gives, microbatch_rows(plan),
                         final=k == num_stages - 1, mean_over=dp * tp)
        own_written_outputs(module, parallel | {path for path, _ in experts}
                            | reshard_paths(module))
        marked = [(path, layer) for path, layer in dp_sharded(module, layers)
                  if not carved_degree(layer, tp)]
        views = view_safety(module, [path for path, _ in marked]
                            + [path for path, layer in experts if layer.dp_shard], views)
        sharded |= shard_carved(module, experts, meshes, tp, plan.training_precision)
        sharded |= shard_modules(module, marked, mesh, plan)
        # under autocast; outputs sent on in the compute dtype, the last stage's in fp32
        run_in_precision(module, plan.training_precision, plan.mesh.device_type,
                         last=k == num_stages - 1)
        modules.append(module)

    silence_safe_view_warnings(views)
    return staged(modules, mine, plan, mesh, stage_index, device, stage_groups[stage_index],
                  sharded, carved)


def carved_calls(module: fx.GraphModule, layers: dict, tp: int) -> list:
    """(module path, LayerPlan) of each experts module of this stage whose EP group is
    wider than tp (executor.experts.carved_degree), once however often it is called:
    styled over its stage's EP group, not the tp sub-mesh."""
    return list({str(n.target): layers[n.name] for n in module.graph.nodes
                 if n.op == "call_module" and n.name in layers
                 and carved_degree(layers[n.name], tp)}.items())


def pipeline_ranks(plan: Plan):
    """(mesh, this rank's pipeline rank, every pipeline rank's group, number of stages,
    the stages this rank holds) under a 3-D plan: what fx and decoder stages both set up
    first. Every rank creates every stage's group, in the same order."""
    pp, dp, tp = (plan.mesh.size(d) for d in ("pp", "dp", "tp"))
    mesh = _device_mesh(plan.mesh.device_type, pp, dp, tp, plan.mesh.dp_shard_ranks)
    stage_index = dist.get_rank() // (dp * tp)
    stage_groups = [dist.new_group(list(range(k * dp * tp, (k + 1) * dp * tp)))
                    for k in range(pp)]
    chunks = plan.pipeline.chunks if plan.pipeline else 1
    schedule = plan.pipeline.schedule if plan.pipeline else "1F1B"
    num_stages = pp * chunks
    ranks_of = stage_ranks(schedule, pp, chunks)
    mine = [k for k in range(num_stages) if ranks_of[k] == stage_index]
    return mesh, stage_index, stage_groups, num_stages, mine


def embedding_group(plan: Plan, first: int, last: int):
    """Megatron-LM's embedding group: for each (dp, tp) position, the ranks of pipeline
    ranks `first` and `last` there, whose copies of a tied weight sum their gradients.
    Returns this rank's group (None where it is on neither). Every rank creates every
    position's group, in the same order (rank = (p·dp + d)·tp + t, as pipeline_ranks)."""
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    mine = None
    for d in range(dp):
        for t in range(tp):
            ranks = [(first * dp + d) * tp + t, (last * dp + d) * tp + t]
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                mine = group
    return mine


def _device_mesh(device_type: str, pp: int, dp: int, tp: int, shard_ranks: int):
    """The (pp, dp, tp) DeviceMesh. With HSDP layers (`shard_ranks` > 1) the dp dim is
    made as (dp_replicate, dp_shard) and flattened back into "dp", as torchtitan's
    ParallelDims does, so mesh["dp"] serves the rest and mesh["dp_replicate", "dp_shard"]
    the HSDP layers; the ranks are the same (d = replicate_index * shard_ranks + shard_index)."""
    if shard_ranks == 1:
        return init_device_mesh(device_type, (pp, dp, tp), mesh_dim_names=("pp", "dp", "tp"))
    mesh = init_device_mesh(device_type, (pp, dp // shard_ranks, shard_ranks, tp),
                            mesh_dim_names=("pp", "dp_replicate", "dp_shard", "tp"))
    mesh["dp_replicate", "dp_shard"]._flatten("dp")
    return mesh


def staged(modules: list, mine: list[int], plan: Plan, mesh, stage_index: int, device,
           stage_group, sharded: set[str], carved: dict | None = None) -> "StageModel":
    """This rank's StageModel over its stage modules (fx stages and a decoder's alike),
    its pipeline stages and schedule built with it; `carved`: executor.experts.apply_carved's
    {parameter: group summing it}."""
    return StageModel(modules, mine, plan, mesh, stage_index, device, stage_group,
                      frozenset(sharded), carved)


def dp_sharded(module: fx.GraphModule, layers: dict) -> list:
    """(module path, LayerPlan) of each module of this stage the plan marks `dp_shard`:
    what `shard_modules` fully_shards over the dp sub-mesh (after tensor parallelism, so
    its DTensor params shard on the (dp, tp) mesh; gradients summed, as executor.levers
    sets it: the output gradient already carries 1/(dp·tp))."""
    return [(str(n.target), layers[n.name]) for n in module.graph.nodes
            if n.op == "call_module" and n.name in layers and layers[n.name].dp_shard]


def shard_modules(root: nn.Module, marked: list, mesh, plan: Plan) -> set[str]:
    """`fully_shard` each (module path, LayerPlan) of `marked`: over mesh["dp"], or for an
    HSDP layer over mesh["dp_replicate", "dp_shard"] with its cross-node all-reduce on the
    step's last microbatch only. Returns the names of the parameters FSDP now owns."""
    owned: set[str] = set()
    for path, layer in marked:
        over = mesh["dp_replicate", "dp_shard"] if layer.hsdp else mesh["dp"]
        owned |= apply_levers(root, [(path, "fsdp", False)], over, plan.training_precision)
        if layer.hsdp:
            all_reduce_once_per_step(root.get_submodule(path), plan.microbatches)
    return owned


def all_reduce_once_per_step(module: nn.Module, microbatches: int) -> None:
    """HSDP gradient accumulation: FSDP2 all-reduces the reduce-scattered gradient shard
    over the replicas after every backward unless told not to; ask for it at the step's
    last backward through `module` only (the earlier shards accumulate inside FSDP2), in
    whatever order the schedule runs the microbatches."""
    seen = [0]

    def before_backward(mod, grad_output):
        seen[0] = seen[0] % microbatches + 1
        mod.set_requires_all_reduce(seen[0] == microbatches, recurse=False)

    module.register_full_backward_pre_hook(before_backward)


def microbatch_rows(plan: Plan) -> int:
    """Rows of one microbatch of one dp replica."""
    return plan.global_batch // (plan.mesh.size("dp") * plan.microbatches)


def _rows(shape, plan: Plan) -> list[int]:
    """A global shape at one microbatch of one dp replica: batch-sized dims shrink."""
    shape = list(shape)
    if shape and shape[0] == plan.global_batch:
        shape[0] = microbatch_rows(plan)
    return shape
