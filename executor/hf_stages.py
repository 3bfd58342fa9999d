"""Run a pipelined plan of a Hugging Face decoder-only causal LM (a torch.export graph).

torch.fx cannot rewrite such a model, so its stages are built as torchtitan builds Llama's
(torchtitan/distributed/pipeline_parallel.py): from the model's own modules, each stage
keeping only its blocks. The planner cut it between transformer blocks
(planner.block_cuts) and each StagePlan lists its module paths: the first stage the
embeddings (and rotary tables) and its blocks, middle stages their blocks, the last its
blocks, the final norm and the head. A stage runs the model's own forward:

- the first stage from token ids, the others from the hidden state it receives, passed as
  `inputs_embeds`: the model's forward recomputes positions, the causal mask and rotary
  embeddings from the sequence length on every stage, so only the hidden state travels;
- a stage that is not first has no token embedding, an added position table gives zeros
  and dropout before the blocks is off (it ran on the first stage); a probe checks at
  build time that the hidden state then reaches the first block unchanged, and refuses
  a model whose forward transforms it there (Gemma scales it, for one);
- a stage that is not last ends at its blocks: the final norm is an identity and the head
  is never called.

Nothing is deep-copied: a stage is a shallow copy of the modules on the paths it changes
(the model, the module that holds the blocks), sharing every block and weight with the
model it came from, so two chunks of one rank (interleaved schedules) are two such copies.
Parameters keep the model's own names. The schedule, the gradient sums over the dp group
and the loss scaling are executor.pipeline's, as for fx stages. In the order torchtitan's
parallelize_llama applies them (TP, then FSDP, then PP):

1. tensor parallelism over the tp sub-mesh: each stage's modules get their planned style
   and layout hooks by path, as the 1-D export path makes them (executor.modules) on one
   microbatch of one dp replica's rows: the rows the model's code holds between modules
   are split over tp where they split evenly, else whole on every tp rank, and the hidden
   state travels between stages so;
   an experts module whose EP group is wider than tp ("expert_parallel:epK") is styled
   over its EP group of K consecutive ranks of the stage instead (executor.experts), its
   experts summed over the stage's ranks holding the same ones once a step
   (executor.pipeline.StageModel.sync_gradients);
2. a module the plan shards over dp (`dp_shard`) is FSDP2 `fully_shard` of that module
   over the dp sub-mesh (beside DTensor tensor parallelism: a 2-D (dp, tp) mesh), which
   reduce-scatters its gradients itself; a carved experts module over the ranks holding
   the same experts;
3. the schedule over the pp group (executor.pipeline.staged).
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from executor.agree import check_model
from executor.experts import apply_carved, carved_degree, shard_carved, stage_meshes
from executor.graph_rewrite import device_of
from executor.levers import checkpoint_module
from executor.modules import apply_module_layouts, module_path
from executor.pipeline import (
    StageModel, embedding_group, microbatch_rows, pipeline_ranks, shard_modules, staged,
)
from executor.precision import run_in_precision
from executor.styles import MeanOverRanks
from planner.handback import output_layout
from planner.plan import Plan
from planner.pipeline.stages import stage_ranks
from profiler.blocks import decoder_blocks
from strategies.layouts import Layout


class KeptBlocks(nn.ModuleList):
    """The blocks one stage keeps, under their indices in the whole model (so parameter
    names stay "model.layers.5...."), iterated in order as the model's forward does."""

    def __init__(self, blocks=()):
        super().__init__()
        items = blocks.items() if isinstance(blocks, dict) else enumerate(blocks)
        for index, block in items:
            self.add_module(str(index), block)


class PositionZeros(nn.Module):
    """Stands for an added position table on a stage after the first: the first stage
    added it already, so here it adds nothing."""

    def __init__(self, table: nn.Embedding):
        super().__init__()
        self.dim = table.embedding_dim

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return torch.zeros(*positions.shape, self.dim, device=positions.device)


class NotOnThisStage(nn.Module):
    """Stands for a module another stage runs (the token embedding, the head): calling it
    here is a bug in the stage split, said plainly."""

    def __init__(self, path: str):
        super().__init__()
        self.path = path

    def forward(self, *args, **kwargs):
        raise RuntimeError(f"pipeline stage: {self.path!r} runs on another stage")


class _Arrived(Exception):
    def __init__(self, hidden: torch.Tensor):
        super().__init__("probe")
        self.hidden = hidden


class _Catch(nn.Module):
    def forward(self, hidden, *args, **kwargs):
        raise _Arrived(hidden)


def _own_types(config) -> bool:
    """Does `config` hold a per-block `layer_types` list of its own? Mamba's is a property
    derived from num_hidden_layers, with no setter: its stages raised setting it."""
    return (isinstance(getattr(config, "layer_types", None), list)
            and not isinstance(getattr(type(config), "layer_types", None), property))


def _copied(module: nn.Module) -> nn.Module:
    out = copy.copy(module)
    out._modules = dict(module._modules)  # children replaced here stay the copy's own
    return out


class _Surgery:
    """A shallow copy of a model whose submodules can be replaced by path without touching
    the model: each module on a replaced path is copied once, the rest are shared."""

    def __init__(self, model: nn.Module):
        self.root = _copied(model)
        self._copied: dict[str, nn.Module] = {"": self.root}

    def module(self, path: str) -> nn.Module:
        """The module at `path`, copied (with its ancestors) so its children can be set."""
        if path in self._copied:
            return self._copied[path]
        parent_path, _, name = path.rpartition(".")
        parent = self.module(parent_path)
        mine = self._copied[path] = _copied(parent._modules[name])
        parent._modules[name] = mine
        return mine

    def get(self, path: str) -> nn.Module:
        return self.root.get_submodule(path)

    def replace(self, path: str, new: nn.Module) -> None:
        parent_path, _, name = path.rpartition(".")
        self.module(parent_path)._modules[name] = new


class DecoderStage(nn.Module):
    """One stage of a decoder-only causal LM (see the module docstring): forward(x) takes
    token ids (first stage) or the hidden state, and gives the hidden state, or the logits
    (last stage). Its parameters are its modules', under the model's own names."""

    def __init__(self, model: nn.Module, blocks: tuple[str, ...], keep: list[int],
                 before: list[str], after: list[str], first: bool, last: bool,
                 recompute: frozenset[str] = frozenset()):
        super().__init__()
        base_path, _, list_name = blocks[0].rsplit(".", 1)[0].rpartition(".")
        cut = _Surgery(model)
        base = cut.module(base_path)  # what holds the blocks: model.model, model.transformer
        whole = base._modules[list_name]
        base._modules[list_name] = KeptBlocks(
            {i: _checkpointed(whole[i]) if blocks[i] in recompute else whole[i] for i in keep})
        config = getattr(base, "config", None)
        if config is not None:  # the forward walks config.num_hidden_layers blocks
            config = copy.copy(config)
            config.num_hidden_layers = len(keep)
            if _own_types(config):
                config.layer_types = [config.layer_types[i] for i in keep]
            base.config = config
        if not first:
            embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            for path in before:
                module = cut.get(path)
                if module is embedding:
                    cut.replace(path, NotOnThisStage(path))
                elif isinstance(module, nn.Embedding):
                    cut.replace(path, PositionZeros(module))
                elif isinstance(module, nn.Dropout):
                    cut.replace(path, nn.Identity())
                elif any(True for _ in module.parameters()):
                    raise ValueError(f"pipeline: {path!r} runs before the blocks and holds "
                                     f"weights, but is not an embedding; plan this model "
                                     f"with mesh='1d'")
        if not last:  # the base's final norm passes the hidden state; the head is not called
            for path in after:
                inside = not base_path or path.startswith(base_path + ".")
                cut.replace(path, nn.Identity() if inside else NotOnThisStage(path))
        object.__setattr__(self, "_root", cut.root)  # called, not registered twice
        object.__setattr__(self, "_base", base)
        self._modules = cut.root._modules  # parameters named as the model names them
        self.first, self.last = first, last
        if not first:
            types = getattr(getattr(base, "config", None), "layer_types", None)
            self._check_hidden_passes(blocks, list_name,
                                      model_types(model)[:1] if isinstance(types, list) else None)

    def _check_hidden_passes(self, blocks, list_name: str, probe_types=None) -> None:
        """Refuse a model whose forward changes `inputs_embeds` before the first block.
        `probe_types`: the per-block `layer_types` of the one block probed (a stage that
        keeps no blocks has none of its own)."""
        base = self._base
        kept = base._modules[list_name]
        config = getattr(base, "config", None)
        count = config.num_hidden_layers if config is not None else None
        types = getattr(config, "layer_types", None) if _own_types(config) else None
        base._modules[list_name] = KeptBlocks([_Catch()])
        if config is not None:
            config.num_hidden_layers = 1
            if probe_types and types is not None:
                config.layer_types = probe_types
        weight = next(self.parameters(), None)
        hidden = getattr(getattr(self._root, "config", None), "hidden_size", None)
        probe = torch.randn(1, 2, hidden, device=weight.device if weight is not None else None)
        try:
            base(inputs_embeds=probe, use_cache=False)
            arrived = None
        except _Arrived as caught:
            arrived = caught.hidden
        finally:
            base._modules[list_name] = kept
            if config is not None:
                config.num_hidden_layers = count
                if probe_types and types is not None:
                    config.layer_types = types
        if arrived is None or not torch.equal(arrived, probe):
            raise ValueError(f"pipeline: {type(self._root).__name__}'s forward changes the "
                             f"hidden state before its first block (other than an added "
                             f"position table or dropout), so a later stage cannot resume it "
                             f"there; plan this model with mesh='1d'")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        given = {"input_ids": x} if self.first else {"inputs_embeds": x}
        if self.last:
            out = self._root(**given, use_cache=False)
            return out.logits if hasattr(out, "logits") else out[0]
        out = self._base(**given, use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        # GPT-2 hands back `hidden.view(shape)`; a zero-bubble schedule frees a stage's
        # output graph with an in-place detach_(), which a view refuses
        return hidden.clone() if hidden._is_view() else hidden


def model_types(model: nn.Module) -> list:
    """The model's per-block `layer_types` (Qwen2's "full_attention", ...), or []."""
    types = getattr(getattr(model, "config", None), "layer_types", None)
    return list(types) if isinstance(types, list) else []


def _checkpointed(block: nn.Module) -> nn.Module:
    """A shallow copy of `block` (its parameters shared, the model's block untouched) whose
    forward runs under activation checkpointing (the blocks plan.recompute_blocks lists)."""
    out = copy.copy(block)
    checkpoint_module(out)
    return out


class _ScaledOutput(nn.Module):
    """The last stage's logits, their gradient divided by the dp replicas: every gradient
    reduction after it is a sum (executor.styles.MeanOverRanks)."""

    def __init__(self, stage: DecoderStage, ranks: int):
        super().__init__()
        self._modules = stage._modules
        object.__setattr__(self, "_stage", stage)
        object.__setattr__(self, "_scale", MeanOverRanks(ranks))

    def forward(self, x):
        return self._scale(self._stage(x))


def stage_modules(model: nn.Module, plan: Plan, num_stages: int, k: int) -> DecoderStage:
    """Stage k of `plan` built from `model` (see DecoderStage)."""
    blocks, why = decoder_blocks(model)
    if why:
        raise ValueError(f"pipeline: {why}, so its stages cannot be built from its modules; "
                         f"plan it with mesh='1d'")
    index = {path: i for i, path in enumerate(blocks)}
    recompute = frozenset(p for p in blocks if plan.recomputes_block(p))
    if plan.pipeline is None:  # one stage: the whole model
        return DecoderStage(model, blocks, list(range(len(blocks))), [], [], True, True,
                            recompute)
    stages = plan.pipeline.stages
    keep = [index[p] for p in stages[k].modules if p in index]
    before = [p for p in stages[0].modules if p not in index]
    before = before[:next((i for i, p in enumerate(stages[0].modules) if p in index),
                          len(stages[0].modules))]
    after = [p for p in stages[-1].modules if p not in index and p not in before]
    return DecoderStage(model, blocks, keep, before, after, k == 0, k == num_stages - 1,
                        recompute)


def parallelize_decoder_3d(model: nn.Module, plan: Plan) -> StageModel:
    """This rank's StageModel under a 3-D plan of a torch.export graph; every rank calls it
    with the same model (same initial weights)."""
    check_model(model, plan)
    dp, tp = plan.mesh.size("dp"), plan.mesh.size("tp")
    device = device_of(plan)
    mesh, stage_index, stage_groups, num_stages, mine = pipeline_ranks(plan)
    # every rank makes every carved EP group's, in one order
    meshes = stage_meshes(plan, _carved_module(model, plan, tp))
    modules = []
    sharded: set[str] = set()
    carved: dict = {}
    for k in mine:
        stage = stage_modules(model, plan, num_stages, k).to(device)
        experts = list({module_path(model, l): l for l in plan.layers  # once per module
                        if l.stage == k and carved_degree(l, tp)}.items())
        held = tensor_parallel(stage, model, plan, k, mesh["tp"]) if tp > 1 else Layout.BATCH
        carved.update(apply_carved(stage, experts, meshes, tp))
        sharded |= shard_carved(stage, experts, meshes, tp, plan.training_precision)
        sharded |= shard_over_dp(stage, plan, k, mesh)
        last = k == num_stages - 1
        # rows whole over tp: the tp ranks compute one loss alike, counted once in the mean
        module = _ScaledOutput(stage, dp * tp if held == Layout.BATCH else dp) if last else stage
        run_in_precision(module, plan.training_precision, plan.mesh.device_type, last=last)
        modules.append(module)
    out = staged(modules, mine, plan, mesh, stage_index, device, stage_groups[stage_index],
                 sharded, carved)
    _tie_copies(out, model, plan, num_stages, sharded)
    return out


def _carved_module(model: nn.Module, plan: Plan, tp: int):
    """The experts module of a layer whose EP group is wider than tp (executor.experts.
    stage_meshes checks it), None where it is none; first, such a layer is refused by name,
    before any collective, on a plan whose stages hold each microbatch's rows whole on
    every tp rank (planner.handback, the layout planner.search.tp_whole_rows gives a
    torch.export graph): each rank of an EP group dispatches its own rows, which there the
    tp ranks would each send alike."""
    whole = tp > 1 and output_layout(microbatch_rows(plan), tp) != Layout.BATCH

    def module_of(layer):
        if whole:
            raise ValueError(f"plan: layer {layer.name!r} runs expert parallel over "
                             f"{carved_degree(layer, tp)} ranks of stages whose rows are "
                             f"whole on every tp rank; re-plan it with its EP group inside "
                             f"tp ('expert_parallel') or with tp 1")
        path = module_path(model, layer)
        return model.get_submodule(path) if path is not None else None
    return module_of


def tied_names(model: nn.Module) -> set[str]:
    """Every name of a parameter the model holds under more than one (a tied embedding and
    head: "transformer.wte.weight" and "lm_head.weight")."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {n for group in names.values() if len(group) > 1 for n in group}


def _tie_copies(stage_model: StageModel, model: nn.Module, plan: Plan, num_stages: int,
                sharded: set[str]) -> None:
    """Megatron-LM's tied embedding across a pipeline: the first stage's embedding and the
    last stage's head each hold the weight (the planner allows only that tie,
    planner.block_cuts); where they lie on two pipeline ranks, their gradients are summed
    over the embedding group of those two ranks after the dp sums, so both copies stay
    equal under the same optimizer step. Every rank takes part in making the groups."""
    tied = tied_names(model)
    if not tied or plan.pipeline is None:
        return
    ranks_of = stage_ranks(plan.pipeline.schedule, plan.mesh.size("pp"), plan.pipeline.chunks)
    first, last = ranks_of[0], ranks_of[num_stages - 1]
    if first == last:  # one rank holds both: one Parameter, its gradient already whole
        return
    group = embedding_group(plan, first, last)
    copies = [p for name, p in stage_model.stage.named_parameters() if name in tied]
    if any(name in sharded for name in tied):
        raise ValueError(f"pipeline: the tied weight {sorted(tied)} is sharded over dp, which "
                         f"the embedding group's all-reduce does not sum; plan it unsharded")
    stage_model.tie(copies, group)


def tensor_parallel(stage: DecoderStage, model: nn.Module, plan: Plan, k: int,
                    tp_mesh) -> Layout:
    """The plan's tensor parallelism and layout changes over `tp_mesh` on the modules of
    stage k (executor.modules.apply_module_layouts, on one microbatch of one dp replica).
    Layouts are derived from the whole plan, so every stage agrees on what travels; a
    module runs its style and hooks where its layer was planned (a parameter-free module
    every stage reruns, such as rotary tables, gets none on later stages: it reads only
    the dtype of the hidden state it is given). Returns the layout the stage's code holds
    module outputs in (rows over tp, or whole)."""
    rows = microbatch_rows(plan)

    def scaled(shape):
        return [rows, *shape[1:]] if shape and shape[0] == plan.global_batch else list(shape)

    layers = [l.model_copy(update={"output_shape": scaled(l.output_shape)}) for l in plan.layers]
    inputs = [i.model_copy(update={"shape": scaled(i.shape)}) for i in plan.inputs]
    paths = {l.node: module_path(model, l) for l in layers}
    tp = tp_mesh.size()
    # a carved experts module is styled over its stage's EP group (executor.experts)
    return apply_module_layouts(stage, layers, inputs, plan.outputs, rows, tp_mesh, paths,
                                here=lambda layer: layer.stage == k
                                and not carved_degree(layer, tp))


def shard_over_dp(stage: DecoderStage, plan: Plan, k: int, mesh) -> set[str]:
    """FSDP2 `fully_shard` over the dp sub-mesh (HSDP layers: the (dp_replicate, dp_shard)
    mesh) of each module of stage k the plan marks `dp_shard` (an export layer's name is
    its module's path, planner.dp_shard), with executor.levers' settings: gradients summed
    (the last stage's output gradient already carries 1/dp). Returns the names of the
    parameters FSDP now owns, which the stage's own dp all-reduce leaves alone."""
    tp = plan.mesh.size("tp")
    marked = [(l.name, l) for l in plan.layers
              if l.stage == k and l.dp_shard and not carved_degree(l, tp)]
    return shard_modules(stage, marked, mesh, plan)
