"""Per-layer approximate activations (Chakrabarti & Moseley): an exact forward, each layer's own 8/4-bit copy.

A stage in ``store8``/``store4`` runs its ordinary autograd forward once, exactly. Every activation that
autograd saves for the backward (a convolution's or linear layer's input, a batch norm's input, a
ReLU's output, a leaky ReLU's input) is replaced, the moment it is saved, by a sign-preserving 8- or
4-bit copy (:func:`edgerev.quantize.quantize`); the exact tensor dies as soon as the forward has used
it. The backward runs autograd's own formulas, each layer on its own copy:

* ReLU and leaky ReLU masks are exact: the copy keeps every sign (one bit per element of the code);
* a convolution's or linear layer's input gradient needs only the weights: exact; its weight
  gradient multiplies the incoming gradient with the copy: approximate;
* batch norm's input gradient is exact but for the term through the variance, which reads the copy;
* pooling needs shapes (average) or exact indices (max, kept as they are).

So the gradient reaching a layer's input is exact or nearly so, and the approximation of one layer
does not flow into the copies of the others: errors do not compound across the layers of a stage,
as they do when a whole stage is recomputed from one copy of its input.

Not quantized: parameters and buffers (and tensors on their storage), per-channel statistics and
anything else of fewer than two dimensions, integer and boolean tensors (max-pooling indices,
dropout masks), and the tensors named ``exact`` (the input image, which the caller holds anyway).
A tensor saved by two layers (a ReLU's output is also the next convolution's input) is copied once.

The stage's input and output are held only as autograd *edges* (:class:`Kept`), never as tensors,
so the forward keeps exactly the quantized copies: the engine's memory tracker and the fake-tensor
prediction count their bytes exactly, since they are ordinary tensors allocated by the forward.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from torch.autograd.graph import GradientEdge, get_gradient_edge, saved_tensors_hooks

from edgerev._torchapi import storage_key
from edgerev.layers.base import Grads, add_grads
from edgerev.quantize import Quantized, dequantize, quantize


class _Entry(torch.autograd.Function):
    """The stage input as a graph node that holds no tensor: its gradient is read at the node's edge.

    A leaf tensor that requires grad would be held by its gradient accumulator, keeping a float32 copy
    of the stage input alive until the backward: exactly what the approximate modes must not keep.
    """

    @staticmethod
    def forward(ctx, x: Tensor, anchor: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: Tensor):  # pragma: no cover - the engine reads the gradient at the edge
        return g, None


class _Saver:
    """Saved-tensor hooks that keep a quantized copy of every activation, one copy per tensor."""

    def __init__(self, bits: int, exact: set[int], slice_bytes: int | None = None) -> None:
        self.bits, self.exact, self.slice_bytes = bits, exact, slice_bytes
        # id -> (weak reference to the tensor, its copy): a live reference proves the id still names it
        self.copies: dict[int, tuple[weakref.ref, Quantized]] = {}

    def pack(self, t: Tensor):
        if not t.is_floating_point() or t.dim() < 2 or t.numel() == 0 or storage_key(t) in self.exact:
            return t
        seen = self.copies.get(id(t))
        if seen is not None and seen[0]() is t:
            return seen[1]
        q = quantize(t.detach(), self.bits, slice_bytes=self.slice_bytes)
        self.copies[id(t)] = (weakref.ref(t), q)
        return q

    @staticmethod
    def unpack(p):
        return dequantize(p) if isinstance(p, Quantized) else p


@dataclass
class Kept:
    """What an approximate stage keeps for its backward besides the copies inside autograd's graph.

    Attributes:
        out: the edge of the stage output (None: the output needs no gradient).
        inp: the edge of the stage input (None: no input gradient is wanted).
        params: the stage's trainable parameters, in the order their gradients come back.
        input: the exact stage input, when the engine must hand it back and cannot rebuild it.
    """

    out: GradientEdge | None
    inp: GradientEdge | None
    params: list[nn.Parameter]
    input: Tensor | None = None


def exact_storages(tensors: Iterable[Tensor]) -> set[int]:
    """Storage ids of ``tensors``: what :func:`saving` keeps as it is."""
    return {storage_key(t) for t in tensors}


@contextlib.contextmanager
def saving(bits: int, modules: Iterable[nn.Module] = (), exact: Iterable[int] = (),
           slice_bytes: int | None = None) -> Iterator[None]:
    """Inside the block, autograd keeps a ``bits``-bit copy of every activation it saves.

    The parameters and buffers of ``modules`` and the storages ``exact`` are saved as they are. The copies are made
    and read in batch slices of ``slice_bytes`` (:func:`edgerev.quantize.quantize`).
    """
    keep = set(exact)
    for m in modules:
        keep |= exact_storages(m.parameters()) | exact_storages(m.buffers())
    saver = _Saver(bits, keep, slice_bytes)
    try:
        with saved_tensors_hooks(saver.pack, saver.unpack):
            yield
    finally:
        # the graph's saved variables hold the hooks, hence the saver: without this every copy would live
        # until the whole graph dies, instead of dying with the last layer that reads it
        saver.copies.clear()


def forward(stage: nn.Module, x: Tensor, bits: int, input_grad: bool,
            exact: Iterable[int] = (), slice_bytes: int | None = None) -> tuple[Tensor, Kept]:
    """Run ``stage`` on ``x`` exactly, keeping a ``bits``-bit copy of each saved activation.

    Returns the output (detached) and what the backward needs (:func:`backward`). ``exact`` names
    storages saved as they are (besides the stage's parameters and buffers); ``slice_bytes`` is the stage's
    batch-slice budget, which the copies are made and read in (None: the default).
    """
    params = [p for p in stage.parameters() if p.requires_grad]
    with torch.enable_grad(), saving(bits, [stage], exact, slice_bytes):
        if input_grad:
            xin = _Entry.apply(x.detach(), torch.empty(0, device=x.device, requires_grad=True))
            inp = get_gradient_edge(xin)
        else:
            xin, inp = x.detach(), None
        out = stage(xin)
    del xin
    edge = get_gradient_edge(out) if out.requires_grad else None
    return out.detach(), Kept(edge, inp, params)


def backward(kept: Kept, gy: Tensor, grads: Grads) -> Tensor | None:
    """Gradients of the stage from its copies: parameters into ``grads``; returns the input gradient."""
    inputs = ([kept.inp] if kept.inp is not None else []) + kept.params
    if kept.out is None or not inputs:
        return None
    res = torch.autograd.grad([kept.out], inputs, [gy], allow_unused=True)
    if kept.inp is None:
        add_grads(grads, kept.params, res)
        return None
    add_grads(grads, kept.params, res[1:])
    return res[0]
