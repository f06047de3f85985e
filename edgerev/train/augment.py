"""Augmentation of ``uint8`` or float image batches ``[B, C, H, W]`` in torch: pad-and-crop, flip, cutout, and
FixMatch's strong view (:class:`StrongAugment`)."""

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


def _grey(x: Tensor) -> Tensor:
    """Luminance ``[B, 1, H, W]`` of float images (ITU-R 601, as PIL's ``L``); the mean of one channel."""
    if x.shape[1] != 3:
        return x.mean(dim=1, keepdim=True)
    return (0.299 * x[:, 0:1] + 0.587 * x[:, 1:2] + 0.114 * x[:, 2:3])


def _smooth(x: Tensor) -> Tensor:
    """PIL's SMOOTH filter (a 3x3 kernel, 5 at the centre, 1 around), per channel, edges replicated."""
    k = torch.ones(3, 3, dtype=x.dtype)
    k[1, 1] = 5.0
    k = (k / k.sum()).expand(x.shape[1], 1, 3, 3)
    return F.conv2d(F.pad(x, (1, 1, 1, 1), mode="replicate"), k, groups=x.shape[1])


def _blend(a: Tensor, b: Tensor, factor: Tensor) -> Tensor:
    """``b + factor (a - b)``: PIL's ImageEnhance (factor 1: ``a``; 0: ``b``; above 1: away from ``b``)."""
    return b + factor[:, None, None, None] * (a - b)


def _ops(x: Tensor, m: Tensor) -> list[Tensor]:
    """Every strong operation applied to the whole float batch ``x`` (0..255) at magnitudes ``m`` in [0, 1]
    (one per image; the sign of an enhancement is drawn into ``m`` by the caller, see :class:`StrongAugment`)."""
    factor = 1.0 + 0.9 * m  # RandAugment's enhancement range, 0.1 .. 1.9
    grey = _grey(x)
    bits = (8 - (4 * m.abs()).round()).clamp(4, 8)  # posterize to 4..8 bits
    step = (2.0 ** (8 - bits))[:, None, None, None]
    threshold = (255 * (1 - m.abs()))[:, None, None, None]  # solarize above it
    return [
        x,                                                        # identity
        _blend(x, torch.zeros_like(x), factor),                   # brightness
        _blend(x, grey.mean(dim=(2, 3), keepdim=True).expand_as(x), factor),  # contrast
        _blend(x, grey.expand_as(x), factor),                     # colour (saturation)
        _blend(x, _smooth(x), factor),                            # sharpness
        _blend(_smooth(_smooth(x)), x, m.abs()),                  # blur, by its magnitude
        torch.floor(x / step) * step,                             # posterize
        torch.where(x >= threshold, 255 - x, x),                  # solarize
    ]


STRONG_OPS = ("identity", "brightness", "contrast", "colour", "sharpness", "blur", "posterize", "solarize")


@dataclass(frozen=True)
class StrongAugment:
    """FixMatch's strong view, on tensors: ``ops`` operations drawn per image from :data:`STRONG_OPS` at a
    random magnitude each (RandAugment with random magnitude, as FixMatch's RA variant), a shift of up to
    ``pad`` pixels, then Cutout of a square ``cutout`` of the side (at least 1 pixel).

    Every draw comes from the generator: the same generator state gives the same views (the trainer seeds
    it from the recipe's seed and the step). ``uint8`` in, ``uint8`` out (float in, float out, 0..255).
    """

    ops: int = 2
    pad: int = 2
    cutout: float = 0.5

    def __call__(self, x: Tensor, generator: torch.Generator | None = None) -> Tensor:
        dtype = x.dtype
        out = x.float()
        b = x.shape[0]
        for _ in range(self.ops):
            which = torch.randint(0, len(STRONG_OPS), (b,), generator=generator)
            m = torch.rand(b, generator=generator)
            sign = torch.where(torch.rand(b, generator=generator) < 0.5, -1.0, 1.0)
            results = _ops(out, m * sign)
            chosen = torch.stack(results)[which, torch.arange(b)]
            out = chosen.clamp(0, 255)
        out = pad_crop(out, self.pad, generator)
        out = cutout(out, max(1, round(self.cutout * min(x.shape[-2:]))), generator)
        return out.round().to(dtype) if dtype == torch.uint8 else out.to(dtype)
