"""A GPT-style decoder written in plain PyTorch (nanoGPT's layout), traceable by torch.fx.

For the command line: `hyplan plan examples/gpt.py --devices 2x8xA100-80GB --batch 64`.
The default size is GPT-2 small (12 layers, 768 wide, 12 heads, 1024 tokens); `build`
takes `layers`, `width`, `heads`, `seq` and `vocab` to make it larger or tiny. Built on
"meta", a model of any size is planned without allocating its weights.
"""

import torch
import torch.nn.functional as F
from torch import nn

from strategies import register_attention


class CausalSelfAttention(nn.Module):
    """Multi-head attention: one Linear makes q, k and v, one projects the heads back.

    The head count is read from the projection's output (`chunk`, `view(..., -1, head)`),
    as in torchtitan, so the same forward runs on a rank that holds only some heads."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        if width % heads:
            raise ValueError(f"width {width} is not a multiple of heads {heads}")
        self.heads, self.head_dim = heads, width // heads
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=2)
        q, k, v = (t.view(batch, seq, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, -1))


# hyplan's registry: this attention may be split by heads (traced as one layer)
register_attention(CausalSelfAttention, qkv="qkv", out="proj")


class MLP(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.fc = nn.Linear(width, 4 * width)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.ln_1 = nn.LayerNorm(width)
        self.attn = CausalSelfAttention(width, heads)
        self.ln_2 = nn.LayerNorm(width)
        self.mlp = MLP(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, layers: int = 12, width: int = 768, heads: int = 12, seq: int = 1024,
                 vocab: int = 50304):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(seq, width)
        self.h = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.wte(ids) + self.wpe(self.positions)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class NextTokenLoss(nn.Module):
    """Cross-entropy of logits (batch, seq, vocab) against token ids (batch, seq)."""

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def build(batch: int = 8, device: str = "meta", *, layers: int = 12, width: int = 768,
          heads: int = 12, seq: int = 1024, vocab: int = 50304):
    """(model, example inputs, loss) for hyplan. On "meta" nothing is allocated."""
    with torch.device(device):  # on meta the weights are never allocated, at any size
        model = GPT(layers, width, heads, seq, vocab)
    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return model, (ids,), NextTokenLoss()
