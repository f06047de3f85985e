"""A generated stream whose appearance drifts: the data set's images under a colour shift, a darkening
and a blur that grow with a drift amount in [0, 1] (light, season, camera), dropped in an inbox."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from edgerev_daemon.service.demo import write_images


def drifted(image: Tensor, amount: float) -> Tensor:
    """``image`` (``uint8 [3, H, W]``) as it looks at drift ``amount``: its colour moved toward the next
    channel's (red takes green's place...), darker by up to half, and blurred by a 3x3 box."""
    x = image.float()
    x = (1 - amount) * x + amount * x.roll(1, dims=0)
    x = x * (1 - 0.5 * amount)
    blurred = F.avg_pool2d(x[None], 3, stride=1, padding=1, count_include_pad=False)[0]
    x = (1 - amount) * x + amount * blurred
    return x.round().clamp(0, 255).to(torch.uint8)


def write_drifted(inbox: Path, n: int, classes: Sequence[int], amount: float, start: int = 0, seed: int = 0,
                  num_classes: int = 4, size: int = 16) -> list[Path]:
    """Write ``n`` generated images of ``classes`` at drift ``amount`` as ``inbox/class<k>/<name>.png``."""
    return write_images(inbox, n, list(classes), seed=seed, start=start, num_classes=num_classes, size=size,
                        look=lambda image: drifted(image, amount), prefix=f"drift{amount:g}")
