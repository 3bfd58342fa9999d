"""Small models the tests plan and run: no dropout, so parallel runs can match exactly."""

import torch
from torch import nn


def mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                         nn.Linear(32, 8))


def deep_mlp() -> nn.Module:
    """Eight Linear layers: enough modules for 4 pipeline ranks x 2 chunks."""
    torch.manual_seed(0)
    widths = [16, 32, 32, 24, 32, 24, 32, 16, 8]
    layers = []
    for i in range(8):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if i < 7:
            layers.append(nn.Tanh())
    return nn.Sequential(*layers)


class SmallCNN(nn.Module):
    """Convolutions, then two fully connected layers: AlexNet's shape in miniature."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.features = nn.Sequential(
            nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(8, 16, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2))
        self.classifier = nn.Sequential(nn.Linear(16 * 4 * 4, 64), nn.ReLU(),
                                        nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))

    def forward(self, x):
        x = torch.flatten(self.features(x), 1)
        return self.classifier(x)


class TiedTransposed(nn.Module):
    """MobileBERT's head: the embedding's weight read again, transposed, between modules."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.proj = nn.Linear(8, 8)

    def forward(self, ids):
        return self.proj(self.embed(ids)) @ self.embed.weight.t()


MODELS = {"mlp": (mlp, (16,)), "deep_mlp": (deep_mlp, (16,)), "cnn": (SmallCNN, (3, 16, 16))}


def build(name: str) -> nn.Module:
    return MODELS[name][0]()


def batch(name: str, rows: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    x = torch.randn(rows, *MODELS[name][1], generator=g)
    y = torch.randint(0, 8, (rows,), generator=g)
    return x, y


def assert_ranks_match(results: list[dict], expected: dict, rtol=1e-5, atol=1e-6) -> None:
    """Every rank's parameters (name -> full tensor) equal the single-process ones."""
    for rank, params in enumerate(results):
        assert params.keys() == expected.keys()
        for key, value in expected.items():
            torch.testing.assert_close(params[key], value, rtol=rtol, atol=atol,
                                       msg=lambda m: f"rank {rank}, {key}: {m}")
