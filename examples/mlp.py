"""A small MLP (1024-4096-4096-1000, ReLU, no dropout): the quickest model to plan.

For the command line: `hyplan plan examples/mlp.py --devices 2xV100 --batch 64`.
Its two 4096-wide layers hold most of the weights, so at small batches the planner
splits them across devices instead of all-reducing their gradients.
"""

import torch
from torch import nn


class MLP(nn.Module):
    def __init__(self, in_features: int = 1024, hidden: int = 4096, num_classes: int = 1000):
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(self.fc1(x))
        x = torch.relu(self.fc2(x))
        return self.fc3(x)


def build(batch: int = 64, device: str = "meta"):
    """(model, example inputs, loss) for hyplan. On "meta" nothing is allocated."""
    with torch.device(device):  # on meta the weights are never allocated
        model = MLP()
    x = torch.randn(batch, 1024, device=device)
    return model, (x,), nn.CrossEntropyLoss()
