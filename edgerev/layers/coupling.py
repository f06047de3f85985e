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
    every layer of the chains is per sample or an invertible batch norm, in ``floor`` mode: without the
    half-volume copy of a gradient, either from the chains run forward on batch slices or by undoing
    their gradient maps (:meth:`floor_backward_`).

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
            return fn.forward_out(x, tape)
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

    def floor_backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads,
                        restore: bool = False) -> tuple[Tensor, Tensor]:
        """Hybrid backward with 2 activation volumes live: the activation and its gradient, nothing more.

        :meth:`backward_` copies a gradient half because the chain's backward overwrites the gradient it is given
        and that half is still needed after it. Two ways do without the copy, the same gradients:

        * by slices (``restore=False``): no residual function runs over a half of the block or writes the
          gradient it receives: ``G`` runs forward on copies of ``y1``'s batch slices, ``y2 -= G(y1)`` gives
          ``x2``, and ``dG^T gy2`` is added straight into ``gy1`` (:func:`backward_into_`), so ``gy2`` survives
          without a copy and ``y1`` is never rebuilt; then ``F`` does the same on ``x2``. The block's input carries
          only the rounding of the two subtractions, not that of the layer inverses. Each chain runs forward once
          per batch norm and once more, on every slice: the fewest FLOPs (2.16x plain autograd's at RevNeXt), a
          round of kernels per slice.
        * by restoring (``restore=True``): as :meth:`backward_`, but the chain's backward runs over ``gy2`` itself;
          once ``gy1 += dG^T gy2``, the chain undoes its gradient map walking forward (:meth:`Invertible.restore_`),
          which gives ``gy2`` back, and its inverse takes the half back to ``y1``; then ``F`` likewise over ``gy1``.
          Every layer runs over the whole batch (only the convolutions' temporaries are sliced): few kernels, for
          two more walks of each chain (2.67x plain's FLOPs at RevNeXt). What a GPU runs, where every kernel is a
          launch.
        """
        if "floor" not in self.modes:
            raise NotImplementedError("floor mode needs F and G to be chains of per-sample layers and batch norms")
        y1, y2 = halves(y)
        g1, g2 = halves(gy)
        if restore:
            _restoring_(self.g, y1, g2, g1, y2, tape, grads)  # y2 -= G(y1): x2; g1 += dG^T g2
            _restoring_(self.f, y2, g1, g2, y1, tape, grads)  # y1 -= F(x2): x1; g2 += dF^T g1
            return y, gy
        backward_into_(self.g, y1, g2, g1, y2, tape, grads)  # y2 -= G(y1): x2; g1 += dG^T g2
        backward_into_(self.f, y2, g1, g2, y1, tape, grads)  # y1 -= F(x2): x1; g2 += dF^T g1
        return y, gy


def _restoring_(chain: InvSequential, x: Tensor, gy: Tensor, out: Tensor, target: Tensor, tape: Tape,
                grads: Grads) -> None:
    """``target -= chain(x)`` and ``out += J^T gy``, ``x`` and ``gy`` as they were after: the chain runs forward
    over ``x``, back over it and ``gy`` (``gy`` becomes ``J^T gy``), forward again undoing its gradient map (``gy``
    comes back), and its inverse takes ``x`` back. Live besides the four: one slice of a convolution's
    temporaries."""
    t = chain.forward_(x, tape)
    target.sub_(t)
    t, gy = chain.backward_(t, gy, tape, grads)
    out.add_(gy)
    t, gy = chain.restore_(t, gy, tape)
    chain.inverse_(t, tape)


def forward_per_sample(layer: nn.Module) -> bool:
    """Does ``layer``'s ``forward_``, with the batch's statistics on the tape (the backward replays them),
    treat every sample alone, so that it may run on any batch slice? Per-sample layers and invertible
    batch norms."""
    return isinstance(layer, Invertible) and (layer.per_sample or isinstance(layer, InvBatchNorm2d))


def _sliceable(fn: nn.Module) -> bool:
    """Can floor mode run ``fn``: a chain of layers whose forward is per sample (:func:`backward_into_`), each of
    which undoes its gradient map (:func:`_restoring_`: per-sample layers and batch norms do)?"""
    return isinstance(fn, InvSequential) and all(forward_per_sample(layer) for layer in fn.layers)


def backward_into_(chain: InvSequential, x: Tensor, gy: Tensor, out: Tensor, target: Tensor, tape: Tape,
                   grads: Grads) -> None:
    r"""``target -= chain(x)`` and ``out += J^T gy`` (``J`` the chain's Jacobian at ``x``), batch slice by
    batch slice, never writing ``x`` or ``gy``: live besides the four, one slice of the chain's
    activations.

    Every layer's backward treats each sample alone except a training-mode batch norm's, and that
    couples the samples only through two numbers per channel (the same two that make its backward
    map invertible):

    .. math::
        g_x = \frac{s}{\sigma}\Big(g - \frac{d\beta}{N} - \hat x\,\frac{ds}{N}\Big), \qquad
        d\beta = \sum g, \quad ds = \sum g\,\hat x

    So they are measured first, top batch norm first: a pass over batch slices runs the chain forward
    on a copy of each slice of ``x`` (batch norms replay the forward's statistics), carries that slice
    of ``gy`` down to the batch norm (through the layers above it, whose numbers are known by then)
    and sums; the first pass also subtracts the chain's output from ``target``. With every batch
    norm's numbers known the backward is per sample: each slice is run forward once more, its
    gradient carried down the whole chain and added into ``out``. Each layer's backward starts from
    the activation the slice's forward computed, so no layer inverse's rounding reaches the layer
    below. A chain with ``d`` training-mode batch norms runs forward ``d + 1`` times.
    """
    layers = list(chain.layers)
    # a slice of x and one of gy per slice of the budget: the slice's activations (one per layer) come on top,
    # a few times the budget, in exchange for slices big enough that per-call overheads stay small
    width = 2.0
    known: dict[InvBatchNorm2d, tuple] = {}  # per batch norm: its input-gradient coefficients
    subtracted = False
    for k in reversed(range(len(layers))):
        bn = layers[k]
        if not (isinstance(bn, InvBatchNorm2d) and bn.training):
            continue
        dbeta = ds = None
        for sl in tape.slices(x, width):
            acts = _activations(layers, x[sl], tape)
            if not subtracted:
                target[sl].sub_(acts[-1])
            g = _carry(layers, acts, gy[sl].clone(), tape, known, None, k + 1)
            db, d = bn.grad_sums(acts[k + 1], g, tape)
            dbeta, ds = (db, d) if dbeta is None else (dbeta.add_(db), ds.add_(d))
            del acts, g
        subtracted = True
        terms = bn.grad_terms(tape, (dbeta, ds))
        known[bn] = terms.input
        add_grad(grads, bn.weight, terms.weight)
        add_grad(grads, bn.bias, dbeta)
    for sl in tape.slices(x, width):
        acts = _activations(layers, x[sl], tape)
        if not subtracted:
            target[sl].sub_(acts[-1])
        out[sl].add_(_carry(layers, acts, gy[sl].clone(), tape, known, grads, 0))
        del acts


def _activations(layers: list[Invertible], x: Tensor, tape: Tape) -> list[Tensor]:
    """``[x, layer 0's output, layer 1's output, ...]``: the chain run forward on copies of ``x``."""
    acts = [x]
    for layer in layers:
        acts.append(layer.forward_out(acts[-1], tape))
    return acts


def _carry(layers: list[Invertible], acts: list[Tensor], g: Tensor, tape: Tape, known: dict,
           grads: Grads | None, stop: int) -> Tensor:
    """Back-propagate a slice's gradient ``g`` (overwritten) from the chain's output to layer ``stop``'s
    input; each layer reads its own output from ``acts`` (:func:`_activations`, overwritten), and the
    training-mode batch norms apply the ``known`` whole-batch coefficients."""
    for k in reversed(range(stop, len(layers))):
        layer = layers[k]
        if isinstance(layer, InvBatchNorm2d) and layer.training:
            g = layer.input_grad_(acts[k + 1], g, known[layer])
        else:
            g = layer.grad_(acts[k], acts[k + 1], g, tape, grads)
    return g


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
