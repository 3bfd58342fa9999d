"""A small Hugging Face Llama (rotary positions, RMSNorm, grouped-query attention, SwiGLU),
built from a transformers `LlamaConfig` with random weights: nothing is downloaded.

    hyplan plan examples/hf_llama.py --devices 2xcpu --batch 8 --json plan.json
    hyplan train plan.json examples/hf_llama.py --nproc-per-node 2 --steps 5 --checkpoint-dir ckpt

The default size trains on a CPU in seconds; `build` takes `layers`, `width`, `heads`,
`kv_heads`, `seq` and `vocab` to make it larger. torch.fx cannot trace transformers 5.x, so
hyplan traces it with torch.export, passing `example_kwargs` to the forward: without a
cache (`use_cache=False`) a training forward is one plain graph.
"""

import torch
import torch.nn.functional as F
from torch import nn

try:
    from transformers import LlamaConfig, LlamaForCausalLM
except ImportError:
    raise ImportError("transformers is not installed; pip install 'hyplan[hf]'") from None

# keyword arguments of every forward, in planning (the tracer) and in training
example_kwargs = {"use_cache": False}


class NextTokenLoss(nn.Module):
    """Cross-entropy of the logits at each position against the next token id. Takes the
    model's output as Hugging Face returns it (a ModelOutput with `.logits`) or the
    logits themselves, and the token ids (batch, seq) as targets."""

    def forward(self, output, targets: torch.Tensor) -> torch.Tensor:
        logits = output.logits if hasattr(output, "logits") else output
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), targets[:, 1:].flatten())


def build(batch: int = 8, device: str = "meta", *, layers: int = 2, width: int = 64,
          heads: int = 4, kv_heads: int = 2, seq: int = 32, vocab: int = 256):
    """(model, example inputs, loss) for hyplan; the inputs are token ids (batch, seq)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=width, intermediate_size=4 * width,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=seq,
                         use_cache=False, attention_dropout=0.0)
    with torch.device(device):  # on meta the weights are never allocated, at any size
        model = LlamaForCausalLM(config)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, (ids,), NextTokenLoss()
