"""A model's transformer blocks: where a pipeline of a model torch.fx cannot trace may cut.

torchtitan splits Llama into pipeline stages at whole decoder layers, with the embeddings
on the first stage and the final norm and output head on the last. A Hugging Face model
keeps its blocks in one `nn.ModuleList` of one class (`model.layers` for Llama, Qwen2,
Mistral and Mixtral; `transformer.h` for GPT-2), so the list is found without knowing the
family: the largest ModuleList whose members are all of one class.
"""

from __future__ import annotations

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
