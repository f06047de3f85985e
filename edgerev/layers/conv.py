"""Invertible convolution: the smallest coupling, one 3x3 convolution on each channel half."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.errors import ShapeError
from edgerev.layers.base import Grads, Invertible, Tape, add_grad, check_channels, halves


class InvConv2d(Invertible):
    r"""Additive coupling whose two functions are single convolutions of ``C/2 -> C/2`` channels.

    .. math::
        y_1 = x_1 + w_f * x_2, \qquad y_2 = x_2 + w_g * y_1 \\
        x_2 = y_2 - w_g * y_1, \qquad x_1 = y_1 - w_f * x_2

    Every operation is per sample, so the engine computes the convolution temporaries in batch
    slices and overwrites the halves in place.

    Args:
        channels: number of channels (even).
        kernel_size: odd kernel size; padding keeps the resolution.
    """

    per_sample = True

    def __init__(self, channels: int, kernel_size: int = 3) -> None:
        super().__init__()
        if channels % 2 or channels < 2:
            raise ShapeError(f"InvConv2d splits channels in halves and needs an even count, got {channels}")
        if kernel_size % 2 == 0:
            raise ValueError(f"InvConv2d needs an odd kernel size to keep the resolution, got {kernel_size}")
        self.channels, self.padding = channels, kernel_size // 2
        half = channels // 2
        self.weight_f = nn.Parameter(torch.empty(half, half, kernel_size, kernel_size))
        self.weight_g = nn.Parameter(torch.empty(half, half, kernel_size, kernel_size))
        for w in (self.weight_f, self.weight_g):
            nn.init.kaiming_uniform_(w, a=math.sqrt(5))

    def extra_repr(self) -> str:
        return f"{self.channels}, kernel_size={self.weight_f.shape[-1]}"

    def _conv(self, x: Tensor, w: Tensor) -> Tensor:
        return F.conv2d(x, w, padding=self.padding)

    def forward(self, x: Tensor) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        x1, x2 = halves(x)
        y1 = x1 + self._conv(x2, self.weight_f)
        y2 = x2 + self._conv(y1, self.weight_g)
        return torch.cat([y1, y2], dim=1)

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        wf, wg = self.weight_f.detach(), self.weight_g.detach()
        x1, x2 = halves(x)
        for sl in tape.slices(x, 0.5):
            x1[sl].add_(self._conv(x2[sl], wf))
            x2[sl].add_(self._conv(x1[sl], wg))
        return x

    def forward_out(self, x: Tensor, tape: Tape) -> Tensor:
        """:meth:`forward_` into a new tensor, ``x`` left as it is: each sum is written straight into the output, so
        ``x`` is never copied first (the same two convolutions and additions, one kernel fewer)."""
        check_channels(type(self).__name__, x, self.channels)
        wf, wg = self.weight_f.detach(), self.weight_g.detach()
        x1, x2 = halves(x)
        y = torch.empty_like(x, memory_format=torch.contiguous_format)
        y1, y2 = halves(y)
        for sl in tape.slices(x, 0.5):
            torch.add(x1[sl], self._conv(x2[sl], wf), out=y1[sl])
            torch.add(x2[sl], self._conv(y1[sl], wg), out=y2[sl])
        return y

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        wf, wg = self.weight_f.detach(), self.weight_g.detach()
        y1, y2 = halves(y)
        for sl in tape.slices(y, 0.5):
            y2[sl].sub_(self._conv(y1[sl], wg))
            y1[sl].sub_(self._conv(y2[sl], wf))
        return y

    def restore_(self, x: Tensor, g: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        """The gradient map is again a coupling, ``g1 += wg^T g2`` then ``g2 += wf^T g1`` (:meth:`_grad_through`),
        and reads no activation: undone as ``g2 -= wf^T g1`` then ``g1 -= wg^T g2``, with the forward, slice by
        slice."""
        wf, wg = self.weight_f.detach(), self.weight_g.detach()
        x1, x2 = halves(x)
        g1, g2 = halves(g)
        for sl in tape.slices(g, 1.0):
            g2[sl].sub_(self._conv_backward(g1[sl], x2[sl], wf, False)[0])
            g1[sl].sub_(self._conv_backward(g2[sl], x1[sl], wg, False)[0])
            x1[sl].add_(self._conv(x2[sl], wf))
            x2[sl].add_(self._conv(x1[sl], wg))
        return x, g

    def _conv_backward(self, gout: Tensor, inp: Tensor, w: nn.Parameter,
                       want_gw: bool) -> tuple[Tensor, Tensor | None]:
        p = self.padding
        gin, gw, _ = torch.ops.aten.convolution_backward(
            gout, inp, w.detach(), None, [1, 1], [p, p], [1, 1], False, [0, 0], 1,
            [True, want_gw and w.requires_grad, False],
        )
        return gin, gw

    def grad_(self, x: Tensor, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> Tensor:
        """As :meth:`backward_` with the input known: ``g``'s convolution read ``y1`` (the output's first
        half) and ``f``'s read ``x2`` (the input's second half), so no convolution is run again."""
        _, x2 = halves(x)
        y1, _ = halves(y)
        return self._grad_through(y1, x2, gy, grads, tape, rebuild=False)

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> tuple[Tensor, Tensor]:
        y1, y2 = halves(y)
        return y, self._grad_through(y1, y2, gy, grads, tape, rebuild=True)

    def _grad_through(self, y1: Tensor, x2: Tensor, gy: Tensor, grads: Grads | None, tape: Tape,
                      rebuild: bool) -> Tensor:
        """``gy`` becomes the input gradient, slice by slice: the ``y2`` gradient through ``g`` (which read
        ``y1``), then the total ``y1`` gradient through ``f`` (which read ``x2``). With ``rebuild`` the
        second argument is the output's ``y2`` and the output becomes the input on the way:
        ``x2 = y2 - g(y1)`` before ``f``'s part reads it, ``x1 = y1 - f(x2)`` after."""
        wf, wg = self.weight_f, self.weight_g
        want_gw = grads is not None
        g1, g2 = halves(gy)
        dwf = dwg = None
        # live per slice: a contiguous copy of one half's slice and the input gradient of one half's slice
        for sl in tape.slices(gy, 1.0):
            # one contiguous copy of each input serves both the convolution and its backward
            inp = y1[sl].contiguous()
            if rebuild:
                x2[sl].sub_(self._conv(inp, wg.detach()))
            gin, gw = self._conv_backward(g2[sl], inp, wg, want_gw)
            g1[sl].add_(gin)
            del gin  # before the next convolution's: one input gradient of a slice at a time
            dwg = gw if dwg is None or gw is None else dwg.add_(gw)
            inp = x2[sl].contiguous()
            if rebuild:
                y1[sl].sub_(self._conv(inp, wf.detach()))
            gin, gw = self._conv_backward(g1[sl], inp, wf, want_gw)
            g2[sl].add_(gin)
            dwf = gw if dwf is None or gw is None else dwf.add_(gw)
            del inp, gin
        if dwf is not None:
            add_grad(grads, self.weight_f, dwf)
        if dwg is not None:
            add_grad(grads, self.weight_g, dwg)
        return gy
