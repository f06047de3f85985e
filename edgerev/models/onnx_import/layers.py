"""The few modules and functions the import needs that torch does not offer as such (fx records them by name)."""

from __future__ import annotations

import torch
from torch import nn


class PRelu(nn.Module):
    """ONNX PRelu: ``x`` where ``x >= 0``, else ``slope * x``, with the slope broadcast as ONNX does.

    ``nn.PReLU`` takes one slope per channel on axis 1 only; an ONNX slope may have any shape that broadcasts to
    the input (``[C, 1, 1]``, ``[1]``, ``[C]`` against the last axis), so the original's shape is kept.
    """

    def __init__(self, slope: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(slope.clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.where(x >= 0, x, x * self.weight)


def hard_sigmoid(x: torch.Tensor, alpha: float, beta: float) -> torch.Tensor:
    """ONNX HardSigmoid: ``clamp(alpha * x + beta, 0, 1)`` (torch's ``hardsigmoid`` fixes alpha = 1/6)."""
    return torch.clamp(x * alpha + beta, 0.0, 1.0)


def crop(x: torch.Tensor, begin: tuple[int, ...], end: tuple[int, ...]) -> torch.Tensor:
    """Remove ``begin[i]`` and ``end[i]`` elements from the start and end of spatial axis ``i`` (axes 2, 3...)."""
    index = [slice(None), slice(None)] + [slice(b, x.shape[2 + i] - e) for i, (b, e) in enumerate(zip(begin, end))]
    return x[tuple(index)]
