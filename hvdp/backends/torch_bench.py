"""The benchmark models of :mod:`hvdp.bench.models` in PyTorch (imported by the bench's torch processes only)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from hvdp.bench.models import CLASSES, MLP_LAYERS, MLP_WIDTH, MODELS


def model(name: str) -> Any:
    """The torch ``nn.Module`` named ``name`` (one of :data:`hvdp.bench.models.MODELS`)."""
    torch.manual_seed(0)
    if name == "cnn":
        return nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(),
            nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),
            nn.Flatten(), nn.Linear(64 * 8 * 8, 128), nn.ReLU(), nn.Linear(128, CLASSES),
        )
    if name == "mlp":
        layers: list = []
        for _ in range(MLP_LAYERS - 1):
            layers += [nn.Linear(MLP_WIDTH, MLP_WIDTH), nn.ReLU()]
        return nn.Sequential(*layers, nn.Linear(MLP_WIDTH, CLASSES))
    if name == "resnet18":
        return _resnet18()
    raise ValueError(f"Unknown model {name!r}. Expected one of: {', '.join(MODELS)}.")


def _block(cin: int, cout: int, stride: int) -> Any:
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
            self.bn1 = nn.BatchNorm2d(cout)
            self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
            self.bn2 = nn.BatchNorm2d(cout)
            self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                         if stride != 1 or cin != cout else nn.Identity())

        def forward(self, x: Any) -> Any:
            out = self.bn1(self.conv1(x)).relu()
            return (self.bn2(self.conv2(out)) + self.down(x)).relu()

    return Block()


def _resnet18() -> Any:
    layers: list = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(), nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for cout, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        layers += [_block(cin, cout, stride), _block(cout, cout, 1)]
        cin = cout
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(512, CLASSES)]
    return nn.Sequential(*layers)
