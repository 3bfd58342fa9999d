"""A model's transformer blocks: where a pipeline of a model torch.fx cannot trace may cut.

Only a decoder-only causal LM is cut (executor.hf_stages runs its stages by its own
forward, resumed from the hidden state through `inputs_embeds`): an encoder-decoder, a
model whose blocks sit below its base model (BERT's `bert.encoder.layer`) or one without
an LM head is not, and `decoder_blocks` says why in a few words.

torchtitan splits Llama into pipeline stages at whole decoder layers, with the embeddings
on the first stage and the final norm and output head on the last. A Hugging Face model
keeps its blocks in one `nn.ModuleList` of one class (`model.layers` for Llama, Qwen2,
Mistral and Mixtral; `transformer.h` for GPT-2), so the list is found without knowing the
family: the largest ModuleList whose members are all of one class.
"""

from __future__ import annotations

import inspect

from torch import nn

MIN_BLOCKS = 2  # a list of one is no repeated structure to cut between


def find_blocks(model: nn.Module) -> tuple[str, ...]:
    """The module paths of the model's blocks, in order ("model.layers.0", ...): the
    largest nn.ModuleList of at least MIN_BLOCKS modules of one class (ties: the first
    found). () when there is none."""
    best: tuple[str, ...] = ()
    for path, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) < max(MIN_BLOCKS, len(best) + 1):
            continue
        if len({type(m) for m in module}) != 1:
            continue
        best = tuple(f"{path}.{i}" if path else str(i) for i in range(len(module)))
    return best


def decoder_blocks(model: nn.Module) -> tuple[tuple[str, ...], str]:
    """(the block paths, "") for a Hugging Face decoder-only causal LM whose base model
    holds its blocks and whose forwards take `inputs_embeds`; else ((), why not)."""
    name = type(model).__name__
    blocks = find_blocks(model)
    if not blocks:
        return (), f"{name} has no list of repeated blocks (an nn.ModuleList of one class)"
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return (), f"{name} is not a Hugging Face decoder-only model"
    base = getattr(model, "base_model", None)
    if base is model:
        # a base_model_prefix that names no child: Llama4ForCausalLM's is "language_model"
        # (the multimodal checkpoint's), its decoder `model`. Refused here, Llama 4 had no
        # 3-D plan, only the 1-D program, which Scout's batch of 8 fits on no cluster
        base = getattr(model, "model", None)
    holder = model.get_submodule(blocks[0].rsplit(".", 1)[0].rpartition(".")[0])
    if base is None or base is model or holder is not base:
        return (), f"{name}'s blocks are not held by its base model"
    if getattr(model, "get_output_embeddings", lambda: None)() is None:
        return (), f"{name} has no LM head (not a causal LM)"
    for part in (model, base):
        if "inputs_embeds" not in inspect.signature(part.forward).parameters:
            return (), f"{type(part).__name__}.forward takes no inputs_embeds"
    return blocks, ""


def block_of(path: str, blocks: tuple[str, ...]) -> int | None:
    """The index of the block that contains module `path` (itself or a submodule), else None."""
    if not blocks:
        return None
    prefix = blocks[0].rsplit(".", 1)[0] + "." if "." in blocks[0] else ""
    if not path.startswith(prefix):
        return None
    head = path[len(prefix):].split(".", 1)[0]
    if not head.isdigit() or int(head) >= len(blocks):
        return None
    return int(head)
