"""Invertible leaky ReLU."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from edgerev.layers.base import Grads, Invertible, Tape


class InvLeakyReLU(Invertible):
    r"""Leaky ReLU with a non-zero slope, hence a bijection.

    .. math::
        y = \begin{cases} x & x > 0 \\ n x & x \le 0 \end{cases}, \qquad
        x = \begin{cases} y & y > 0 \\ y / n & y \le 0 \end{cases}

    The gradient depends only on the sign of ``y``, which equals the sign of ``x``. Inverting
    multiplies the error on negative entries by ``1/n``: small slopes cost reconstruction SNR.

    Args:
        slope: the negative slope ``n``, in (0, 1].
    """

    modes = ("invert", "recompute", "store")
    per_sample = True

    def __init__(self, slope: float = 0.2) -> None:
        super().__init__()
        if not 0.0 < slope <= 1.0:
            raise ValueError(f"an invertible leaky ReLU needs a slope in (0, 1], got {slope}")
        self.slope = float(slope)

    def extra_repr(self) -> str:
        return f"slope={self.slope}"

    def forward(self, x: Tensor) -> Tensor:
        return F.leaky_relu(x, self.slope)

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        return F.leaky_relu_(x, self.slope)

    def forward_out(self, x: Tensor, tape: Tape) -> Tensor:
        return F.leaky_relu(x, self.slope)

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        return F.leaky_relu_(y, 1.0 / self.slope)

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> tuple[Tensor, Tensor]:
        gy = self.grad_(y, y, gy, tape, grads)
        return F.leaky_relu_(y, 1.0 / self.slope), gy

    def restore_(self, x: Tensor, g: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        y = F.leaky_relu_(x, self.slope)
        return y, torch.ops.aten.leaky_relu_backward.grad_input(g, y, 1.0 / self.slope, True, grad_input=g)

    def grad_(self, x: Tensor, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> Tensor:
        """The gradient depends on the output's signs only; neither ``x`` nor ``y`` is written. One kernel
        over the whole batch, writing ``gy`` in place: no temporary to slice."""
        return torch.ops.aten.leaky_relu_backward.grad_input(gy, y, self.slope, True, grad_input=gy)
