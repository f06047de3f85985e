"""Run a plain model's stages as checkpoint segments (the plan comes from :mod:`edgerev.memory.solve.segments`).

A *stored* segment runs under ordinary autograd; a *checkpoint* segment keeps only its input and is
re-run with autograd in the backward (``torch.utils.checkpoint``, non-reentrant, without updating
batch-norm running statistics a second time, drawing a dropout's mask again as the forward drew it); a
*store8*/*store4* segment runs once under ordinary autograd, which keeps an 8- or 4-bit copy of each
activation it saves (per-layer approximate activations, :mod:`edgerev.approximate`): nothing is re-run,
so running statistics move once. A segment is anything with ``start``, ``end`` and ``mode``
(:class:`edgerev.memory.solve.costs.Segment`); this module imports nothing from the planner.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from edgerev import approximate
from edgerev._torchapi import storage_key
from edgerev.layers.base import replaying


@contextlib.contextmanager
def _replaying_all(modules: Sequence[nn.Module]):
    with contextlib.ExitStack() as stack:
        for m in modules:
            stack.enter_context(replaying(m))
        yield


def _random(modules: Sequence[nn.Module]) -> bool:
    """True when a re-run must draw the forward's random numbers again (a dropout's mask)."""
    return any(isinstance(m, nn.modules.dropout._DropoutNd) or getattr(m, "random", False)
               for module in modules for m in module.modules())


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
            x = checkpoint(fn, x, use_reentrant=False, preserve_rng_state=_random(part),
                           context_fn=lambda part=part: (contextlib.nullcontext(), _replaying_all(part)))
        else:
            # an input that needs no gradient is the image, which the caller holds anyway: saved exact
            exact = [] if x.requires_grad else [storage_key(x)]
            with approximate.saving(8 if seg.mode == "store8" else 4, part, exact):
                x = fn(x)
    return x
