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
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_tensor
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ParallelStyle

from executor.styles import register_style
from strategies.experts import NAME, parse_name


class ExpertParallelStyle(ParallelStyle):
    """Split an experts module's experts over the mesh, or with `ep` d below its size over
    EP groups of d consecutive ranks of a (dp, ep) mesh carved out of it (see the module
    docstring); `shard`: FSDP2-shard each rank's experts over the dp ranks that share them.

        parallelize_module(model, mesh, {"model.layers.0.mlp.experts": ExpertParallelStyle()})
    """

    def __init__(self, input_layout=Shard(0), output_layout=Shard(0), ep: int = 0,
                 shard: bool = False):
        super().__init__()
        if input_layout != Shard(0) or output_layout != Shard(0):
            raise ValueError(f"expert_parallel takes and gives each rank's rows (Shard(0)); "
                             f"got {input_layout} -> {output_layout}: re-plan")
        self.ep, self.shard = ep, shard

    def _apply(self, module: nn.Module, mesh: DeviceMesh) -> nn.Module:
        names = [n for n, _ in module.named_parameters(recurse=False)]
        experts = next(iter(module.parameters(recurse=False))).shape[0]
        ep = self.ep or mesh.size()
        if mesh.size() % ep or experts % ep:
            raise ValueError(f"expert_parallel: {experts} experts over ep {ep} of {mesh.size()} "
                             f"ranks do not split evenly; re-plan")
        ep_mesh, dp_mesh = _ep_dp(mesh, ep)
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
        if dp_mesh is not None:
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


register_style(NAME, make_expert_parallel)
