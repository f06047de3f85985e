"""The hard memory cap, and training steps that survive running into it.

On CUDA the cap is the allocator's: ``torch.cuda.set_per_process_memory_fraction``. On CPU the
live-tensor tracker enforces the same budget and raises :class:`MemoryBudgetExceeded`, so the
behaviour is the same and testable without a GPU.

:func:`train_step` runs one optimizer step on a batch. If the step runs out of memory, it restores
what the failed attempt touched (gradients, batch-norm running statistics), splits the batch into
twice as many micro-batches, accumulates their gradients and tries again, down to micro-batches of
one sample. Each loss is weighted by its share of the batch, so the update equals the full-batch one
wherever the loss is a sum over samples (batch norm in training mode normalizes each micro-batch by
its own statistics, as with any gradient accumulation). The optimizer steps exactly once per call,
after every micro-batch succeeded.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.errors import EdgerevError
from edgerev.memory.tracker import MemoryBudgetExceeded, MemoryTracker, storage_bytes

OOM_ERRORS: tuple[type[BaseException], ...] = (MemoryBudgetExceeded, torch.cuda.OutOfMemoryError)


class StepFailed(EdgerevError):
    """Even micro-batches of one sample do not fit the cap."""


def apply_cuda_cap(budget: int, device: torch.device | str = "cuda") -> float:
    """Limit this process's CUDA allocations to ``budget`` bytes; returns the fraction set."""
    device = torch.device(device)
    total = torch.cuda.get_device_properties(device).total_memory
    if budget > total:
        raise EdgerevError(f"a cap of {budget:,} bytes is more than the device's {total:,} bytes")
    fraction = budget / total
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


@contextlib.contextmanager
def cpu_cap(budget: int | None, baseline: int = 0):
    """Enforce ``budget`` bytes on live tensors (``baseline``: bytes alive before the block)."""
    if budget is None:
        yield None
        return
    with MemoryTracker(budget=budget, baseline=baseline) as tracker:
        yield tracker


@dataclass
class StepResult:
    loss: float
    micro_batches: int
    retries: int


def _state(model: nn.Module) -> dict[str, Tensor]:
    return {k: v.clone() for k, v in model.named_buffers()}


def _restore(model: nn.Module, state: dict[str, Tensor]) -> None:
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(state[k])


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, target: Tensor | tuple[Tensor, ...],
               micro_batches: int = 1, budget: int | None = None,
               loss_fn: Callable[..., Tensor] = F.cross_entropy, clip_grad_norm: float | None = None) -> StepResult:
    """One optimizer step on ``(x, target)``, split into micro-batches as memory requires.

    Args:
        target: the labels, or a tuple of per-sample tensors (labels, a teacher's logits ...) that
            are split with the batch and passed to ``loss_fn(logits, *target)``.
        micro_batches: split to start from (a previous step's answer; halving only ever grows it).
        budget: CPU cap in bytes, enforced by the tracker (``None``: no CPU cap; on CUDA, set the cap
            once with :func:`apply_cuda_cap`).
        clip_grad_norm: scale the summed gradient down to this norm before the step (None: never).
    """
    n = x.shape[0]
    buffers = _state(model)
    retries = 0
    state = [s for st in optimizer.state.values() for s in st.values() if isinstance(s, Tensor)]
    targets = target if isinstance(target, tuple) else (target,)
    baseline = storage_bytes([*model.parameters(), *model.buffers(), x, *targets, *state])
    while True:
        optimizer.zero_grad(set_to_none=True)
        total = 0.0
        try:
            parts = torch.arange(n).tensor_split(min(micro_batches, n))
            with cpu_cap(budget, baseline):
                for idx in parts:
                    part = slice(int(idx[0]), int(idx[-1]) + 1)
                    loss = loss_fn(model(x[part]), *(t[part] for t in targets)) * (len(idx) / n)
                    loss.backward()
                    total += float(loss.detach())
                    del loss
        except OOM_ERRORS as e:
            optimizer.zero_grad(set_to_none=True)
            _restore(model, buffers)  # the failed forward must not count as a step for batch norm
            if x.is_cuda:
                torch.cuda.empty_cache()
            if micro_batches >= n:
                raise StepFailed(f"a micro-batch of one sample does not fit the memory cap: {e}") from None
            micro_batches = min(2 * micro_batches, n)
            retries += 1
            continue
        if clip_grad_norm is not None:
            torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], clip_grad_norm)
        optimizer.step()
        return StepResult(total, micro_batches, retries)
