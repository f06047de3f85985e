"""The invertible-layer protocol shared by every block, and the helpers the in-place code needs.

A layer has two faces:

* ``forward(x)`` / ``inverse(y)``: ordinary autograd code, out of place. This is the reference path
  (tests compare against it) and the export path.
* ``forward_(x, tape)`` / ``inverse_(y, tape)`` / ``backward_(y, gy, tape, grads)``: the engine's
  face. They run without autograd and may overwrite their arguments. ``backward_`` receives the
  layer output ``y`` and its gradient ``gy``, turns ``y`` into the layer input and ``gy`` into the
  input gradient (in place where it can) and adds parameter gradients into ``grads``.

The :class:`Tape` carries what one training step must remember between its forward and its backward
(per-channel batch-norm statistics), so two forwards before a backward never mix their statistics.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn

from edgerev.errors import ShapeError

Grads = dict[nn.Parameter, Tensor]

# Temporaries of per-sample operations (convolutions, element-wise gradient maps, reductions) are
# computed in slices of the batch no larger than a byte budget, so they stop growing with the batch. A
# planned step carries its own budget per stage (the planner chooses it under the cap, see
# ``Execution.slices``); this default applies where nothing planned one (tests, ``edgerev memory``): the
# lean setting at which the bytes-per-pixel figures are defined.
LEAN_SLICE_BYTES = 1024 * 1024
_default_slice_bytes = LEAN_SLICE_BYTES


def chunk_bytes() -> int:
    """The slice budget of a step that was given none (``0``: never slice)."""
    return _default_slice_bytes


@contextlib.contextmanager
def chunk_budget(nbytes: int) -> Iterator[None]:
    """Temporarily set the slice budget of steps that were given none (``0`` means: never slice)."""
    global _default_slice_bytes
    old, _default_slice_bytes = _default_slice_bytes, int(nbytes)
    try:
        yield
    finally:
        _default_slice_bytes = old


def batch_slices(t: Tensor, width: float = 1.0, budget: int | None = None) -> Iterator[slice]:
    """Slices of dim 0 of ``t`` whose temporaries (``width`` times a slice of ``t``) fit ``budget`` bytes
    (None: :func:`chunk_bytes`; ``0``: one slice, the whole batch): as few as the budget allows, the largest as small
    as that many can make it (a batch of 32 in slices of at most 13 is 11, 11 and 10: the same kernels as 13, 13 and
    6, and a smaller largest slice, which is what the peak holds)."""
    n = t.shape[0]
    budget = _default_slice_bytes if budget is None else budget
    row = max(1, int(t[:1].numel() * t.element_size() * width))
    count = 1 if budget <= 0 else max(1, -(-n // max(1, budget // row)))  # as few slices as the budget allows
    step = max(1, -(-n // count))  # the largest slice as small as that many can make it
    for start in range(0, n, step):
        yield slice(start, min(n, start + step))


def add_grad(grads: Grads | None, p: nn.Parameter, g: Tensor) -> None:
    """Accumulate ``g`` into the gradient of ``p`` kept in ``grads`` (None: a pass that wants no parameter
    gradients)."""
    if grads is None or not p.requires_grad:
        return
    if p in grads:
        grads[p].add_(g)
    else:
        grads[p] = g


def add_grads(grads: Grads, params: list[nn.Parameter], gs) -> None:
    """Accumulate ``torch.autograd.grad`` results (``None`` for unused parameters) into ``grads``."""
    for p, g in zip(params, gs):
        if g is not None:
            add_grad(grads, p, g)


def halves(t: Tensor) -> tuple[Tensor, Tensor]:
    """Views of the two channel halves of ``t`` (one split node for autograd, not two slices)."""
    a, b = t.chunk(2, dim=1)
    return a, b


def check_channels(name: str, x: Tensor, channels: int) -> None:
    """Raise a :class:`ShapeError` unless ``x`` is a 4-d batch with ``channels`` channels."""
    if x.dim() != 4:
        raise ShapeError(f"{name} expects a 4-d [batch, channels, height, width] tensor, got shape {tuple(x.shape)}")
    if x.shape[1] != channels:
        raise ShapeError(f"{name} expects {channels} channels, got {x.shape[1]} (input shape {tuple(x.shape)})")


class Tape:
    """What one training step keeps between forward and backward, apart from activations.

    Attributes:
        stats: per-module values (batch-norm mean and inverse standard deviation) recorded by the forward.
        scales: per-module values of the weights alone that the forward needs (a batch norm's bounded scale),
            computed once a step for many modules at once (:func:`edgerev.layers.norm.prepare`).
        coefficients: per-module values derived from ``stats`` and the weights (a batch norm's scale and
            shift, forward and inverse), computed once per step where the backward first needs them: the
            weights do not change inside a step.
        undo: per-module terms a backward leaves for undoing its gradient map (a training-mode batch norm's, whose
            map depends on sums of the gradient it was given; :meth:`Invertible.restore_`).
        replay: True while the backward re-runs forwards: batch norm then reuses ``stats`` instead of
            measuring the batch again, and running statistics are never touched.
        probe: optional ``probe(module, x)`` called with every input a backward reconstructs
            (diagnostics compare it with the input the forward saw).
        slice_bytes: the batch-slice budget of the stage being run (the engine sets it per stage from
            the plan; ``0``: the whole batch at once).
    """

    def __init__(self, probe: Callable[[nn.Module, Tensor], None] | None = None,
                 slice_bytes: int | None = None) -> None:
        self.stats: dict[nn.Module, tuple[Tensor, ...]] = {}
        self.scales: dict[nn.Module, Tensor] = {}
        self.coefficients: dict[nn.Module, tuple[Tensor, ...]] = {}
        self.undo: dict[nn.Module, tuple[Tensor, ...] | None] = {}
        self.replay = False
        self.probe = probe
        self.slice_bytes = chunk_bytes() if slice_bytes is None else int(slice_bytes)

    def slices(self, t: Tensor, width: float = 1.0) -> Iterator[slice]:
        """:func:`batch_slices` of ``t`` under the current stage's budget."""
        return batch_slices(t, width, self.slice_bytes)


class Invertible(nn.Module):
    """Base of every volume-preserving layer or block (see the module docstring)."""

    #: engine modes (``edgerev.engine.Mode`` values) this layer supports
    modes: tuple[str, ...] = ("invert", "recompute", "store")
    #: True when ``backward_`` treats every sample alone, so it may run on any slice of the batch
    per_sample: bool = False

    def inverse(self, y: Tensor) -> Tensor:
        """Out-of-place inverse; in training mode it uses the statistics of the last forward."""
        with torch.no_grad():
            return self.inverse_(y.clone(), self._plain_tape())

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:  # pragma: no cover - interface
        raise NotImplementedError

    def forward_out(self, x: Tensor, tape: Tape) -> Tensor:
        """:meth:`forward_` into a new tensor, ``x`` left as it is (layers that can write their output
        elsewhere in one kernel say so; this default copies ``x`` first)."""
        return self.forward_(x.clone(), tape)

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> tuple[Tensor, Tensor]:
        raise NotImplementedError(f"{type(self).__name__} has no layer-wise backward")

    def grad_(self, x: Tensor, y: Tensor, gy: Tensor, tape: Tape, grads: Grads | None) -> Tensor:
        """The input gradient over ``gy``, given the layer's input ``x`` and output ``y`` both: nothing is
        rebuilt. ``x`` is only read; ``y`` may be overwritten (this default runs :meth:`backward_` on it)."""
        return self.backward_(y, gy, tape, grads)[1]

    def restore_(self, x: Tensor, g: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        """Undo :meth:`backward_` of this step walking forward: ``x``, the layer's input, becomes its output (as
        :meth:`forward_`), and ``g``, the input gradient the backward gave, becomes the output gradient it was given
        (the gradient map inverted), both in place. Parameter gradients are not touched."""
        raise NotImplementedError(f"{type(self).__name__} cannot undo its gradient map")

    def _plain_tape(self) -> Tape:
        """A replay tape filled with the statistics each sub-layer saw in its last plain forward."""
        tape = Tape()
        tape.replay = True
        for m in self.modules():
            last = getattr(m, "_last_stats", None)
            if last is not None:
                tape.stats[m] = last
        return tape


class InvSequential(Invertible):
    """A chain of invertible layers; its inverse and backward walk the chain in reverse."""

    def __init__(self, *layers: Invertible) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

    def forward_(self, x: Tensor, tape: Tape) -> Tensor:
        for layer in self.layers:
            x = layer.forward_(x, tape)
        return x

    def forward_out(self, x: Tensor, tape: Tape) -> Tensor:
        if not self.layers:
            return x.clone()
        x = self.layers[0].forward_out(x, tape)
        for layer in self.layers[1:]:
            x = layer.forward_(x, tape)
        return x

    def inverse_(self, y: Tensor, tape: Tape) -> Tensor:
        for layer in reversed(self.layers):
            y = layer.inverse_(y, tape)
        return y

    def restore_(self, x: Tensor, g: Tensor, tape: Tape) -> tuple[Tensor, Tensor]:
        for layer in self.layers:
            x, g = layer.restore_(x, g, tape)
        return x, g

    def backward_(self, y: Tensor, gy: Tensor, tape: Tape, grads: Grads) -> tuple[Tensor, Tensor]:
        for layer in reversed(self.layers):
            y, gy = layer.backward_(y, gy, tape, grads)
            if tape.probe is not None:
                tape.probe(layer, y)
        return y, gy


@contextlib.contextmanager
def replaying(module: nn.Module) -> Iterator[None]:
    """Re-run ``module`` without touching running statistics.

    Invertible batch norms read the ``_replay`` flag; ordinary ``nn.BatchNorm`` layers (RevNet's
    residual functions, plain models) get momentum 0, so in training mode they still normalize with
    batch statistics and save the same tensors for autograd (``torch.utils.checkpoint`` compares the
    two runs), while the running estimates and the batch counter stay as they were.
    """
    saved = []
    for m in module.modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            count = m.num_batches_tracked.clone() if m.num_batches_tracked is not None else None
            saved.append((m, (m.momentum, count)))
            m.momentum = 0.0
        elif hasattr(m, "_replay"):
            saved.append((m, m._replay))
            m._replay = True
    try:
        yield
    finally:
        for m, value in saved:
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum, count = value
                if count is not None:
                    m.num_batches_tracked.copy_(count)
            else:
                m._replay = value


def check_even(name: str, x: Tensor) -> None:
    if x.dim() != 4:
        raise ShapeError(f"{name} expects a 4-d [batch, channels, height, width] tensor, got shape {tuple(x.shape)}")
    h, w = x.shape[-2:]
    if h % 2 or w % 2:
        raise ShapeError(f"{name} halves the resolution and needs even height and width, got {h}x{w}")
