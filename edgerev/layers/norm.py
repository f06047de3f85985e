"""Invertible batch normalization (RevNeXt, Hascoet et al.)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev._torchapi import copy_all, foreach, is_fake
from edgerev.layers.base import Grads, Invertible, Tape, add_grad, check_channels


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
        self._last_stats = (mean.detach(), invstd.detach(), x.numel() // x.shape[1])
        return y

    # ---- engine face -------------------------------------------------------------------------

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        if self.training and not tape.replay:
            # the training forward: one fused pass measures the batch, normalizes and updates the
            # running statistics (once per step; never while the engine replays)
            update = not self._replay
            scale = tape.scales.get(self)
            scale = self.scale().detach() if scale is None else scale
            args = (x, scale, self.bias.detach(), self.running_mean if update else None,
                    self.running_var if update else None, True, self.momentum, self.eps)
            if not x.is_contiguous():
                y, mean, invstd = torch.ops.aten.native_batch_norm(*args)
                # back into x: the engine's working buffer keeps one storage from stage to stage
                x.copy_(y)
            else:
                # normalized over its own storage, with no copy: CPU's and CUDA's kernels measure the batch first,
                # then write each element of a dense tensor after reading it (a strided view would not be safe)
                stat = torch.float64 if x.dtype == torch.float64 else torch.float32  # the kernels' accumulate type
                mean = x.new_empty(x.shape[1], dtype=stat)
                invstd = x.new_empty(x.shape[1], dtype=stat)
                torch.ops.aten.native_batch_norm.out(*args, out=x, save_mean=mean, save_invstd=invstd)
            tape.stats[self] = (mean, invstd, x.numel() // x.shape[1])
            return x
        c = self.coefficients(tape)
        return torch.addcmul(c.shift, x, c.a, out=x)

    def forward_out(self, x: Tensor, tape: Tape) -> Tensor:
        """:meth:`forward_` replaying the forward's statistics, into a new tensor (one kernel, no copy of ``x``)."""
        if self.training and not tape.replay:
            return self.forward_(x.clone(), tape)
        c = self.coefficients(tape)
        return torch.addcmul(c.shift, x, c.a)

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        c = self.coefficients(tape)
        return torch.addcmul(c.inverse_shift, y, c.inverse_a, out=y)

    def inverse_coefficients(self, tape: Tape) -> tuple[Tensor, Tensor]:
        """``(a, b)`` as ``[1, C, 1, 1]`` views with ``x = a y + b`` (computed once a step, applied to any slice)."""
        c = self.coefficients(tape)
        return c.inverse_a, c.inverse_shift

    def coefficients(self, tape: Tape) -> Coefficients:
        """This batch norm's per-channel :class:`Coefficients` for the step ``tape`` records: computed once a
        step, together with those of every batch norm on the tape (a few multi-tensor kernels for all)."""
        c = tape.coefficients.get(self)
        if c is None:
            norms = [m for m, st in tape.stats.items()
                     if isinstance(m, InvBatchNorm2d) and m.training and m not in tape.coefficients and len(st) == 3]
            if self not in norms:
                norms.append(self)
            for m, value in zip(norms, _coefficients(norms, tape)):
                tape.coefficients[m] = value
            c = tape.coefficients[self]
        return c

    def _stats(self, tape: Tape) -> tuple[Tensor, Tensor, int]:
        """Mean, inverse standard deviation and values per channel the last forward normalized with (running
        statistics in eval mode, with no count)."""
        if not self.training:
            return self.running_mean, (self.running_var + self.eps).rsqrt(), 0
        return tape.stats[self]

    def grad_sums(self, y: Tensor, gy: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        r"""``(dbeta, ds) = (sum g, sum g xhat)`` per channel over the samples given, from the output
        ``y`` (``xhat = (y - beta) / s``) and its gradient ``g``: the gradients of the shift and of the
        scale ``s`` (:meth:`grad_terms` turns ``ds`` into ``gamma``'s), and in training mode the only
        two numbers per channel through which the backward couples the samples. One fused reduction
        (batch norm's own backward, asked for its two sums only: no temporary of ``y``'s size)."""
        c = self.coefficients(tape)
        if is_fake(y):
            # the fake and meta kernels of the fused reduction allocate the input gradient the real ones
            # skip: one op with two outputs of the same sizes keeps the predicted bytes and op count exact
            std, mean = torch.std_mean(gy, dim=(0, 2, 3))
            return mean, std
        # the weight only scales the input gradient, which is not asked for; CUDA's kernel wants one all the same
        _, ds, dbeta = torch.ops.aten.native_batch_norm_backward(
            gy, y, c.inv_s, None, None, c.beta, c.inv_s, True, 0.0, [False, True, True])
        return dbeta, ds

    def grad_terms(self, tape: Tape, sums: tuple[Tensor, Tensor]) -> GradTerms:
        r""":class:`GradTerms` from the whole batch's ``sums`` (:meth:`grad_sums`) over the ``n`` values per channel the
        forward normalized: ``gamma``'s gradient ``sign(gamma) ds`` (``ds/dgamma = sign(gamma)``, 0 at ``gamma = 0``,
        as autograd's ``abs`` has it) and, in training mode, ``(a, c, k)`` as ``[1, C, 1, 1]`` views with
        ``g_x = a g + c - k y``. Once they are known the map is per sample, so it applies to any batch slice
        (:meth:`input_grad_`):

        .. math::
            a = \frac{s}{\sigma}, \qquad
            k = \frac{a\,ds}{n s}, \qquad
            c = k \beta - \frac{a\,d\beta}{n}

        and the same map undone, ``g = g_x / a - c / a + (k / a) y`` (:meth:`restore_`), from the same two kernels:
        ``k / a = ds / (n s)`` and ``-c / a = d\beta / n - \beta\,ds / (n s)``.

        Three small kernels: ``sign(gamma) ds``; ``ds`` times the step's four per-channel factors at once; then the
        two ``d\beta`` terms. (Eval mode's map is ``g_x = a g``, per sample anyway: ``input`` is None.) ``gamma``'s
        gradient is a tensor of its own: a view of a larger one would keep that alive as long as the gradient.
        """
        co = self.coefficients(tape)
        dbeta, ds = sums
        weight = ds * co.sign
        if not self.training:
            return GradTerms(weight, None, None)
        terms = ds * co.ds_factors  # rows: k, a beta ds / (n s), ds / (n s), -beta ds / (n s)
        terms[1::2].addcmul_(dbeta, co.over_n, value=-1.0)  # rows 1 and 3: c, and -c / a
        k, c, k_over_a, minus_c_over_a = terms
        return GradTerms(weight, (co.a, _view(c), _view(k)), (co.inverse_a, _view(minus_c_over_a), _view(k_over_a)))

    @staticmethod
    def input_grad_(y: Tensor, gy: Tensor, coefficients: tuple[Tensor, Tensor, Tensor]) -> Tensor:
        """Write ``g_x = a g + c - k y`` over ``gy`` (:meth:`grad_terms`); ``y`` is the output."""
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
        dbeta, ds = self.grad_sums(y, gy, tape)
        terms = self.grad_terms(tape, (dbeta, ds))
        if terms.input is not None:
            self.input_grad_(y, gy, terms.input)
        else:
            gy.mul_(self.coefficients(tape).a)
        tape.undo[self] = terms.undo
        add_grad(grads, self.weight, terms.weight)
        add_grad(grads, self.bias, dbeta)
        return self.inverse_(y, tape), gy

    def restore_(self, x: Tensor, g: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        r"""Undo :meth:`backward_`'s gradient map with the terms it left on the tape:
        ``g = g_x / a - c / a + (k / a) y`` with ``y`` the output (eval mode: ``g = g_x / a``). Two kernels over the
        batch, none per channel."""
        y = self.forward_(x, tape)
        if not self.training:
            return y, g.mul_(self.coefficients(tape).inverse_a)
        inverse_a, minus_c_over_a, k_over_a = tape.undo[self]
        torch.addcmul(minus_c_over_a, g, inverse_a, out=g)
        return y, g.addcmul_(y, k_over_a)


def prepare(modules: Iterable[nn.Module], tape: Tape) -> None:
    """Put the bounded scale of every :class:`InvBatchNorm2d` among ``modules`` that the tape lacks on ``tape``, in
    two multi-tensor kernels for all of them: the weights do not change inside a step, and the forward of each batch
    norm would otherwise launch two small kernels of its own (the engine calls it as a step begins, the coefficients
    for what the forward did not run)."""
    norms = [m for m in modules if isinstance(m, InvBatchNorm2d) and m not in tape.scales]
    if norms:
        scales = foreach("add", foreach("abs", [m.weight.detach() for m in norms]), [m.eps_i for m in norms])
        tape.scales.update(zip(norms, scales))


def _view(v: Tensor) -> Tensor:
    return v.view(1, -1, 1, 1)


@dataclass(frozen=True)
class Coefficients:
    """A batch norm's per-channel values for one step, from its statistics and weights (``[C]`` vectors
    unless said; ``[1, C, 1, 1]`` views broadcast over a batch).

    Attributes:
        a, shift: the forward ``y = a x + shift`` (views): ``a = s / sigma``, ``shift = beta - mu a``.
        inverse_a, inverse_shift: the inverse ``x = inverse_a y + inverse_shift`` (views).
        beta, inv_s: the shift and ``1 / s``, for the fused reduction's ``xhat = (y - beta) / s``.
        sign: ``sign(gamma)``, the scale's derivative.
        over_n: ``[2, C]``: ``a / n`` and ``-1 / n`` with ``n`` values per channel (training mode), the factors of
            ``d beta`` in :meth:`InvBatchNorm2d.grad_terms`.
        ds_factors: ``[4, C]``: ``a / (n s)``, ``a beta / (n s)``, ``1 / (n s)`` and ``-beta / (n s)``, the per-channel
            factors of the scale's gradient ``ds`` in :meth:`InvBatchNorm2d.grad_terms` (rows of one tensor: one
            kernel multiplies ``ds`` by all four).
    """

    a: Tensor
    shift: Tensor
    inverse_a: Tensor
    inverse_shift: Tensor
    beta: Tensor
    inv_s: Tensor
    sign: Tensor
    over_n: Tensor
    ds_factors: Tensor


@dataclass(frozen=True)
class GradTerms:
    """What a batch norm's backward needs once the whole batch's sums are known (:meth:`InvBatchNorm2d.grad_terms`).

    Attributes:
        weight: ``gamma``'s gradient.
        input: ``(a, c, k)`` of the input gradient ``g_x = a g + c - k y`` (training mode; None in eval mode).
        undo: ``(1 / a, -c / a, k / a)``: the same map undone, ``g = g_x / a - c / a + (k / a) y``
            (:meth:`InvBatchNorm2d.restore_`; training mode, None in eval mode).
    """

    weight: Tensor
    input: tuple[Tensor, Tensor, Tensor] | None
    undo: tuple[Tensor, Tensor, Tensor] | None


def _coefficients(norms: list[InvBatchNorm2d], tape: Tape) -> list[Coefficients]:
    """:class:`Coefficients` of ``norms`` at once: each step of the arithmetic is one multi-tensor op over all
    of them, not one op per batch norm (on a GPU every op is a kernel launch)."""
    stats = [m._stats(tape) for m in norms]
    means = [st[0] for st in stats]
    invstds = [st[1] for st in stats]
    counts = [float(max(st[2], 1)) for st in stats]
    weights = [m.weight.detach() for m in norms]
    betas = [m.bias.detach() for m in norms]
    prepare(norms, tape)  # the scales the forward did not put on the tape
    scales = [tape.scales[m] for m in norms]
    inv_s = foreach("reciprocal", scales)
    a = foreach("mul", scales, invstds)
    inverse_a = foreach("reciprocal", a)
    shift = foreach("sub", betas, foreach("mul", means, a))
    inverse_shift = foreach("sub", means, foreach("mul", betas, inverse_a))
    sign = foreach("sign", weights)
    a_over_n = foreach("div", a, counts)
    a_over_ns = foreach("mul", a_over_n, inv_s)
    shift_over = foreach("mul", a_over_ns, betas)
    # the same factors over a, for the map undone: 1 / (n s), -beta / (n s), -1 / n
    minus_inverse_a = foreach("neg", inverse_a)
    over_ns = foreach("mul", a_over_ns, inverse_a)
    minus_shift_over = foreach("mul", shift_over, minus_inverse_a)
    minus_over_n = foreach("mul", a_over_n, minus_inverse_a)
    # each batch norm's factors as the rows of two tensors, filled for all of them by one kernel
    over_n = [torch.empty(2, len(b), dtype=b.dtype, device=b.device) for b in betas]
    ds_factors = [torch.empty(4, len(b), dtype=b.dtype, device=b.device) for b in betas]
    rows = [(over_n[i], (a_over_n[i], minus_over_n[i])) for i in range(len(norms))]
    rows += [(ds_factors[i], (a_over_ns[i], shift_over[i], over_ns[i], minus_shift_over[i])) for i in range(len(norms))]
    copy_all([t[r] for t, values in rows for r in range(len(values))], [v for _, values in rows for v in values])
    return [Coefficients(_view(a[i]), _view(shift[i]), _view(inverse_a[i]), _view(inverse_shift[i]), betas[i],
                         inv_s[i], sign[i], over_n[i], ds_factors[i]) for i in range(len(norms))]

