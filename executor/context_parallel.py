"""Context parallelism: each rank of a CP group holds part of every sequence, and attention
gathers the keys and values of the whole sequence from the group (as Llama 3's own
training did), because torch 2.13's `context_parallel` refuses CPU attention
(`aten._scaled_dot_product_flash_attention_for_cpu` has no sharding strategy).

The sequence is cut into 2·cp chunks and rank r of the group keeps chunks r and 2cp-1-r
(torch's and torchtitan's head-tail load balancer): under a causal mask chunk i attends to
i+1 chunks, so every rank's pair costs the same (2cp+1 chunks of keys). Everything that is
per token (input ids, position ids, labels, a position buffer) is split the same way;
labels are shifted *before* the split (`shift_labels`), so a target at a chunk boundary
stays with its token. Inside attention the local keys and values are all-gathered over the
group (`all_gather_single_autograd`: its backward reduce-scatters their gradients) and the
local queries attend to them under the causal mask written in global positions.

`apply(model, mesh)` does it for a Hugging Face Llama-family model (an attention function
registered with transformers' `AttentionInterface`) or for a model torch.fx traces whose
attention calls `F.scaled_dot_product_attention` (the call replaced by `GatheredAttention`),
then wraps the model in DDP over the whole mesh (cp x dp): every rank's weights see only
its tokens, so their gradients are averaged as data parallelism's are. Weights may instead
be FSDP2-sharded over the whole mesh (`sharded`), which averages the same gradients, and a
plan may shard some layers only (the 3-D search picks FSDP per layer): then FSDP2 holds
those layers' modules, without the root, and DDP the rest, told to ignore the parameters
FSDP2 made DTensors (as executor.styles.data_parallel_over does beside FSDP2 layers), so
`backward()` alone leaves every gradient averaged. With the loss of `token_loss`, a step
equals one process's step on the whole batch::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = apply(model, mesh)  # a transformers Llama; ids: the global (batch, seq)
    logits = model(shard(mesh, ids), position_ids=positions(mesh, ids.shape[1])).logits
    token_loss(logits, shard(mesh, shift_labels(ids)), mesh).backward()

Causal attention only, without padding masks, dropout or sliding windows (each refused
with a message). A Plan that says cp (planner.baseline(..., "cp"): `Plan.context_parallel`)
reaches it through `executor.parallelize` (`parallelize_plan` here), its inputs split by
`executor.shard_batch` (`shard_for_plan`)::

    model = executor.parallelize(model, plan)
    ids, labels = executor.shard_batch(plan, (ids, shift_labels(ids)))
    token_loss(model(ids).logits, labels).backward()
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from executor.levers import checkpoint_module

IGNORE_INDEX = -100  # the label cross-entropy skips: the last token has no next one
ATTENTION_NAME = "hyplan_context_parallel"  # the attention function's key in transformers


def split_sequence(tensor: torch.Tensor, rank: int, cp: int, dim: int = 1) -> torch.Tensor:
    """Rank `rank`'s part of `tensor` along `dim` under the head-tail balance: chunks rank
    and 2cp-1-rank of 2cp, concatenated."""
    if tensor.shape[dim] % (2 * cp):
        raise ValueError(f"context parallel: a sequence of {tensor.shape[dim]} tokens does not "
                         f"split into 2·cp = {2 * cp} equal chunks; pad it to a multiple of "
                         f"{2 * cp} or choose another cp")
    chunks = tensor.chunk(2 * cp, dim)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim)


def join_sequence(parts: list[torch.Tensor], dim: int = 1) -> torch.Tensor:
    """The inverse of `split_sequence`: the whole tensor from every rank's part, in rank
    order."""
    cp = len(parts)
    chunks: list[torch.Tensor | None] = [None] * (2 * cp)
    for rank, part in enumerate(parts):
        chunks[rank], chunks[2 * cp - 1 - rank] = part.chunk(2, dim)
    return torch.cat(chunks, dim)


def shift_labels(ids: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Next-token targets of `ids` (batch, seq) in place of each token, the last one
    ignored: shifted on the whole sequence, before `shard` splits it, since after the split
    a rank's last token's target lives on another rank."""
    return torch.cat([ids[:, 1:], torch.full_like(ids[:, :1], ignore_index)], 1)


def _cp_dim(mesh: DeviceMesh) -> tuple[DeviceMesh, DeviceMesh | None]:
    """(the cp sub-mesh, the dp sub-mesh or None) of a mesh named ("cp",) or ("dp", "cp")."""
    names = mesh.mesh_dim_names or ()
    if names not in (("cp",), ("dp", "cp")):
        raise ValueError(f"context parallel: the mesh's dims are named {names}; make it with "
                         f"mesh_dim_names=('cp',) or ('dp', 'cp')")
    return mesh["cp"], (mesh["dp"] if "dp" in names else None)


def shard(mesh: DeviceMesh, tensor: torch.Tensor, seq_dim: int = 1) -> torch.Tensor:
    """This rank's part of a global batch tensor: rows split over "dp" (where the mesh has
    it), the sequence over "cp" with the head-tail balance."""
    cp_mesh, dp_mesh = _cp_dim(mesh)
    if dp_mesh is not None:
        if tensor.shape[0] % dp_mesh.size():
            raise ValueError(f"context parallel: {tensor.shape[0]} rows do not split over dp "
                             f"{dp_mesh.size()}; pass a batch whose rows divide by it")
        tensor = tensor.chunk(dp_mesh.size())[dp_mesh.get_local_rank()]
    return split_sequence(tensor, cp_mesh.get_local_rank(), cp_mesh.size(), seq_dim)


def positions(mesh: DeviceMesh, seq: int, rows: int = 1) -> torch.Tensor:
    """The global positions (rows, seq / cp) of this rank's tokens: the position ids a
    model must be given, since it would number its local tokens from 0."""
    cp_mesh, _ = _cp_dim(mesh)
    whole = torch.arange(seq).expand(rows, seq)
    return split_sequence(whole, cp_mesh.get_local_rank(), cp_mesh.size(), 1)


def token_loss(logits: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh | None = None
               ) -> torch.Tensor:
    """Cross-entropy over this rank's tokens, as the whole batch's mean would count them:
    its sum over the targets the whole mesh has (ignored ones aside), times the mesh size,
    so DDP's (or FSDP's) gradient mean gives the one-process gradient even where ranks hold
    different numbers of targets (the last token's is ignored). `mesh`: None where it is
    every rank (a cp Plan's)."""
    # at least float32 (bfloat16 logits), never below the model's own precision
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    summed = F.cross_entropy(wide.flatten(0, -2), labels.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum().to(torch.float64)
    group = _whole_group(mesh) if mesh is not None else None
    dist.all_reduce(count, group=group)
    size = mesh.size() if mesh is not None else dist.get_world_size()
    return summed * size / count.clamp(min=1).to(summed.dtype)


def gathered_attention(query, key, value, group, *, scale=None, causal=True):
    """Attention of this rank's queries (batch, heads, s, d) to the keys and values of the
    whole sequence, gathered over `group`; the causal mask is written in global positions
    (the head-tail chunks of each rank). Keys may have fewer heads (grouped-query)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    if cp == 1:  # every sequence whole: the kernel's own causal mask (flash on a GPU)
        return F.scaled_dot_product_attention(query, key, value, is_causal=causal,
                                              scale=scale,
                                              enable_gqa=key.shape[1] != query.shape[1])
    keys = all_gather_single_autograd(key.contiguous(), 2, group)
    values = all_gather_single_autograd(value.contiguous(), 2, group)
    mask = None
    if causal:
        whole = torch.arange(query.shape[2] * cp, device=query.device)
        mine = split_sequence(whole, rank, cp, 0)
        theirs = torch.cat([split_sequence(whole, r, cp, 0) for r in range(cp)])
        mask = mine[:, None] >= theirs[None, :]
    # grouped-query heads are gathered as they are (fewer bytes moved) and shared by SDPA
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scale,
                                          enable_gqa=keys.shape[1] != query.shape[1])


class GatheredAttention(nn.Module):
    """`F.scaled_dot_product_attention` under context parallelism: what an fx graph's
    attention call is replaced by (`gathered_attention` over the module's group)."""

    def __init__(self, group):
        super().__init__()
        self.group = group

    def forward(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                scale=None, enable_gqa=False):
        if attn_mask is not None or dropout_p:
            raise ValueError("context parallel: an attention with an explicit mask or dropout "
                             "cannot be split by sequence here; pass is_causal=True (or no "
                             "mask) and dropout_p=0")
        return gathered_attention(query, key, value, self.group, scale=scale,
                                  causal=is_causal)


def _hf_attention(group):
    """The attention function transformers calls under ATTENTION_NAME (its sdpa's
    signature and output layout: batch, seq, heads, d)."""
    def attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                  **kwargs):
        if getattr(module, "sliding_window", None) or not getattr(module, "is_causal", True):
            raise ValueError(f"context parallel: {type(module).__name__} is not plainly "
                             f"causal (a sliding window or bidirectional); only causal "
                             f"attention is split by sequence")
        if dropout:
            raise ValueError(f"context parallel: attention dropout {dropout} is not split by "
                             f"sequence here; set the config's attention_dropout=0")
        out = gathered_attention(query, key, value, group, scale=scaling, causal=True)
        return out.transpose(1, 2).contiguous(), None
    return attention


def _apply_hf(model: nn.Module, group) -> nn.Module:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _hf_attention(group))
    model.set_attn_implementation(ATTENTION_NAME)
    model.register_forward_pre_hook(_global_positions(group), with_kwargs=True)
    return model


def _global_positions(group):
    """A forward pre-hook: refuses a padding mask (transformers builds no mask for a
    registered attention function, so it would be dropped without a word) and, where no
    position_ids are given, passes the global positions of this rank's tokens (the model
    would number them from 0)."""
    def hook(module, args, kwargs):
        if kwargs.get("attention_mask") is not None:
            raise ValueError("context parallel: attention_mask is not split by sequence "
                             "here; pack sequences without padding and pass no "
                             "attention_mask")
        if kwargs.get("position_ids") is None:
            ids = args[0] if args else kwargs["input_ids"]
            cp, rank = dist.get_world_size(group), dist.get_rank(group)
            whole = torch.arange(ids.shape[1] * cp, device=ids.device)
            kwargs["position_ids"] = split_sequence(whole, rank, cp, 0).expand(ids.shape[0], -1)
        return args, kwargs
    return hook


def _apply_fx(model: nn.Module, group) -> nn.Module:
    """The model traced by torch.fx, its attention calls replaced by `GatheredAttention`."""
    graph_module = fx.symbolic_trace(model)
    calls = [n for n in graph_module.graph.nodes
             if n.op == "call_function" and n.target is F.scaled_dot_product_attention]
    if not calls:
        raise ValueError(f"context parallel: {type(model).__name__} traced by torch.fx calls "
                         f"no F.scaled_dot_product_attention; write its attention with it")
    graph_module.add_submodule("context_parallel_attention", GatheredAttention(group))
    for node in calls:
        node.op, node.target = "call_module", "context_parallel_attention"
    graph_module.recompile()
    return graph_module


def _split_buffers(model: nn.Module, sequence_buffers: dict[str, int], cp_mesh) -> None:
    """Per-token buffers (a position table's index) split like the inputs."""
    for name, dim in sequence_buffers.items():
        try:
            buffer = model.get_buffer(name)
        except AttributeError:
            raise ValueError(f"context parallel: sequence_buffers names {name!r}, which "
                             f"{type(model).__name__} has no buffer of; name one of "
                             f"{[n for n, _ in model.named_buffers()]}") from None
        owner, _, leaf = name.rpartition(".")
        model.get_submodule(owner).register_buffer(
            leaf, split_sequence(buffer, cp_mesh.get_local_rank(), cp_mesh.size(), dim),
            persistent=False)


def _whole_group(mesh: DeviceMesh):
    """The process group of every rank of the mesh (cp x dp together)."""
    if mesh.ndim == 1:
        return mesh.get_group()
    return mesh._flatten().get_group()


def apply(model: nn.Module, mesh: DeviceMesh, *, sequence_buffers: dict[str, int] | None = None,
          sharded: bool | list[str] = False) -> nn.Module:
    """This rank's `model` under context parallelism over `mesh` (dims ("cp",) or ("dp",
    "cp")): a transformers model gets the gathered attention by name (and its tokens'
    global positions where none are passed), any other model is traced by torch.fx;
    `sequence_buffers` names buffers indexed by position (GPT's `positions`) and the dim to
    split them on. `sharded`: False, DDP over the whole mesh; True, every module that owns
    weights FSDP2-sharded over it; a list of module paths, those modules sharded and the
    rest under DDP. Call on every rank with the same weights; feed it `shard`ed inputs."""
    cp_mesh, _ = _cp_dim(mesh)
    group = cp_mesh.get_group()
    if hasattr(model, "set_attn_implementation"):  # a transformers PreTrainedModel
        if sequence_buffers:
            raise ValueError("context parallel: a transformers model takes its positions as "
                             "position_ids=positions(mesh, seq); drop sequence_buffers")
        model = _apply_hf(model, group)
    else:
        model = _apply_fx(model, group)
    if sharded is True:
        _fully_shard(model, mesh)
        _split_buffers(model, sequence_buffers or {}, cp_mesh)
        return model
    if sharded:  # DDP leaves the weights FSDP2 now holds (DTensors) to it
        _fully_shard_some(model, mesh, sharded)
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(
            model, [name for name, p in model.named_parameters(remove_duplicate=False)
                    if isinstance(p, DTensor)])
    # per-token buffers differ per rank: split after DDP's first sync, never synced again
    wrapped = DistributedDataParallel(model, process_group=_whole_group(mesh),
                                      forward_sync_buffers=False)
    _split_buffers(model, sequence_buffers or {}, cp_mesh)
    return wrapped


def _fully_shard(model: nn.Module, mesh: DeviceMesh) -> None:
    """FSDP2 over every rank of the mesh on each module that owns weights (one unit each,
    as the plan prices them: strategies.context's +fsdp variants), then the root. Gradients
    are averaged over the mesh, as DDP's (a sum then a division: gloo has no PREMUL_SUM)."""
    flat = mesh if mesh.ndim == 1 else mesh._flatten()
    owners = [m for m in model.modules()
              if m is not model and any(True for _ in m.parameters(recurse=False))]
    for module in [*owners, model]:
        fully_shard(module, mesh=flat, reshard_after_forward=True)
        module.set_force_sum_reduction_for_comms(True)


def _fully_shard_some(model: nn.Module, mesh: DeviceMesh, paths: list[str]) -> None:
    """FSDP2 over every rank of the mesh on each module that owns weights inside the
    modules `paths` (the plan's sharded layers), as `_fully_shard` does, the root left
    out: its own weights and every other module's stay replicated, DDP's."""
    flat = mesh if mesh.ndim == 1 else mesh._flatten()
    for module in _shard_units(model, paths):
        fully_shard(module, mesh=flat, reshard_after_forward=True)
        module.set_force_sum_reduction_for_comms(True)


def _shard_units(model: nn.Module, paths: list[str]) -> list[nn.Module]:
    """The modules `_fully_shard_some` shards: each one under `paths` that owns weights,
    deepest first (FSDP2 shards an inner module before the one holding it). Refused where
    FSDP2 cannot hold a layer's weights alone: a layer that is no module, a weight a
    replicated module shares, or (an fx graph) a module whose forward the graph never
    calls, so FSDP2's hooks would never gather its weights."""
    for path in paths:
        try:
            model.get_submodule(path)
        except AttributeError:
            raise ValueError(f"context parallel: layer {path!r} is marked sharded, but "
                             f"{type(model).__name__} has no module at that path; only a "
                             f"module's weights are FSDP2-sharded here: leave it "
                             f"replicated (dp_shard=False, no +fsdp)") from None

    def inside(name: str) -> bool:
        return any(name.startswith(path + ".") for path in paths)

    named = list(model.named_parameters(remove_duplicate=False))
    outside = {id(p) for name, p in named if not inside(name)}
    for name, p in named:
        if inside(name) and id(p) in outside:
            raise ValueError(f"context parallel: parameter {name!r} of a sharded layer is "
                             f"shared with a replicated module; shard the layers that share "
                             f"it together or leave them all replicated")
    called = ({str(n.target) for n in model.graph.nodes if n.op == "call_module"}
              if isinstance(model, fx.GraphModule) else None)
    units = []
    for name, module in reversed(list(model.named_modules())):
        if not inside(name + ".") or not any(True for _ in module.parameters(recurse=False)):
            continue
        if called is not None and name not in called:
            layer = next(path for path in paths if (name + ".").startswith(path + "."))
            raise ValueError(f"context parallel: layer {layer!r} is marked sharded, but "
                             f"the traced graph reads the weights of {name!r} without "
                             f"calling it, so FSDP2 would never gather them; leave "
                             f"{layer!r} replicated (dp_shard=False, no +fsdp)")
        units.append(module)
    return units



# --- a Plan that says cp (planner.context_plan) -------------------------------------------


def mesh_of(plan) -> DeviceMesh:
    """The plan's ("dp", "cp") mesh: cp groups of consecutive ranks, as planned."""
    dp, cp = plan.mesh.shape
    return init_device_mesh(plan.mesh.device_type, (dp, cp), mesh_dim_names=("dp", "cp"))


def plan_sequence(plan) -> int:
    """Tokens per sequence of a cp plan: its attention blocks' output dim 1."""
    return next(l.output_shape[1] for l in plan.layers
                if l.strategy.startswith("context_parallel"))


def parallelize_plan(model: nn.Module, plan, mesh: DeviceMesh | None = None) -> nn.Module:
    """This rank's `model` under a cp Plan: `apply` over the plan's mesh with its weight
    mode (`weight_mode`: DDP, FSDP2, or FSDP2 on the sharded layers), the plan's recomputed
    blocks and modules under activation checkpointing, and (an fx model) every 1-D buffer
    as long as the sequence taken for a position index and split like the tokens."""
    sharded = weight_mode(plan)  # refused before any process group is made
    mesh = mesh or mesh_of(plan)
    if tuple(mesh.mesh_dim_names or ()) != ("dp", "cp") or list(mesh.shape) != plan.mesh.shape:
        raise ValueError(f"context parallel: the mesh {tuple(mesh.shape)} "
                         f"{mesh.mesh_dim_names} is not the plan's {plan.mesh.shape} "
                         f"('dp', 'cp'); pass mesh=None to make it from the plan")
    recomputed = recomputed_modules(plan)
    hf = hasattr(model, "set_attn_implementation")
    if hf:  # module paths of the model itself: checkpointed before or after, alike
        _checkpoint(model, recomputed)
    seq = plan_sequence(plan)
    buffers = None if hf else {name: 0 for name, b in model.named_buffers()
                               if b.dim() == 1 and b.shape[0] == seq}
    out = apply(model, mesh, sequence_buffers=buffers, sharded=sharded)
    if not hf:  # the traced graph keeps the leaf modules at their paths
        _checkpoint(getattr(out, "module", out), recomputed)
    return out


def weight_mode(plan) -> bool | list[str]:
    """`apply`'s `sharded` for a cp plan: False where no layer's weights are sharded, True
    where every layer with weights is, else the sharded layers' module paths. A layer is
    sharded where the 3-D search says so (`dp_shard`), where the cp baseline does (a
    `+fsdp` strategy) or where the whole plan is (`Plan.context_parallel.sharded`)."""
    weighted = [l for l in plan.layers if l.param_bytes > 0]
    names = [l.name for l in weighted if plan.context_parallel.sharded or l.shards_weights]
    for layer in weighted:  # FSDP2 would shard it with the module holding it
        outer = next((n for n in names if layer.name.startswith(n + ".")), None)
        if outer is not None and layer.name not in names:
            raise ValueError(f"context parallel: layer {layer.name!r} is replicated inside "
                             f"layer {outer!r}, which is sharded; shard both or neither")
    if not names:
        return False
    return True if len(names) == len(weighted) else names


def recomputed_modules(plan) -> list[str]:
    """The module paths to run under activation checkpointing: the plan's recomputed
    blocks (torchtitan's full AC), and its recomputed layers outside them."""
    blocks = list(plan.recompute_blocks)
    inside = tuple(b + "." for b in blocks)
    return blocks + [l.name for l in plan.layers if l.recompute and not l.name.startswith(inside)]


def _checkpoint(model: nn.Module, paths: list[str]) -> None:
    for path in paths:
        checkpoint_module(model.get_submodule(path))


def shard_for_plan(plan, tensor: torch.Tensor, rank: int) -> torch.Tensor:
    """Global rank `rank`'s part of a batch tensor (rows, seq, ...) under a cp plan: its
    replica's rows, its head-tail chunks of every sequence. Targets go in shifted
    (`shift_labels`) so each stays with its token."""
    dp, cp = plan.mesh.shape
    if tensor.dim() < 2 or tensor.shape[0] != plan.global_batch:
        raise ValueError(f"shard_batch: a context-parallel plan splits (rows, seq, ...) "
                         f"tensors of {plan.global_batch} rows, got {tuple(tensor.shape)}; "
                         f"pass the whole global batch, targets as shift_labels(ids)")
    rows = tensor.chunk(dp)[rank // cp]
    return split_sequence(rows, rank % cp, cp, 1)
