"""Run a plain model's stages as checkpoint segments (the plan comes from :mod:`edgerev.memory.segments`).

A *stored* segment runs under ordinary autograd; a *checkpoint* segment keeps only its input and is
re-run with autograd in the backward (``torch.utils.checkpoint``, non-reentrant, without updating
batch-norm running statistics a second time); a *store8*/*store4* segment keeps an 8- or 4-bit copy
of its input instead (:mod:`edgerev.quantize`). A segment is anything with ``start``, ``end`` and
``mode`` (:class:`edgerev.memory.costs.Segment`); this module imports nothing from the planner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from edgerev.layers.base import replaying
from edgerev.quantize import Quantized, dequantize, quantize


class _QuantizedSegment(torch.autograd.Function):
    """A segment kept as an 8/4-bit copy of its input and re-run with autograd in the backward."""

    @staticmethod
    def forward(ctx, x: Tensor, fn, modules, bits: int, *params: Tensor) -> Tensor:
        ctx.q: Quantized = quantize(x.detach(), bits)
        ctx.fn, ctx.modules, ctx.params = fn, modules, params
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx, gy: Tensor):
        xin = dequantize(ctx.q).requires_grad_()
        del ctx.q
        with torch.enable_grad(), _replaying_all(ctx.modules):
            out = ctx.fn(xin)
        grads = torch.autograd.grad(out, [xin, *ctx.params], gy, allow_unused=True)
        return (grads[0], None, None, None, *grads[1:])


@contextlib.contextmanager
def _replaying_all(modules: Sequence[nn.Module]):
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(replaying(m))
        yield


def run_segments(stages: Sequence[nn.Module], segments: Sequence, x: Tensor) -> Tensor:
    """Forward through ``stages`` as ``segments`` say (under autograd: the backward follows the plan)."""
    for seg in segments:
        part = list(stages[seg.start:seg.end])

        def fn(h: Tensor, part: list[nn.Module] = part) -> Tensor:
            for m in part:
                h = m(h)
            return h

        if seg.mode == "store" or not torch.is_grad_enabled():
            x = fn(x)
        elif seg.mode == "checkpoint":
            # the re-run must not update batch-norm running statistics a second time
            x = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=False,
                           context_fn=lambda part=part: (contextlib.nullcontext(), _replaying_all(part)))
        else:
            params = [p for m in part for p in m.parameters() if p.requires_grad]
            x = _QuantizedSegment.apply(x, fn, part, 8 if seg.mode == "store8" else 4, *params)
    return x
