"""The RevNeXt head: a linear layer without bias whose logits are scaled by a constant (0.125)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class ScaledLinear(nn.Linear):
    r"""``logits = scale * (W f + b)``, by default without ``b``: the authors' head (``scale = 0.125``).

    The constant keeps the logits small while the max-pooled features are large; unlike folding it
    into ``W``, it also scales the head's gradient and so its effective learning rate (by
    ``scale**2``). :meth:`folded` gives the same function as a plain ``nn.Linear`` for export.

    Args:
        in_features: features in.
        out_features: logits out.
        bias: whether to learn a bias.
        scale: the constant factor on the logits.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = False, scale: float = 0.125) -> None:
        super().__init__(in_features, out_features, bias=bias)
        if not scale > 0:
            raise ValueError(f"the head's scale must be positive, got {scale}")
        self.scale = float(scale)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale}"

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias) * self.scale

    def resized(self, out_features: int) -> ScaledLinear:
        """A new head of the same kind with ``out_features`` rows (fresh weights)."""
        return ScaledLinear(self.in_features, out_features, bias=self.bias is not None,
                            scale=self.scale).to(self.weight.device, self.weight.dtype)

    def folded(self) -> nn.Linear:
        """The same map as an ``nn.Linear`` with a bias (zero when there is none): what ONNX export writes."""
        lin = nn.Linear(self.in_features, self.out_features).to(self.weight.device, self.weight.dtype)
        with torch.no_grad():
            lin.weight.copy_(self.weight * self.scale)
            lin.bias.copy_(self.bias * self.scale if self.bias is not None else torch.zeros_like(lin.bias))
        return lin
