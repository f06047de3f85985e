"""RevNeXt (Hascoet et al. 2023): hybrid reversible blocks, batch and channel pooling."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from torch import nn

from edgerev.layers import BatchPool, ChannelPool, HybridBlock
from edgerev.models._registry import register_model
from edgerev.models.base import EngineModel, stem


class RevNeXt(EngineModel):
    """Stem, then five levels of hybrid blocks separated by alternating batch and channel pooling.

    Channels per level: ``w, w, 4w, 4w, 16w`` (``w`` the stem width); resolution halves at each
    pooling, so the activation volume is the same at every stage and the peak does not grow with
    depth. Input sizes must be multiples of 16.

    Args:
        width: stem width (32 in the paper: 352 bytes per input pixel).
        blocks: hybrid blocks per level.
        depth: (conv, BN, leaky ReLU) triples inside each of ``F`` and ``G``.
        slope: leaky ReLU slope.
        eps_i: bound on the batch-norm scale.
        num_classes: classifier outputs.
    """

    def __init__(self, width: int = 32, blocks: Sequence[int] = (2, 2, 2, 2, 3), depth: int = 1,
                 slope: float = 0.2, eps_i: float = 0.1, num_classes: int = 10) -> None:
        if len(blocks) != 5:
            raise ValueError(f"revnext has 5 levels, got blocks={tuple(blocks)}")
        stages = _pooled_levels(width, blocks, lambda c: [HybridBlock(c, depth, slope, eps_i)])
        super().__init__(stages, 16 * width, num_classes, divisor=16)


def _pooled_levels(width: int, counts: Sequence[int], unit: Callable[[int], list[nn.Module]]) -> list[nn.Module]:
    """Stem, then five levels of ``counts[k]`` units at ``w, w, 4w, 4w, 16w`` channels, with batch and
    channel pooling alternating between levels (the RevNeXt plan: every stage keeps the same volume)."""
    stages: list[nn.Module] = [stem(width)]
    channels = [width, width, 4 * width, 4 * width, 16 * width]
    pools = [BatchPool, ChannelPool, BatchPool, ChannelPool, None]
    for c, n, pool in zip(channels, counts, pools):
        for _ in range(n):
            stages += unit(c)
        if pool is not None:
            stages.append(pool())
    return stages


@register_model
def revnext(**kw) -> RevNeXt:
    """RevNeXt, stem width 32, hybrid blocks (2, 2, 2, 2, 3) per level."""
    return RevNeXt(**kw)


@register_model
def layerwise(width: int = 32, layers: Sequence[int] = (2, 2, 2, 2, 2), slope: float = 0.2, eps_i: float = 0.1,
              num_classes: int = 10) -> EngineModel:
    """A flat chain of invertible layers (conv, BN, leaky ReLU), same pooling plan as RevNeXt.

    Every layer is its own stage, so the backward inverts layer after layer across the whole
    network: the design whose reconstruction error grows with depth.
    """
    from edgerev.layers import InvBatchNorm2d, InvConv2d, InvLeakyReLU

    if len(layers) != 5:
        raise ValueError(f"layerwise has 5 levels, got layers={tuple(layers)}")
    stages = _pooled_levels(width, layers, lambda c: [InvConv2d(c), InvBatchNorm2d(c, eps_i), InvLeakyReLU(slope)])
    return EngineModel(stages, 16 * width, num_classes, divisor=16)
