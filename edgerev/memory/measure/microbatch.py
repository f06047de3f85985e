"""The micro-batch loop of a training step: what the trainer runs, and what the accounting runs on fake tensors.

A step of ``n`` samples runs as micro-batches (:func:`split_batch`), each forward and backward in turn with its
gradients summed (:func:`accumulate`). :func:`edgerev.train.cap.train_step` runs it on the batch;
:func:`edgerev.memory.measure.account.account_step` runs the same function on fake tensors to say what a step
holds at its peak, and :func:`edgerev.memory.plan.device_fit.cuda_step_peak` on the device under its cap. A step
that is tried and must leave no trace keeps the batch norms' running statistics
(:func:`edgerev._torchapi.save_buffers`) and puts them back (:func:`edgerev._torchapi.restore_buffers`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch import Tensor, nn

from edgerev.engine import engine_body
from edgerev.finite import FiniteChecks, deferred_checks


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


def step_signature(model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], micro_batches: int) -> tuple:
    """What a step's tensors depend on, values aside: the input's and targets' shapes, the micro-batches, the engine's
    modes and execution (plain autograd, slices, segments), and each parameter's shape and whether it trains. Two
    steps of one signature allocate the same tensors (the CPU cap verifies each signature once; a CUDA graph is
    replayed only for its own)."""
    body = engine_body(model)
    plan = (tuple(body.modes), body.execution) if body is not None else ()
    return (tuple(x.shape), x.dtype, tuple(tuple(t.shape) for t in targets), micro_batches, plan,
            tuple((tuple(p.shape), p.requires_grad) for p in model.parameters()))


def accumulate(model: nn.Module, x: Tensor, targets: tuple[Tensor, ...], parts: list[slice],
               loss_fn: Callable[..., Tensor]) -> StepLoss:
    """Forward and backward of each micro-batch, gradients summed; the batch's loss and value checks, unread.

    Nothing here reads the host: the loss and the checks the model makes (:func:`edgerev.finite.check_finite`)
    stay on the device until :meth:`StepLoss.read`. This loop is what a training step holds at its peak:
    :func:`edgerev.memory.measure.account.account_step` runs the same function on fake tensors to predict it.
    """
    n = x.shape[0]
    total: Tensor | None = None
    with deferred_checks() as checks:
        for part in parts:
            loss = loss_fn(model(x[part]), *(t[part] for t in targets)) * ((part.stop - part.start) / n)
            loss.backward()
            total = loss.detach() if total is None else total + loss.detach()
            del loss  # before the next micro-batch: its graph must not count there
    return StepLoss(total, checks)


@dataclass(frozen=True)
class StepLoss:
    """A step's loss (summed over its micro-batches) and its value checks, on the device."""

    loss: Tensor | None
    checks: FiniteChecks

    def read(self) -> float:
        """The loss, read back with every check in one read of the host (0.0 on fake tensors).

        Raises:
            NonFiniteError: a check found NaN or infinity (the first, in the order they ran).
        """
        return 0.0 if self.loss is None else self.checks.read(self.loss)
