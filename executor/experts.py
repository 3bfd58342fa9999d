"""Expert parallelism as a parallel style: the experts of one mixture-of-experts module
split over the mesh, tokens dispatched to them and combined back with all-to-all.

Rank r keeps experts [r·E/P, (r+1)·E/P) of each stacked weight, as a DTensor sharded on
dim 0 (so `executor.full_parameters` reassembles them and the optimizer steps each rank's
own). A call with this rank's rows (tokens x hidden, top-k indices and weights):

1. each (token, expert) pair is sorted by expert, so the pairs for rank q are contiguous;
   the counts per rank and the pairs' local expert ids go out by a plain all-to-all;
2. the pairs' hidden states go out by `all_to_all_single_autograd` (uneven splits), whose
   backward is the reverse all-to-all;
3. the module's *own* forward runs on what arrived, with its local expert shard, the
   local ids and weights of one: every family's math (biases, gpt-oss's clamped gate,
   transposed weights, the eager/grouped_mm/batched_mm choice) stays the module's;
4. the outputs return by the reverse all-to-all, are put back in token order, weighted by
   the router's weights and summed over each token's k experts (the last two ops of every
   family's own forward, here after the return so the weights' gradient stays local).

No gradient sync follows: every token that used an expert came to its rank, and the
output gradient already carries 1/world (executor.styles.MeanOverRanks), so the expert's
gradient is DDP's mean.

With a degree below the world ("expert_parallel:ep2", strategies.experts), the EP groups
are d consecutive ranks of a (dp, ep) mesh over the world, as torchtitan carves them out
of the data-parallel ranks: the all-to-alls run inside one EP group, and each expert is
held by the world/d ranks of its column, which sum its gradient after each backward (a
hook, so microbatches still accumulate), or with ":fsdp" hold it FSDP2-sharded over them
(`fully_shard` on the dp sub-mesh, its reduce a plain sum: gloo has no PREMUL_SUM).
`make_expert_parallel` is registered as the "expert_parallel"
style, which executor.modules (and executor.graph_rewrite, for a registered fx block)
apply like any model-parallel layer's.

On a 3-D plan (pp, dp, tp) an EP group wider than the layer's tp group ("expert_parallel:epK",
K = tp·e, planner.expert_degrees) spans K consecutive ranks of its stage: `stage_meshes`
makes the (pp, dp·tp/K, K) mesh of the world on every rank (each stage's ranks carved as
`_ep_dp` carves a 1-D world), and `apply_carved` styles the layer over its stage's EP
group. Its gradient is summed over the ranks holding the same experts by the stage's own
once-a-step sync (executor.pipeline.StageModel.sync_gradients, in DDP's buckets: not a
hook per microbatch), or its experts are FSDP2-sharded over them (the layer's `dp_shard`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from executor.levers import apply_levers
from executor.styles import register_style
from strategies.experts import NAME, parse_name


class ExpertParallelStyle(ParallelStyle):
    """Split an experts module's experts over the mesh, or with `ep` d below its size over
    EP groups of d consecutive ranks of a (dp, ep) mesh carved out of it (see the module
    docstring); `shard`: FSDP2-shard each rank's experts over the dp ranks that share them.

        parallelize_module(model, mesh, {"model.layers.0.mlp.experts": ExpertParallelStyle()})
    """

    def __init__(self, input_layout=Shard(0), output_layout=Shard(0), ep: int = 0,
                 shard: bool = False, meshes: tuple | None = None):
        """`meshes`: (EP mesh, mesh of the ranks sharing its experts) made by the caller
        (`apply_carved`, a 3-D plan's stage), who then sums or shards the experts over the
        latter itself; None: carved out of the mesh `_apply` is given, synced here."""
        super().__init__()
        if input_layout != Shard(0) or output_layout != Shard(0):
            raise ValueError(f"expert_parallel takes and gives each rank's rows (Shard(0)); "
                             f"got {input_layout} -> {output_layout}: re-plan")
        self.ep, self.shard, self.meshes = ep, shard, meshes

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        experts = next(iter(module.parameters(recurse=False))).shape[0]
        ep = self.ep or mesh.size()
        ranks = self.meshes[0].size() if self.meshes else mesh.size()
        if ranks % ep or experts % ep:
            raise ValueError(f"expert_parallel: {experts} experts over ep {ep} of {ranks} "
                             f"ranks do not split evenly; re-plan")
        ep_mesh, dp_mesh = self.meshes or _ep_dp(mesh, ep)
        for name in names:
            param = getattr(module, name)
            module.register_parameter(name, nn.Parameter(
                distribute_tensor(param.data, ep_mesh, [Shard(0)]), requires_grad=param.requires_grad))
        local = experts // ep
        group = ep_mesh.get_group()
        own_forward = module.forward

        def forward(hidden_states, top_k_index, top_k_weights):
            shards = {n: getattr(module, n).to_local() for n in names}
            return _dispatch_combine(module, own_forward, shards, local, group,
                                     hidden_states, top_k_index, top_k_weights)

        module.forward = forward
        module.num_experts = local  # what its own forward sizes its one-hot and histc by
        if dp_mesh is not None and self.meshes is None:
            _over_dp(module, dp_mesh, self.shard)
        return module


def _ep_dp(mesh: DeviceMesh, ep: int) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the EP group's mesh, the dp mesh of the ranks sharing its experts, None where ep is
    the whole mesh): the (dp, ep) mesh of `mesh`'s ranks, EP groups consecutive, as
    torchtitan carves EP out of its data-parallel ranks. Made once per (mesh, ep): every
    experts module of a plan shares its process groups."""
    if ep == mesh.size():
        return mesh, None
    key = (id(dist.group.WORLD), tuple(mesh.mesh.flatten().tolist()), ep)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(mesh.device_type, mesh.mesh.reshape(-1, ep),
                                  mesh_dim_names=("dp", "ep"))
    both = _MESHES[key]
    return both["ep"], both["dp"]


_MESHES: dict[tuple, DeviceMesh] = {}


def _over_dp(module: nn.Module, dp_mesh: DeviceMesh, shard: bool) -> None:
    """The dp ranks that hold the same experts: with `shard`, FSDP2 over them (weights
    gathered around the call, gradients reduce-scattered); else each backward's gradient
    all-reduced over them. Summed either way: the output gradient already carries 1/world
    (executor.styles.MeanOverRanks)."""
    if shard:
        fully_shard(module, mesh=dp_mesh, reshard_after_forward=True)
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
        return
    group = dp_mesh.get_group()

    def summed(grad):
        dist.all_reduce(grad.to_local(), group=group)  # the local shard, in place
        return grad

    for param in module.parameters(recurse=False):
        if param.requires_grad:
            param.register_hook(summed)


def _dispatch_combine(module, own_forward, shards, local: int, group, hidden, index, weights):
    ranks = dist.get_world_size(group)
    k = index.shape[-1]
    x = hidden.reshape(-1, hidden.shape[-1])  # tokens x hidden, whatever dims lead
    tokens = x.shape[0]
    weights = weights.reshape(tokens, k)
    flat = index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    expert = flat[order]
    owner = torch.div(expert, local, rounding_mode="floor")
    send = torch.bincount(owner, minlength=ranks)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=group)
    send_sizes, recv_sizes = send.tolist(), recv.tolist()
    local_ids = torch.empty(sum(recv_sizes), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(local_ids, (expert - owner * local).contiguous(), recv_sizes,
                           send_sizes, group=group)
    pairs = x[torch.div(order, k, rounding_mode="floor")]
    arrived = all_to_all_single_autograd(pairs, recv_sizes, send_sizes, group)
    ones = torch.ones(local_ids.shape[0], 1, dtype=weights.dtype, device=weights.device)
    out = _own(module, own_forward, shards, arrived, local_ids.unsqueeze(1), ones)
    back = all_to_all_single_autograd(out, send_sizes, recv_sizes, group)
    in_order = torch.empty_like(back).index_copy(0, order, back)
    combined = (in_order.view(tokens, k, -1) * weights.unsqueeze(-1).to(in_order.dtype)).sum(1)
    return combined.to(hidden.dtype).view_as(hidden)


def _own(module, own_forward, shards, x, index, weights):
    """The module's own forward over its local expert shard: its parameters stand in as
    the plain local tensors for this call (not through `module(...)`, whose hooks the
    outer call already ran)."""
    saved = {n: module._parameters[n] for n in shards}
    module._parameters.update(shards)
    try:
        return own_forward(x, index, weights)
    finally:
        module._parameters.update(saved)


def make_expert_parallel(module: nn.Module, input_placement, output_placement,
                         strategy: str = NAME) -> ParallelStyle:
    """The style of a plan's expert-parallel strategy, its degree read from its name
    (strategies.experts.strategy_name)."""
    ep, shard = parse_name(strategy)
    return ExpertParallelStyle(input_placement, output_placement, ep, shard)


def carved_degree(layer, tp: int) -> int:
    """K of a 3-D plan's layer whose EP group is wider than its tp group of `tp` ranks
    ("expert_parallel:epK", K > tp: carved out of its stage's dp x tp ranks), 0 for any
    other (an EP group inside the tp group runs as a tensor-parallel style over it)."""
    parsed = parse_name(layer.strategy)
    return parsed[0] if parsed is not None and parsed[0] > tp else 0


def stage_meshes(plan, module_of) -> dict[int, tuple[DeviceMesh, DeviceMesh]]:
    """{K: (this rank's EP group of K consecutive ranks of its stage, the ranks of its
    stage holding the same experts)} for every K of `plan`'s carved layers
    (`carved_degree`). Process groups are made by every rank in one order, so every rank
    makes every K's, whichever stage holds the layer; first every carved layer the
    executor cannot run is refused by name, on every rank alike (`module_of(layer)`: its
    experts module, None where it is none)."""
    pp, dp, tp = (plan.mesh.size(d) for d in ("pp", "dp", "tp"))
    degrees = set()
    for layer in plan.layers:
        ep = carved_degree(layer, tp)
        if ep:
            _check_carved(layer, ep, dp, tp, module_of(layer))
            degrees.add(ep)
    return {ep: _stage_ep_dp(plan.mesh.device_type, pp, dp * tp, ep) for ep in sorted(degrees)}


def _check_carved(layer, ep: int, dp: int, tp: int, module: nn.Module | None) -> None:
    """Refuse, naming the layer and the fix, what a carved EP group cannot be: a degree
    that does not split its stage's ranks into whole groups or its experts evenly, HSDP
    of its experts, inputs and outputs other than each rank's rows, or no module."""
    experts = next(module.parameters(recurse=False)).shape[0] if module is not None else 0
    if (dp * tp) % ep:
        why = (f", which do not divide its stage's dp x tp = {dp * tp} ranks into whole EP "
               f"groups; re-plan with a degree tp·e for e dividing dp (planner.expert_degrees)")
    elif module is None:
        why = " but is no experts module of this model; re-plan with this hyplan"
    elif experts % ep:
        why = (f", which do not split its {experts} experts evenly; re-plan with a degree "
               f"dividing {experts}")
    elif layer.hsdp:
        why = (f" with its experts HSDP-sharded over the ranks holding them, which the 3-D "
               f"executor does not run; re-plan it '{layer.strategy}+fsdp' or replicated")
    elif layer.input_layout != "batch" or layer.output_layout != "batch":
        why = (f", which takes and gives each rank's rows, but it is planned "
               f"{layer.input_layout} -> {layer.output_layout}; re-plan with this hyplan")
    else:
        return
    raise ValueError(f"plan: layer {layer.name!r} runs expert parallel over {ep} ranks{why}")


def _stage_ep_dp(device_type: str, pp: int, ranks: int, ep: int):
    """(EP mesh, mesh of the ranks sharing its experts) of this rank: the world as a
    (pp, ranks/ep, ep) mesh, each stage's `ranks` carved as `_ep_dp` carves a 1-D world
    (EP groups of `ep` consecutive ranks; rank = p·ranks + stage-local rank). Made once
    per shape and degree: the plans of one process share its process groups."""
    key = (id(dist.group.WORLD), "stages", pp, ranks, ep)
    if key not in _MESHES:
        _MESHES[key] = DeviceMesh(device_type, torch.arange(pp * ranks).reshape(pp, -1, ep),
                                  mesh_dim_names=("pp", "dp", "ep"))
    both = _MESHES[key]
    return both["ep"], both["dp"]


def apply_carved(root: nn.Module, targets: list, meshes: dict, tp: int) -> dict[str, object]:
    """Style each (module path, LayerPlan) of `targets` (carved layers of one stage) over
    its EP group (`meshes`: `stage_meshes`). Returns {name: the group to sum its gradient
    over once a step, or None where its one holder has it whole} of the parameters of the
    layers not sharded over their holders (`shard_carved` shards the others): out of the
    stage's sums over dp either way (executor.pipeline.StageModel)."""
    summed: dict[str, object] = {}
    for path, layer in targets:
        ep = carved_degree(layer, tp)
        module = root.get_submodule(path)
        parallelize_module(root, meshes[ep][0], {path: ExpertParallelStyle(ep=ep,
                                                                           meshes=meshes[ep])})
        holders = meshes[ep][1]
        if not _sharded(layer, holders):
            group = holders.get_group() if holders.size() > 1 else None
            summed.update(dict.fromkeys((f"{path}.{n}" for n, _ in module.named_parameters()),
                                        group))
    return summed


def shard_carved(root: nn.Module, targets: list, meshes: dict, tp: int,
                 precision=None) -> set[str]:
    """FSDP2 over the ranks holding the same experts, for each carved layer of `targets`
    the plan shards (`dp_shard`), as executor.levers shards any layer (in `precision`,
    gradients summed); after `apply_carved` and the FSDP2 view-warning verdicts
    (fully_shard renames the class). Returns the names of the parameters FSDP now owns."""
    owned: set[str] = set()
    for path, layer in targets:
        holders = meshes[carved_degree(layer, tp)][1]
        if _sharded(layer, holders):
            owned |= apply_levers(root, [(path, "fsdp", False)], holders, precision)
    return owned


def _sharded(layer, holders: DeviceMesh) -> bool:
    """Does the plan shard the layer's experts over their holders (more than one)?"""
    return bool(layer.dp_shard) and holders.size() > 1


register_style(NAME, make_expert_parallel)
