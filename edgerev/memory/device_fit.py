"""A plan fitted to the CUDA allocator: what the step's accounting cannot see on the device.

The accounting (:mod:`edgerev.memory.account`) predicts a step from fake tensors on the CPU. Under a CUDA
cap the allocator holds more than those tensors: cuDNN's and cuBLAS's workspaces, kernels that save other
tensors than the CPU's (cuDNN's batch norm keeps a reserve buffer), and the allocator's own rounding and
fragmentation, since ``set_per_process_memory_fraction`` limits the bytes *reserved*. On an H100 the
allocator held 95 to 300 MiB more than the tracker counted in one step at 240x240, batch 32; under the
GTX 750 recipe's 400 MiB cap the planned micro-batch peaked at 388 MiB allocated (335 MiB predicted) and ran
out of memory once. Those sizes depend on the GPU, cuDNN's version and every shape, so they are measured,
not modelled: with the cap set, one real step of the planned micro-batch shows the allocator's peak; while it
runs out of memory or leaves less than :data:`HEADROOM` of the cap free, the plan is made again under a
smaller budget. The trainer's out-of-memory recovery (halving the micro-batch) stays as the last guard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgerev.memory.account import StepShape, held
from edgerev.memory.autoplan import TrainingPlan
from edgerev.memory.cap import _restore, _state, accumulate, split_batch
from edgerev.memory.costs import BudgetTooSmall

HEADROOM = 0.05  # of the cap left free at the measured peak: steps differ a little (cuDNN's choices, fragments)
OOM_SHRINK = 1 / 8  # of the cap taken off the planning budget when the measured step ran out of memory
ROUNDS = 6


@dataclass(frozen=True)
class Fit:
    """One measured plan: the budget it was planned under, its micro-batch, the accounting's prediction and
    the allocator's peak (``None``: the step ran out of memory under the cap)."""

    planned_under: int
    micro_batch: int
    predicted_bytes: int
    measured_bytes: int | None

    def as_dict(self) -> dict:
        return {"planned_under": self.planned_under, "micro_batch": self.micro_batch,
                "predicted_bytes": self.predicted_bytes, "measured_bytes": self.measured_bytes}


@dataclass(frozen=True)
class DeviceFit:
    """The plan that fits the device, and each plan measured on the way (the last is the one returned)."""

    plan: TrainingPlan
    fits: tuple[Fit, ...]
    limit: int  # the measured peak a plan must stay under: the cap less the headroom

    @property
    def fitted(self) -> bool:
        m = self.fits[-1].measured_bytes
        return m is not None and m <= self.limit

    def summary(self) -> dict:
        return {"device_fit": [f.as_dict() for f in self.fits], "device_limit_bytes": self.limit,
                "device_fitted": self.fitted}


def fit_to_device(plan_at: Callable[[int], TrainingPlan], measure: Callable[[TrainingPlan], int | None],
                  budget: int, headroom: float = HEADROOM, rounds: int = ROUNDS) -> DeviceFit:
    """Plan under ``budget``, measure the plan's real step, and plan again under less until it fits.

    Args:
        plan_at: the planner at a budget in bytes (raises :class:`BudgetTooSmall` below its floor).
        measure: the peak bytes of one real step of a plan under the cap, or ``None`` if it ran out of memory.
        budget: the cap.

    Returns the first plan whose measured peak stays under ``budget * (1 - headroom)``; when none did in
    ``rounds`` measurements, the last one measured (the trainer's halving then guards it).

    Raises:
        BudgetTooSmall: the planner's floor does not fit once the device's excess is taken off; it names
            the budget that would fit, the floor plus the excess measured.
    """
    limit = int(budget * (1 - headroom))
    target, fits = budget, []
    for _ in range(rounds):
        try:
            tp = plan_at(target)
        except BudgetTooSmall as e:
            if not fits:
                raise
            raise BudgetTooSmall(budget, e.smallest + (budget - target)) from None
        measured = measure(tp)
        fits.append(Fit(target, tp.batch, tp.predicted_peak_bytes, measured))
        if measured is not None and measured <= limit:
            break
        # the next plan must hold the allocator's excess over its prediction beside it: it is planned under the
        # limit less the excess measured (an excess that grows with the micro-batch only shrinks with it); a
        # step that ran out of memory says only that the plan was too large. Always below the last plan.
        below = min(target, tp.predicted_peak_bytes)
        if measured is None:
            target = below - int(budget * OOM_SHRINK)
        else:
            target = min(below - budget // 200, limit - (measured - tp.predicted_peak_bytes))
    return DeviceFit(tp, tuple(fits), limit)


def cuda_step_peak(model: nn.Module, plan: TrainingPlan, shape: StepShape, loss_fn: Callable[..., Tensor],
                   device: torch.device, teacher_on_device: bool = True) -> int | None:
    """The allocator's peak in bytes through one real step of ``plan`` (None: out of memory under the cap).

    The step is the trainer's micro-batch loop (its first two micro-batches, as the accounting runs it) on
    random data of the step's shape; what it does not allocate itself but a training step holds (the
    optimizer's momentum, a teacher's logits, the teacher when it is not on the device yet) is added from the
    accounting. The model's gradients and batch-norm statistics are left as they were.
    """
    plan.apply(model)
    model.train()
    buffers = _state(model)
    batch = shape.batch or plan.batch
    terms = held(model, shape, plan.batch)
    outside = terms["optimizer"] + terms["teacher_logits"] + (0 if teacher_on_device else terms["teacher"])
    peak = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        x = torch.randn(batch, model.in_channels, shape.size, shape.size, device=device)
        targets: tuple[Tensor, ...] = (torch.randint(0, model.num_classes, (batch,), device=device),)
        if shape.teacher_bytes:
            targets += (torch.randn(batch, max(1, shape.teacher_classes), device=device),)
        accumulate(model, x, targets, split_batch(batch, math.ceil(batch / plan.batch))[:2], loss_fn)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) + outside
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        x = targets = None  # noqa: F841 (the batch goes before the cache is emptied)
        model.zero_grad(set_to_none=True)
        _restore(model, buffers)
        torch.cuda.empty_cache()
    return peak
