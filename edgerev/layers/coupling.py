"""Additive coupling (RevNet) and the RevNeXt hybrid block."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from edgerev.errors import ShapeError
from edgerev.layers.base import (
    Grads,
    Invertible,
    InvSequential,
    Tape,
    add_grad,
    add_grads,
    batch_slices,
    check_channels,
    halves,
)
from edgerev.layers.norm import InvBatchNorm2d


class Coupling(Invertible):
    r"""RevNet additive coupling over the two channel halves (Gomez et al. 2017).

    .. math::
        y_1 = x_1 + F(x_2), \qquad y_2 = x_2 + G(y_1) \\
        x_2 = y_2 - G(y_1), \qquad x_1 = y_1 - F(x_2)

    ``F`` and ``G`` map ``C/2`` channels to ``C/2`` channels at stride 1 and may be any modules.
    When both are chains of invertible layers (:class:`HybridBlock`), the engine can also run the
    block in ``invert`` mode: block inverse, then layer-wise inverses along the gradient; and when
    every layer of the chains is per sample or an invertible batch norm, in ``floor`` mode: the same
    without the half-volume copy of a gradient (:meth:`floor_backward_`).

    Args:
        channels: number of channels of the block (even).
        f: the residual function applied to ``x_2``.
        g: the residual function applied to ``y_1``.
    """

    def __init__(self, channels: int, f: nn.Module, g: nn.Module) -> None:
        super().__init__()
        if channels % 2 or channels < 2:
            raise ShapeError(f"a coupling splits channels in halves and needs an even count, got {channels}")
        self.channels = channels
        self.f, self.g = f, g
        layerwise = isinstance(f, Invertible) and isinstance(g, Invertible)
        if layerwise and _sliceable(f) and _sliceable(g):
            self.modes = ("invert", "floor", "recompute", "store")
        elif layerwise:
            self.modes = ("invert", "recompute", "store")
        else:
            self.modes = ("recompute", "store")

    def forward(self, x: Tensor) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        x1, x2 = halves(x)
        y1 = x1 + self.f(x2)
        y2 = x2 + self.g(y1)
        return torch.cat([y1, y2], dim=1)

    @staticmethod
    def _run(fn: nn.Module, x: Tensor, tape: Tape) -> Tensor:
        """``fn(x)`` without autograd, never overwriting ``x``."""
        if isinstance(fn, Invertible):
            return fn.forward_(x.clone(), tape)
        return fn(x)

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        check_channels(type(self).__name__, x, self.channels)
        x1, x2 = halves(x)
        x1.add_(self._run(self.f, x2, tape))
        x2.add_(self._run(self.g, x1, tape))
        return x

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        y1, y2 = halves(y)
        y2.sub_(self._run(self.g, y1, tape))
        y1.sub_(self._run(self.f, y2, tape))
        return y

    def recompute_backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads) -> tuple[Tensor, Tensor]:
        """RevNet backward (Gomez et al., Algorithm 1): the block inverse and the recomputation are one.

        ``G(y1)`` is recomputed with autograd; it both undoes ``y2`` (``x2 = y2 - G(y1)``) and, back-
        propagated with ``gy2``, gives ``z1 = gy1 + dG^T gy2``. Then ``F(x2)`` likewise undoes ``y1``
        and gives ``gx2 = gy2 + dF^T z1``. Only one residual function's graph exists at a time.
        The halves are overwritten only after the graph that saved them has been used.
        """
        y1, y2 = halves(y)
        g1, g2 = halves(gy)
        for fn, inp, other, g_in, g_out in ((self.g, y1, y2, g2, g1), (self.f, y2, y1, g1, g2)):
            params = [p for p in fn.parameters() if p.requires_grad]
            a = inp.detach().requires_grad_()
            with torch.enable_grad():
                out = fn(a)
            res = torch.autograd.grad(out, [a, *params], g_in, allow_unused=True)
            other.sub_(out.detach())
            g_out.add_(res[0])
            add_grads(grads, params, res[1:])
            del out, res, a
        return y, gy

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads) -> tuple[Tensor, Tensor]:
        """Hybrid backward with 2.5 activation volumes live (see DESIGN.md section 4).

        Phase G: ``G(y1)`` is computed over ``y1``'s own storage, ``y2 -= G(y1)`` gives ``x2``, and
        the layer-wise backward of ``G`` turns that storage back into ``y1`` while the gradient
        ``dG^T gy2`` forms in a half-volume buffer. Phase F does the same with ``F(x2)`` over
        ``x2``'s storage, ``y1 -= F(x2)`` giving ``x1``. ``gy2`` must survive ``G``'s backward
        (it becomes part of ``gx2``), hence the one extra half volume.
        """
        if "invert" not in self.modes:
            raise NotImplementedError("a coupling with non-invertible F or G cannot run in invert mode")
        y1, y2 = halves(y)
        g1, g2 = halves(gy)
        # phase G: y1 -> G(y1) in place, x2 = y2 - G(y1), then back to y1 through G's layer inverses
        t = self.g.forward_(y1, tape)
        y2.sub_(t)
        w = g2.clone(memory_format=torch.contiguous_format)
        t, w = self.g.backward_(t, w, tape, grads)
        g1.add_(w)
        del w
        # phase F: x2 -> F(x2) in place, x1 = y1 - F(x2), then back to x2 through F's layer inverses
        t = self.f.forward_(y2, tape)
        y1.sub_(t)
        w = g1.clone(memory_format=torch.contiguous_format)
        t, w = self.f.backward_(t, w, tape, grads)
        g2.add_(w)
        return y, gy

    def floor_backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads) -> tuple[Tensor, Tensor]:
        """Hybrid backward with 2 activation volumes live: the activation and its gradient, nothing more.

        As :meth:`backward_`, but no residual function's backward writes the gradient it receives:
        ``G``'s backward reads ``gy2`` and adds ``dG^T gy2`` straight into ``gy1``, batch slice by batch
        slice (:func:`backward_into_`), so ``gy2`` survives without a copy; then ``F``'s backward reads
        the total ``gy1`` (which is ``gx1``) and adds ``dF^T gy1`` into ``gy2``, giving ``gx2``.
        """
        if "floor" not in self.modes:
            raise NotImplementedError("floor mode needs F and G to be chains of per-sample layers and batch norms")
        y1, y2 = halves(y)
        g1, g2 = halves(gy)
        t = self.g.forward_(y1, tape)  # G(y1) over y1's storage
        y2.sub_(t)  # x2
        backward_into_(self.g, t, g2, g1, tape, grads)  # t back to y1; g1 += dG^T g2
        t = self.f.forward_(y2, tape)  # F(x2) over x2's storage
        y1.sub_(t)  # x1
        backward_into_(self.f, t, g1, g2, tape, grads)  # t back to x2; g2 += dF^T g1
        return y, gy


def _sliceable(fn: nn.Module) -> bool:
    """Can :func:`backward_into_` run ``fn``: a chain of per-sample layers and invertible batch norms?"""
    return isinstance(fn, InvSequential) and all(
        layer.per_sample or isinstance(layer, InvBatchNorm2d) for layer in fn.layers)


def backward_into_(chain: InvSequential, y: Tensor, gy: Tensor, out: Tensor, tape: Tape, grads: Grads) -> Tensor:
    r"""``out += J^T gy`` for the chain's Jacobian ``J``, turning its output ``y`` back into its input in
    place, without ever writing ``gy``: live besides the three, one batch slice of temporaries.

    Every layer's backward treats each sample alone except a training-mode batch norm's, and that
    couples the samples only through two numbers per channel (the same two that make its backward
    map invertible):

    .. math::
        g_x = \frac{s}{\sigma}\Big(g - \frac{d\beta}{N} - \hat x\,\frac{ds}{N}\Big), \qquad
        d\beta = \sum g, \quad ds = \sum g\,\hat x

    So they are measured first, top batch norm first: a pass over batch slices carries a copy of each
    slice of ``y`` and ``gy`` down to the batch norm (through the layers above it, whose numbers are
    known by then) and sums. With every batch norm's numbers known the backward is per sample: each
    slice of ``gy`` is copied, carried down the whole chain while that slice of ``y`` becomes the
    input, and added into ``out``. A chain of depth ``d`` pays ``d`` partial passes; for the
    hybrid block's (conv, BN, leaky ReLU) the one pass runs through the leaky ReLU only.
    """
    layers = list(chain.layers)
    n = y.numel() // y.shape[1]
    known: dict[InvBatchNorm2d, tuple] = {}  # per batch norm: its input-gradient and inverse coefficients
    for k in reversed(range(len(layers))):
        bn = layers[k]
        if not (isinstance(bn, InvBatchNorm2d) and bn.training):
            continue
        dbeta = ds = None
        for sl in batch_slices(y, 3.0):
            a, g = _carry(layers[k + 1:], y[sl].clone(), gy[sl].clone(), tape, known, None)
            db, d = bn.grad_sums(a, g)
            dbeta, ds = (db, d) if dbeta is None else (dbeta.add_(db), ds.add_(d))
            del a, g
        known[bn] = (bn.grad_coefficients(tape, (dbeta, ds), n), bn.inverse_coefficients(tape))
        add_grad(grads, bn.weight, bn.weight_grad(ds))
        add_grad(grads, bn.bias, dbeta)
    for sl in batch_slices(y, 2.0):
        _, g = _carry(layers, y[sl], gy[sl].clone(), tape, known, grads)
        out[sl].add_(g)
        del g
    return y


def _carry(layers: list[Invertible], a: Tensor, g: Tensor, tape: Tape, known: dict,
           grads: Grads | None) -> tuple[Tensor, Tensor]:
    """Back-propagate a slice (output ``a``, gradient ``g``, both overwritten) through ``layers`` in
    reverse; the training-mode batch norms among them apply the ``known`` whole-batch coefficients."""
    for layer in reversed(layers):
        if isinstance(layer, InvBatchNorm2d) and layer.training:
            grad_coefficients, (ia, ib) = known[layer]
            g = layer.input_grad_(a, g, grad_coefficients)
            a = a.mul_(ia).add_(ib)
        else:
            a, g = layer.backward_(a, g, tape, grads)
    return a, g


class HybridBlock(Coupling):
    """RevNeXt hybrid block: a coupling whose ``F`` and ``G`` are chains of invertible layers.

    Each of ``F`` and ``G`` is ``depth`` repetitions of (invertible conv, invertible batch norm,
    invertible leaky ReLU) at ``channels / 2`` channels: two in the authors' code, one in the block
    right after the stem. Every batch-norm scale starts at ``gamma = 1``, as theirs does.

    Args:
        channels: channels of the block (a multiple of 4: each half is split again by the
            invertible convolutions).
        depth: (conv, BN, leaky ReLU) triples in each of ``F`` and ``G``.
        slope: leaky ReLU slope.
        eps_i: bound on the batch-norm scales.
    """

    def __init__(self, channels: int, depth: int = 2, slope: float = 0.2, eps_i: float = 0.1) -> None:
        from edgerev.layers.activation import InvLeakyReLU
        from edgerev.layers.conv import InvConv2d
        from edgerev.layers.norm import InvBatchNorm2d

        if channels % 4 or channels < 4:
            raise ShapeError(f"a hybrid block needs a channel count divisible by 4, got {channels}")
        if depth < 1:
            raise ValueError(f"a hybrid block needs depth >= 1 (conv, BN, leaky ReLU) triples, got {depth}")

        def chain() -> InvSequential:
            layers: list[Invertible] = []
            for _ in range(depth):
                layers += [InvConv2d(channels // 2), InvBatchNorm2d(channels // 2, eps_i), InvLeakyReLU(slope)]
            return InvSequential(*layers)

        super().__init__(channels, chain(), chain())
