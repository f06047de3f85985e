"""Augmentation of ``uint8`` or float image batches ``[B, C, H, W]`` in torch: pad-and-crop, flip, cutout."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor


def pad_crop(x: Tensor, pad: int, generator: torch.Generator | None = None) -> Tensor:
    """Pad by ``pad`` pixels (reflect) and crop back to the original size at a random offset per image."""
    if pad <= 0:
        return x
    b, _, h, w = x.shape
    padded = F.pad(x.float(), (pad, pad, pad, pad), mode="reflect").to(x.dtype)
    dy = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    dx = torch.randint(0, 2 * pad + 1, (b,), generator=generator)
    rows = (dy[:, None] + torch.arange(h)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w)[None, :])[:, None, None, :]
    idx_b = torch.arange(b)[:, None, None, None]
    idx_c = torch.arange(x.shape[1])[None, :, None, None]
    return padded[idx_b, idx_c, rows, cols]


def random_flip(x: Tensor, p: float = 0.5, generator: torch.Generator | None = None) -> Tensor:
    """Mirror each image left-right with probability ``p``."""
    flip = torch.rand(x.shape[0], generator=generator) < p
    out = x.clone()
    out[flip] = x[flip].flip(-1)
    return out


def cutout(x: Tensor, size: int, generator: torch.Generator | None = None) -> Tensor:
    """Zero one ``size x size`` square per image at a random centre (clipped at the borders)."""
    if size <= 0:
        return x
    b, _, h, w = x.shape
    cy = torch.randint(0, h, (b,), generator=generator)
    cx = torch.randint(0, w, (b,), generator=generator)
    yy = torch.arange(h)[None, :, None]
    xx = torch.arange(w)[None, None, :]
    top = cy[:, None, None] - size // 2
    left = cx[:, None, None] - size // 2
    inside = (yy >= top) & (yy < top + size) & (xx >= left) & (xx < left + size)
    return x.masked_fill(inside[:, None], 0)


@dataclass(frozen=True)
class Augment:
    """The recipe's augmentation: pad-and-crop, flip, cutout (each off at 0)."""

    pad: int = 4
    flip: float = 0.5
    cutout: int = 0

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        x = pad_crop(x, self.pad, generator)
        if self.flip > 0:
            x = random_flip(x, self.flip, generator)
        return cutout(x, self.cutout, generator)
