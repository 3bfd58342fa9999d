"""AlexNet at ImageNet shape, in torchvision's layout (convs 64-192-384-256-256, FC
9216-4096-4096-1000), the model of Krizhevsky's "one weird trick" paper.

For the command line: `hyplan plan examples/alexnet.py --devices 8xK20 --batch 1024`.
torchvision has no CPU build here, so the layers are written out (same shapes and names).
"""

import torch
from torch import nn


class AlexNet(nn.Module):
    def __init__(self, num_classes: int = 1000, dropout: float = 0.5):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=11, stride=4, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(64, 192, kernel_size=5, padding=2),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1),
            nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=3, stride=2),
        )
        self.avgpool = nn.AdaptiveAvgPool2d((6, 6))
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout),
            nn.Linear(256 * 6 * 6, 4096),
            nn.ReLU(inplace=True),
            nn.Dropout(p=dropout),
            nn.Linear(4096, 4096),
            nn.ReLU(inplace=True),
            nn.Linear(4096, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x)
        x = self.avgpool(x)
        x = torch.flatten(x, 1)
        return self.classifier(x)


def build(batch: int = 128, device: str = "meta"):
    """(model, example inputs, loss) for hyplan. On "meta" nothing is allocated."""
    with torch.device(device):  # on meta the weights are never allocated
        model = AlexNet()
    images = torch.randn(batch, 3, 224, 224, device=device)
    return model, (images,), nn.CrossEntropyLoss()
