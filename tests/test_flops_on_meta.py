"""FLOP counting runs every op on meta tensors, whatever device the model lives on: a bare
parameter (an fx get_attr) once reached the counted op as the model's own tensor, which a
CPU model hides (meta and CPU tensors mix) and a GPU model fails on ("expected device
cuda:0 but got meta", seen on an H200). Checked here by recording each op's devices."""

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from profiler.profile import count_flops
from profiler.trace import trace


class Scaled(nn.Module):
    """A bare parameter beside a module: fx reads `scale` with get_attr."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 32)
        self.scale = nn.Parameter(torch.ones(32))

    def forward(self, x):
        return self.proj(x) * self.scale


class Devices(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for value in torch.utils._pytree.tree_leaves((args, kwargs or {})):
            if isinstance(value, torch.Tensor):
                self.seen.add(value.device.type)
        return func(*args, **(kwargs or {}))


def _counted(model, x):
    graph = trace(model, (x,))
    with Devices() as devices:
        flops = count_flops(graph)
    return graph, flops, devices.seen


def test_a_bare_parameter_and_a_root_linear_are_counted_on_meta_tensors():
    rows = 8
    graph, flops, seen = _counted(Scaled(), torch.randn(rows, 16))
    assert seen == {"meta"}
    linear = next(layer for layer in graph.layers if layer.kind.lower() == "linear")
    fwd, bwd = flops[linear.node]
    assert (fwd, bwd) == (2 * rows * 16 * 32, 2 * rows * 16 * 32)  # the input needs no grad
    # a model that is one Linear: fx reads its weight and bias with get_attr
    graph, flops, seen = _counted(nn.Linear(16, 32), torch.randn(rows, 16))
    assert seen == {"meta"}
    assert sum(f for f, _ in flops.values()) == 2 * rows * 16 * 32
