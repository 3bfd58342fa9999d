"""The small model the `hyplan train` tests run: an MLP without dropout, trained with Adam
on synthetic rows (no `dataset()` here, so hyplan makes them)."""

import torch
from torch import nn


def build(batch: int = 16, device: str = "meta"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 32), nn.ReLU(),
                          nn.Linear(32, 8)).to(device)
    return model, (torch.randn(batch, 16, device=device),), nn.CrossEntropyLoss()


def reference(steps: int, batch: int = 16, lr: float = 1e-3, optimizer: str = "adam",
              seed: int = 0) -> dict[str, torch.Tensor]:
    """What `hyplan train --steps STEPS` should end with: one process, whole global batches."""
    from executor.data import global_batch, synthetic_dataset
    from executor.train import make_optimizer

    torch.manual_seed(seed)
    model, inputs, loss_fn = build(batch, "cpu")
    data = synthetic_dataset(model, inputs, loss_fn, 64 * batch, seed)
    opt = make_optimizer(optimizer, model.parameters(), lr)
    for step in range(steps):
        x, y = global_batch(data, batch, step, seed)
        loss = loss_fn(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {k: v.detach() for k, v in model.named_parameters()}
