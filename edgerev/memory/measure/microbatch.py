"""The micro-batch loop of a training step: what the trainer runs, and what the accounting runs on fake tensors.

A step of ``n`` samples runs as micro-batches (:func:`split_batch`), each forward and backward in turn with its
gradients summed (:func:`accumulate`). :func:`edgerev.train.cap.train_step` runs it on the batch;
:func:`edgerev.memory.measure.account.account_step` runs the same function on fake tensors to say what a step
holds at its peak, and :func:`edgerev.memory.plan.device_fit.cuda_step_peak` on the device under its cap. A step
that is tried and must leave no trace keeps the batch norms' running statistics (:func:`save_buffers`) and puts
them back (:func:`restore_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from edgerev._torchapi import is_fake


def split_batch(n: int, micro_batches: int) -> list[slice]:
    """The micro-batches of a batch of ``n``, as slices (views of the batch: no copy); the largest first."""
    k = min(micro_batches, n)
    size, extra = divmod(n, k)  # as torch.tensor_split: the first ``extra`` parts one sample larger
    out, start = [], 0
    for i in range(k):
        stop = start + size + (1 if i < extra else 0)
        out.append(slice(start, stop))
        start = stop
    return out


def accumulate(model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], parts: list[slice],
               loss_fn: Callable[..., Tensor]) -> float:
    """Forward and backward of each micro-batch, gradients summed; the loss of the batch (0 on fake tensors).

    This loop is what a training step holds at its peak: :func:`edgerev.memory.measure.account.account_step`
    runs the same function on fake tensors to predict it.
    """
    n = x.shape[0]
    total = 0.0
    for part in parts:
        loss = loss_fn(model(x[part]), *(t[part] for t in targets)) * ((part.stop - part.start) / n)
        loss.backward()
        if not is_fake(loss):
            total += float(loss.detach())
        del loss  # before the next micro-batch: its storage must not count there
    return total


def save_buffers(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every buffer of ``model`` (batch norms' running statistics among them)."""
    return {k: v.clone() for k, v in model.named_buffers()}


def restore_buffers(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Put back the buffers :func:`save_buffers` copied."""
    with torch.no_grad():
        for k, v in model.named_buffers():
            v.copy_(state[k])
