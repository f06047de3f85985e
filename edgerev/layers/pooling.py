"""Exact, volume-preserving pooling: channel pooling (i-RevNet) and batch pooling (RevNeXt).

Both move the four sub-images ``x[..., a::2, b::2]`` of every sample out of the spatial axes. Both
keep each sample's values inside that sample's own slice of memory (the pooled batch is ordered
sample-major), so the engine can permute a sample at a time in place, with a temporary of one
batch slice instead of a second copy of the activation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from edgerev.layers.base import Grads, Invertible, Tape, batch_slices, check_even


def _to_subimages(x: Tensor) -> Tensor:
    """``[B, C, H, W] -> [B, 2, 2, C, H/2, W/2]`` (a copy: the permutation is not a view)."""
    b, c, h, w = x.shape
    return x.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 3, 5, 1, 2, 4)


def _from_subimages(t: Tensor, channels: int) -> Tensor:
    """Inverse of :func:`_to_subimages`: ``[B, 2, 2, C, h, w] -> [B, C, 2h, 2w]``."""
    b, _, _, c, h, w = t.shape
    return t.permute(0, 3, 4, 1, 5, 2).reshape(b, c, 2 * h, 2 * w)


class _Pool(Invertible):
    """Shared machinery; subclasses only say where the sub-images go."""

    modes = ("invert", "recompute", "store")

    def _pooled_shape(self, b: int, c: int, h: int, w: int) -> tuple[int, int, int, int]:  # pragma: no cover
        raise NotImplementedError

    def _unpooled_shape(self, y: Tensor) -> tuple[int, int, int, int]:  # pragma: no cover
        raise NotImplementedError

    def forward(self, x: Tensor) -> Tensor:
        check_even(type(self).__name__, x)
        return _to_subimages(x).reshape(self._pooled_shape(*x.shape))

    def inverse(self, y: Tensor) -> Tensor:
        b, c, h, w = self._unpooled_shape(y)
        return _from_subimages(y.reshape(b, 2, 2, c, h // 2, w // 2), c)

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        check_even(type(self).__name__, x)
        b, c, h, w = x.shape
        flat = x.view(b, -1)
        for sl in tape.slices(flat):
            tmp = flat[sl].clone().view(-1, c, h, w)
            flat[sl].view(-1, 2, 2, c, h // 2, w // 2).copy_(_to_subimages(tmp))
            del tmp  # before the next slice's copy: one slice's temporary at a time
        return x.view(self._pooled_shape(b, c, h, w))

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        b, c, h, w = self._unpooled_shape(y)
        flat = y.view(b, -1)
        for sl in tape.slices(flat):
            tmp = flat[sl].clone().view(-1, 2, 2, c, h // 2, w // 2)
            # straight into the six-axis view of the destination: a reshape of the permuted copy would make a
            # second copy of the slice first
            flat[sl].view(-1, c, h // 2, 2, w // 2, 2).copy_(tmp.permute(0, 3, 4, 1, 5, 2))
            del tmp
        return y.view(b, c, h, w)

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads) -> tuple[Tensor, Tensor]:
        return self.inverse_(y, tape), self.inverse_(gy, tape)


class ChannelPool(_Pool):
    """Space to depth: ``[B, C, H, W] -> [B, 4C, H/2, W/2]``, exact."""

    def _pooled_shape(self, b: int, c: int, h: int, w: int) -> tuple[int, int, int, int]:
        return (b, 4 * c, h // 2, w // 2)

    def _unpooled_shape(self, y: Tensor) -> tuple[int, int, int, int]:
        b, c, h, w = y.shape
        return (b, c // 4, 2 * h, 2 * w)


class BatchPool(_Pool):
    """Space to batch: ``[B, C, H, W] -> [4B, C, H/2, W/2]``, exact.

    Channels, and so the weights (which grow with channels squared), stay fixed while the
    resolution drops; batch norm then sees the four sub-images of a sample as four samples.
    The model's head undoes it (see :func:`unpool_batch`).
    """

    def _pooled_shape(self, b: int, c: int, h: int, w: int) -> tuple[int, int, int, int]:
        return (4 * b, c, h // 2, w // 2)

    def _unpooled_shape(self, y: Tensor) -> tuple[int, int, int, int]:
        b, c, h, w = y.shape
        return (b // 4, c, 2 * h, 2 * w)


def unpool_batch(y: Tensor, samples: int) -> Tensor:
    """View a batch-pooled ``[P*B, C, h, w]`` as ``[B, P, C, h, w]`` (sample-major; no copy when contiguous)."""
    return y.reshape(samples, y.shape[0] // samples, *y.shape[1:])


POOLS = ("mean", "max")


def global_pool(y: Tensor, samples: int, kind: str) -> Tensor:
    """Per-sample features ``[B, C]`` of a (possibly batch-pooled) ``[P*B, C, h, w]`` activation.

    ``"mean"`` averages over space and the ``P`` sub-images; ``"max"`` takes their maximum (the
    RevNeXt head: a global max over space and over the batch-pooled sub-images).
    """
    u = unpool_batch(y, samples)
    if kind == "max":
        return u.amax(dim=(1, 3, 4))
    return u.mean(dim=(1, 3, 4))


def global_pool_grad(y: Tensor, gout: Tensor, samples: int, kind: str, slice_bytes: int | None = None) -> Tensor:
    """The gradient of :func:`global_pool` with respect to ``y``, a new tensor shaped like ``y``.

    ``"max"`` sends each feature's gradient to the maxima, split evenly among ties (as the backward
    of ``amax`` does, so the engine and plain autograd agree); the masks are built a batch slice at a
    time so that nothing but the result grows with the batch.
    """
    u = unpool_batch(y, samples)
    b, per, c, h, w = u.shape
    if kind != "max":
        gy = (gout / (per * h * w)).view(b, 1, c, 1, 1).expand(b, per, c, h, w)
        return gy.contiguous().view(y.shape)
    gy = torch.empty_like(y)
    gu = unpool_batch(gy, samples)
    for sl in batch_slices(u, budget=slice_bytes):
        hit = u[sl] == u[sl].amax(dim=(1, 3, 4), keepdim=True)
        share = gout[sl].view(-1, 1, c, 1, 1) / hit.sum(dim=(1, 3, 4), keepdim=True)
        torch.mul(hit, share, out=gu[sl])
        del hit, share  # one slice's masks at a time
    return gy
