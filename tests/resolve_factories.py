"""Factories a recipe names as ``tests.resolve_factories:...`` (importable, like a user's own module)."""

from __future__ import annotations

import torch
from torch import nn


class TinyNet(nn.Module):
    """A plain CNN from outside the registry: no ``in_channels``, ``num_classes`` or ``body`` attribute."""

    def __init__(self, classes: int = 5, width: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def tiny(classes: int = 5, width: int = 4) -> nn.Module:
    return TinyNet(classes, width)


def tiny_with_classes(num_classes: int = 7, width: int = 4) -> nn.Module:
    return TinyNet(num_classes, width)


def raises() -> nn.Module:
    raise RuntimeError("no weights on this machine\nsecond line")


def not_a_module() -> list:
    return [1, 2]


NOT_CALLABLE = 3


class NeedsLayers(nn.Module):
    """A class its arguments shape, as torchvision's ResNet and timm's MobileNetV3 are: the class alone cannot build
    it."""

    def __init__(self, layers: list[int], classes: int = 5) -> None:
        super().__init__()
        widths = [3, *layers]
        self.features = nn.Sequential(*(nn.Conv2d(a, b, 3, padding=1) for a, b in zip(widths, widths[1:])),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.classifier = nn.Linear(widths[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


def resnet18_twin(**kwargs):
    """torchvision's resnet18 under a second name: two builders of one ResNet (imported only by the test that
    registers it)."""
    from torchvision.models import resnet18

    return resnet18(**kwargs)
