"""Approximate activation storage (Chakrabarti & Moseley): a sign-preserving 8- or 4-bit copy.

The forward stays exact; only the copy kept for the backward pass is quantized. Each value keeps
its sign (one bit) and a magnitude on ``2**(bits-1)`` levels per channel, reconstructed at the
middle of its bin and never at zero, so ``x > 0`` holds for the copy exactly when it holds for
the original: leaky-ReLU and ReLU gradients computed from the copy are exact. Magnitudes are
clipped to a per-channel range: from the batch-norm scale and shift that produced the tensor when
there is one (``beta +/- k |s|``), else measured on the batch. Four-bit codes are packed two per
byte, so the kept copy is an eighth of the float32 tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edgerev.layers.base import batch_slices


@dataclass
class Quantized:
    """A quantized copy: ``codes`` (uint8, packed two per byte for 4 bits) and per-channel ranges."""

    codes: Tensor
    pos: Tensor  # [C] upper end of the positive range
    neg: Tensor  # [C] upper end of the negative magnitudes
    bits: int
    shape: torch.Size
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size()


def channel_range(x: Tensor) -> tuple[Tensor, Tensor]:
    """Largest positive value and largest negative magnitude per channel (dim 1), over the batch."""
    dims = [d for d in range(x.dim()) if d != 1]
    hi = x.amax(dim=dims).clamp_min(0)
    lo = (-x.amin(dim=dims)).clamp_min(0)
    return hi, lo


def bn_range(scale: Tensor, shift: Tensor, k: float = 4.0) -> tuple[Tensor, Tensor]:
    """Range of ``s * xhat + beta`` for ``|xhat| <= k``: the paper's clipping after batch norm."""
    hi = (shift + k * scale.abs()).clamp_min(0)
    lo = (-(shift - k * scale.abs())).clamp_min(0)
    return hi, lo


def _view(v: Tensor, dim: int) -> Tensor:
    return v.view(1, -1, *([1] * (dim - 2)))


def quantize(x: Tensor, bits: int, rng: tuple[Tensor, Tensor] | None = None) -> Quantized:
    """Sign-preserving ``bits``-bit copy of ``x`` (``bits`` is 8 or 4); ``x`` is left untouched."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if x.dim() < 2:
        raise ValueError(f"quantize needs a [batch, channels, ...] tensor, got shape {tuple(x.shape)}")
    hi, lo = channel_range(x) if rng is None else rng
    # a range of 0 would put a whole sign at zero on the way back: keep every range positive
    floor = torch.finfo(x.dtype).eps
    hi, lo = hi.clamp_min(floor), lo.clamp_min(floor)
    levels = 2 ** (bits - 1)
    tiny = torch.finfo(x.dtype).tiny
    inv_hi = _view(levels / hi.clamp_min(tiny), x.dim())
    inv_lo = _view(levels / lo.clamp_min(tiny), x.dim())
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for sl in batch_slices(x):
        xs = x[sl]
        positive = xs > 0
        mag = torch.where(positive, xs * inv_hi, -xs * inv_lo).floor_().clamp_(0, levels - 1)
        codes[sl] = (mag + positive * levels).to(torch.uint8)
    if bits == 4:
        flat = codes.view(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        codes = flat[0::2] | (flat[1::2] << 4)
    return Quantized(codes, hi, lo, bits, x.shape, x.dtype)


def dequantize(q: Quantized) -> Tensor:
    """Float tensor of the original shape: each code at the middle of its bin, with its sign."""
    levels = 2 ** (q.bits - 1)
    codes = q.codes
    if q.bits == 4:
        n = 1
        for s in q.shape:
            n *= s
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)[:n]
    codes = codes.view(q.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=codes.device)
    dim = len(q.shape)
    step_hi = _view(q.pos / levels, dim).to(q.dtype)
    step_lo = _view(q.neg / levels, dim).to(q.dtype)
    for sl in batch_slices(out):
        c = codes[sl]
        positive = c >= levels
        mag = (c - positive.to(torch.uint8) * levels).to(q.dtype) + 0.5
        out[sl] = torch.where(positive, mag * step_hi, -mag * step_lo)
    return out
