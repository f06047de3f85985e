"""Invertible batch normalization (RevNeXt, Hascoet et al.)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.layers.base import Grads, Invertible, Tape, add_grad, batch_slices, check_channels


class InvBatchNorm2d(Invertible):
    r"""Batch norm whose scale is bounded away from zero, so it can be inverted.

    .. math::
        s = |\gamma| + \epsilon_i, \qquad
        y = s\,\frac{x - \mu}{\sigma} + \beta, \qquad
        x = \frac{y - \beta}{s}\,\sigma + \mu

    with :math:`\mu, \sigma` the batch mean and standard deviation in training mode (running
    estimates in eval mode). Only the per-channel :math:`\mu, \sigma` are kept for the backward;
    the normalized input :math:`\hat x = (y - \beta) / s` is recovered from the output. Running
    statistics are updated once per training forward and never while the engine replays.

    The scale is the authors' ``|gamma| + eps_i``, continuous in ``gamma``. A signed variant,
    ``sign(gamma) (|gamma| + eps_i)``, jumps by ``2 eps_i`` where ``gamma`` crosses zero: a step that
    moves ``gamma`` across it changes the output by far more than the gradient predicts.

    Args:
        channels: number of channels.
        eps_i: the bound on the scale (the paper's new hyperparameter).
        eps: added to the variance, as in ``nn.BatchNorm2d``.
        momentum: running-statistics momentum, as in ``nn.BatchNorm2d``.
    """

    def __init__(self, channels: int, eps_i: float = 0.1, eps: float = 1e-5, momentum: float = 0.1) -> None:
        super().__init__()
        if eps_i <= 0:
            raise ValueError(f"eps_i must be positive to keep batch norm invertible, got {eps_i}")
        self.channels, self.eps_i, self.eps, self.momentum = channels, eps_i, eps, momentum
        self.weight = nn.Parameter(torch.ones(channels))
        self.bias = nn.Parameter(torch.zeros(channels))
        self.register_buffer("running_mean", torch.zeros(channels))
        self.register_buffer("running_var", torch.ones(channels))
        self._replay = False
        self._last_stats: tuple[Tensor, Tensor] | None = None

    def extra_repr(self) -> str:
        return f"{self.channels}, eps_i={self.eps_i}, momentum={self.momentum}"

    def scale(self) -> Tensor:
        """The bounded scale ``s = |gamma| + eps_i``; its derivative with respect to ``gamma`` is ``sign(gamma)``."""
        return self.weight.abs() + self.eps_i

    def _view(self, v: Tensor) -> Tensor:
        return v.view(1, -1, 1, 1)

    def forward(self, x: Tensor) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        s = self.scale()
        if not self.training:
            return F.batch_norm(x, self.running_mean, self.running_var, s, self.bias, False, 0.0, self.eps)
        # while replaying, momentum 0 leaves the running statistics as they are (passing them anyway
        # keeps what autograd saves identical to the first run, which checkpointing checks)
        y, mean, invstd = torch.ops.aten.native_batch_norm(
            x, s, self.bias, self.running_mean, self.running_var, True,
            0.0 if self._replay else self.momentum, self.eps,
        )
        self._last_stats = (mean.detach(), invstd.detach().reciprocal())
        return y

    # ---- engine face -------------------------------------------------------------------------

    def _stats(self, tape: Tape) -> tuple[Tensor, Tensor]:
        """Mean and standard deviation the last forward normalized with (running ones in eval mode)."""
        if not self.training:
            return self.running_mean, (self.running_var + self.eps).sqrt()
        return tape.stats[self][:2]

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        s = self.scale().detach()
        if self.training and not tape.replay:
            # the training forward: one fused pass measures the batch, normalizes and updates the
            # running statistics (once per step; never while the engine replays)
            update = not self._replay
            y, mean, invstd = torch.ops.aten.native_batch_norm(
                x, s, self.bias.detach(), self.running_mean if update else None,
                self.running_var if update else None, True, self.momentum, self.eps,
            )
            tape.stats[self] = (mean, invstd.reciprocal())
            # back into x: the engine's working buffer keeps one storage from stage to stage
            return x.copy_(y)
        mean, sigma = self._stats(tape)
        a = s / sigma
        return x.mul_(self._view(a)).add_(self._view(self.bias.detach() - mean * a))

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        a, b = self.inverse_coefficients(tape)
        return y.mul_(a).add_(b)

    def inverse_coefficients(self, tape: Tape) -> tuple[Tensor, Tensor]:
        """``(a, b)`` as ``[1, C, 1, 1]`` views with ``x = a y + b`` (computed once, applied to any slice)."""
        mean, sigma = self._stats(tape)
        a = sigma / self.scale().detach()
        return self._view(a), self._view(mean - self.bias.detach() * a)

    def grad_sums(self, y: Tensor, gy: Tensor) -> tuple[Tensor, Tensor]:
        r"""``(dbeta, ds) = (sum g, sum g xhat)`` per channel over the samples given, from the output
        ``y`` (``xhat = (y - beta) / s``) and its gradient ``g``: the gradients of the shift and of the
        scale ``s`` (:meth:`weight_grad` turns ``ds`` into ``gamma``'s), and in training mode the only
        two numbers per channel through which the backward couples the samples."""
        s, beta = self.scale().detach(), self.bias.detach()
        dbeta = gy.sum(dim=(0, 2, 3))
        gyy = torch.zeros_like(dbeta)
        for sl in batch_slices(y):
            gyy += (gy[sl] * y[sl]).sum(dim=(0, 2, 3))
        return dbeta, (gyy - beta * dbeta) / s

    def weight_grad(self, ds: Tensor) -> Tensor:
        """``gamma``'s gradient from the scale's: ``ds/dgamma = sign(gamma)`` (0 at ``gamma = 0``, as
        autograd's ``abs`` has it)."""
        return ds * self.weight.detach().sign()

    def grad_coefficients(self, tape: Tape, sums: tuple[Tensor, Tensor], n: int) -> tuple[Tensor, Tensor, Tensor]:
        r"""``(a, c, k)`` as ``[1, C, 1, 1]`` views with ``g_x = a g + c - k y``, given the whole batch's
        ``sums`` (:meth:`grad_sums`) over ``n`` values per channel. Once they are known the map is per
        sample, so it applies to any batch slice (:meth:`input_grad_`):

        .. math::
            a = \frac{s}{\sigma}, \qquad
            k = \frac{a\,ds}{n s}, \qquad
            c = a \Big(\frac{ds\,\beta}{n s} - \frac{d\beta}{n}\Big)

        (training mode; eval mode's map is ``g_x = a g``, per sample anyway).
        """
        _, sigma = self._stats(tape)
        s, beta = self.scale().detach(), self.bias.detach()
        dbeta, ds = sums
        a = s / sigma
        k = a * ds / (n * s)
        return self._view(a), self._view(a * (ds * beta / (n * s) - dbeta / n)), self._view(k)

    @staticmethod
    def input_grad_(y: Tensor, gy: Tensor, coefficients: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Write ``g_x = a g + c - k y`` over ``gy`` (:meth:`grad_coefficients`); ``y`` is the output."""
        a, c, k = coefficients
        torch.addcmul(c, gy, a, out=gy)
        return gy.addcmul_(y, k, value=-1.0)

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> tuple[Tensor, Tensor]:
        r"""Gradients from the output alone, with ``xhat = (y - beta) / s``:

        .. math::
            d\beta = \sum g, \quad ds = \sum g \hat x, \quad d\gamma = \operatorname{sign}(\gamma)\, ds, \quad
            g_x = \frac{s}{\sigma}\Big(g - \frac{d\beta}{N} - \hat x \frac{ds}{N}\Big)

        (training mode; in eval mode ``g_x = s g / \sigma``), written over ``gy`` in two passes,
        while ``y`` becomes the input ``x = \sigma \hat x + \mu`` in place.
        """
        dbeta, ds = self.grad_sums(y, gy)
        if self.training:
            self.input_grad_(y, gy, self.grad_coefficients(tape, (dbeta, ds), y.numel() // y.shape[1]))
        else:
            gy.mul_(self._view(self.scale().detach() / self._stats(tape)[1]))
        add_grad(grads, self.weight, self.weight_grad(ds))
        add_grad(grads, self.bias, dbeta)
        return self.inverse_(y, tape), gy
