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
its tokens, so their gradients are averaged as data parallelism's are. With the loss of
`token_loss`, a step equals one process's step on the whole batch::

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    model = apply(model, mesh)  # a transformers Llama; ids: the global (batch, seq)
    logits = model(shard(mesh, ids), position_ids=positions(mesh, ids.shape[1])).logits
    token_loss(logits, shard(mesh, shift_labels(ids)), mesh).backward()

Causal attention only, without padding masks, dropout or sliding windows (each refused
with a message). Not yet reached from `executor.parallelize`: no Plan says cp yet.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import fx, nn
from torch.distributed._functional_collectives import all_gather_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.nn.parallel import DistributedDataParallel

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


def token_loss(logits: torch.Tensor, labels: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
    """Cross-entropy over this rank's tokens, as the whole batch's mean would count them:
    its sum over the targets the whole mesh has (ignored ones aside), times the mesh size,
    so DDP's gradient mean gives the one-process gradient even where ranks hold different
    numbers of targets (the last token's is ignored)."""
    # at least float32 (bfloat16 logits), never below the model's own precision
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    summed = F.cross_entropy(wide.flatten(0, -2), labels.flatten(),
                             ignore_index=IGNORE_INDEX, reduction="sum")
    count = (labels != IGNORE_INDEX).sum().to(torch.float64)
    dist.all_reduce(count, group=_whole_group(mesh))
    return summed * mesh.size() / count.clamp(min=1).to(summed.dtype)


def gathered_attention(query, key, value, group, *, scale=None, causal=True):
    """Attention of this rank's queries (batch, heads, s, d) to the keys and values of the
    whole sequence, gathered over `group`; the causal mask is written in global positions
    (the head-tail chunks of each rank). Keys may have fewer heads (grouped-query)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
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
    model.register_forward_pre_hook(_refuse_padding_mask, with_kwargs=True)
    return model


def _refuse_padding_mask(module, args, kwargs):
    """transformers builds no mask for a registered attention function, so a padding mask
    would be dropped without a word: refused instead."""
    if kwargs.get("attention_mask") is not None:
        raise ValueError("context parallel: attention_mask is not split by sequence here; "
                         "pack sequences without padding and pass no attention_mask")


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


def apply(model: nn.Module, mesh: DeviceMesh, *, sequence_buffers: dict[str, int] | None = None
          ) -> nn.Module:
    """This rank's `model` under context parallelism over `mesh` (dims ("cp",) or ("dp",
    "cp")): a transformers model gets the gathered attention by name, any other model is
    traced by torch.fx; `sequence_buffers` names buffers indexed by position (GPT's
    `positions`) and the dim to split them on. Wrapped in DDP over the whole mesh. Call on
    every rank with the same weights; feed it `shard`ed inputs and `positions`."""
    cp_mesh, _ = _cp_dim(mesh)
    group = cp_mesh.get_group()
    if hasattr(model, "set_attn_implementation"):  # a transformers PreTrainedModel
        if sequence_buffers:
            raise ValueError("context parallel: a transformers model takes its positions as "
                             "position_ids=positions(mesh, seq); drop sequence_buffers")
        model = _apply_hf(model, group)
    else:
        model = _apply_fx(model, group)
    # per-token buffers differ per rank: split after DDP's first sync, never synced again
    wrapped = DistributedDataParallel(model, process_group=_whole_group(mesh),
                                      forward_sync_buffers=False)
    _split_buffers(model, sequence_buffers or {}, cp_mesh)
    return wrapped
