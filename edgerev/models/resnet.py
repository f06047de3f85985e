"""ResNet-18-like reference: the non-reversible network whose memory RevNeXt is compared with."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from edgerev.models._registry import register_model
from edgerev.models.base import EngineModel, stem


class BasicBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus a (projected) shortcut, then ReLU."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.relu = nn.ReLU()
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: Tensor) -> Tensor:
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + self.shortcut(x))


@register_model
def resnet18(width: int = 32, blocks: Sequence[int] = (2, 2, 2, 2), num_classes: int = 10) -> EngineModel:
    """ResNet-18 layout (CIFAR stem) at base width ``width``; every stage is stored (plain autograd)."""
    stages: list[nn.Module] = [stem(width), nn.BatchNorm2d(width), nn.ReLU()]
    c = width
    for level, n in enumerate(blocks):
        cout = width * 2**level
        for i in range(n):
            stages.append(BasicBlock(c, cout, 2 if (level and i == 0) else 1))
            c = cout
    return EngineModel(stages, c, num_classes, divisor=2 ** (len(blocks) - 1))
