"""RevNet (Gomez et al. 2017) and i-RevNet (Jacobsen et al. 2018): block-level reversible networks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn

from edgerev.layers import ChannelPool, Coupling
from edgerev.models._registry import register_model
from edgerev.models.base import EngineModel, stem


def residual(channels: int) -> nn.Sequential:
    """RevNet's residual function: (BN, ReLU, 3x3 conv) twice, at stride 1."""
    return nn.Sequential(
        nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
        nn.BatchNorm2d(channels), nn.ReLU(), nn.Conv2d(channels, channels, 3, padding=1, bias=False),
    )


def rev_block(channels: int) -> Coupling:
    return Coupling(channels, residual(channels // 2), residual(channels // 2))


def downsample(cin: int, cout: int) -> nn.Sequential:
    """RevNet's non-reversible strided transition; the engine stores its input."""
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(), nn.Conv2d(cin, cout, 3, stride=2, padding=1, bias=False))


@register_model
def revnet(width: int = 32, blocks: Sequence[int] = (2, 2, 2, 2), num_classes: int = 10) -> EngineModel:
    """RevNet: reversible blocks at ``width * 2**k`` channels, strided transitions between levels."""
    stages: list[nn.Module] = [stem(width)]
    c = width
    for level, n in enumerate(blocks):
        if level:
            stages.append(downsample(c, 2 * c))
            c *= 2
        stages += [rev_block(c) for _ in range(n)]
    stages += [nn.BatchNorm2d(c), nn.ReLU()]
    return EngineModel(stages, c, num_classes, divisor=2 ** (len(blocks) - 1))


@register_model
def irevnet(width: int = 32, blocks: Sequence[int] = (2, 2, 1), num_classes: int = 10) -> EngineModel:
    """i-RevNet: reversible blocks, channel pooling (space to depth) between levels: ``w, 4w, 16w``."""
    stages: list[nn.Module] = [stem(width)]
    c = width
    for level, n in enumerate(blocks):
        if level:
            stages.append(ChannelPool())
            c *= 4
        stages += [rev_block(c) for _ in range(n)]
    stages += [nn.BatchNorm2d(c), nn.ReLU()]
    return EngineModel(stages, c, num_classes, divisor=2 ** (len(blocks) - 1))
