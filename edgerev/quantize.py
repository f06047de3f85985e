"""Approximate activation storage (Chakrabarti & Moseley): a sign-preserving 8- or 4-bit copy.

The forward stays exact; only the copy kept for the backward pass is quantized. The ``2**bits`` codes
of a channel are split between the two signs in proportion to their ranges (at least one code each):
``P`` codes for ``(0, hi]`` and ``N`` for ``[-lo, 0]``, each value reconstructed at the middle of its
bin and never at zero, so ``x > 0`` holds for the copy exactly when it holds for the original: ReLU
and leaky-ReLU gradients computed from the copy are exact (the sign is one bit of information the
code carries). A ReLU output (``lo = 0``) thus gets ``2**bits - 1`` levels for its positive values
and one code for its zeros; a centred batch-norm output about half the codes per sign, as the
paper's uniform grid aligned on zero. Ranges are per channel: the batch's largest value of each sign,
or a given range (values beyond it are clipped to its end bins). Four-bit codes are packed two per
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
    neg_codes: Tensor  # [C] codes given to values <= 0 (the others go to positive values)
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


def split_codes(hi: Tensor, lo: Tensor, bits: int) -> tuple[Tensor, Tensor]:
    """Codes per channel for positive values and for the others, in proportion to the two ranges."""
    total = 2**bits
    positive = (total * hi / (hi + lo)).round_().clamp_(1, total - 1)
    return positive, total - positive


def quantize(x: Tensor, bits: int, rng: tuple[Tensor, Tensor] | None = None) -> Quantized:
    """Sign-preserving ``bits``-bit copy of ``x`` (``bits`` is 8 or 4); ``x`` is left untouched."""
    if bits not in (8, 4):
        raise ValueError(f"bits must be 8 or 4, got {bits}")
    if x.dim() < 2:
        raise ValueError(f"quantize needs a [batch, channels, ...] tensor, got shape {tuple(x.shape)}")
    hi, lo = channel_range(x) if rng is None else rng
    # a range of 0 would put a whole sign at zero on the way back: keep every range positive
    floor = torch.finfo(x.dtype).eps
    hi, lo = hi.to(x.dtype).clamp_min(floor), lo.to(x.dtype).clamp_min(floor)
    npos, nneg = split_codes(hi, lo, bits)
    dim = x.dim()
    inv_hi, inv_lo = _view(npos / hi, dim), _view(nneg / lo, dim)
    top_pos, top_neg = _view(npos - 1, dim), _view(nneg - 1, dim)
    first_pos = _view(nneg, dim)
    codes = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    for sl in batch_slices(x):
        xs = x[sl]
        positive = xs > 0
        up = (xs * inv_hi).floor_().clamp_(min=0).minimum(top_pos).add_(first_pos)
        down = (xs * -inv_lo).floor_().clamp_(min=0).minimum(top_neg)
        codes[sl] = torch.where(positive, up, down).to(torch.uint8)
    if bits == 4:
        flat = codes.view(-1)
        if flat.numel() % 2:
            flat = torch.cat([flat, flat.new_zeros(1)])
        codes = flat[0::2] | (flat[1::2] << 4)
    return Quantized(codes, hi, lo, nneg.to(torch.uint8), bits, x.shape, x.dtype)


def dequantize(q: Quantized) -> Tensor:
    """Float tensor of the original shape: each code at the middle of its bin, with its sign."""
    codes = q.codes
    if q.bits == 4:
        n = 1
        for s in q.shape:
            n *= s
        codes = torch.stack([codes & 0x0F, codes >> 4], dim=1).view(-1)[:n]
    codes = codes.view(q.shape)
    out = torch.empty(q.shape, dtype=q.dtype, device=codes.device)
    dim = len(q.shape)
    nneg = q.neg_codes.to(q.dtype)
    npos = 2**q.bits - nneg
    step_hi, step_lo = _view(q.pos / npos, dim), _view(q.neg / nneg, dim)
    first_pos = _view(q.neg_codes, dim)
    for sl in batch_slices(out):
        c = codes[sl]
        positive = c >= first_pos
        up = (c - first_pos).to(q.dtype).add_(0.5).mul_(step_hi)
        down = c.to(q.dtype).add_(0.5).mul_(-step_lo)
        out[sl] = torch.where(positive, up, down)
    return out
