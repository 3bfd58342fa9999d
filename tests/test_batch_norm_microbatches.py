"""BatchNorm normalizes over the rows it is handed: a pipeline that split the batch into
microbatches would normalize each with its own statistics and train away from one process
(torchvision's ResNet-18 and DenseNet-121 did, by 1.6 in 3 steps). Every 3-D plan of a
model with BatchNorm runs one microbatch."""

import torch
from torch import nn

import planner


def _cnn():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
                         nn.Flatten(), nn.Linear(64 * 32 * 32, 10))


def test_a_batch_norm_model_is_pipelined_with_one_microbatch():
    x = torch.randn(256, 3, 32, 32)  # without the rule: 8 microbatches
    plan = planner.optimize(_cnn(), "4xV100", example_inputs=(x,), mesh="3d",
                            search_time_s=20)
    assert plan.pipeline is None or plan.pipeline.microbatches == 1, plan.explain()
    pipeline = planner.baseline(_cnn(), "4xV100", "pipeline", example_inputs=(x,))
    assert pipeline.pipeline.microbatches == 1
