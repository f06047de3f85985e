"""A plan fitted to the CUDA allocator: a real step under the cap, for what the accounting cannot see.

The accounting (:mod:`edgerev.memory.measure.account`) predicts a step from fake tensors on the CPU; planned in
a process that has the device, it also counts what the math libraries take there (cuBLAS's workspaces, each
convolution's own: :mod:`edgerev.memory.measure.workspaces`), and on an H200 the paper's step planned under 711 MB
then allocated 1.003 times its prediction. What it still cannot see is the allocator's own slack: under a CUDA
cap (``set_per_process_memory_fraction``, which limits the bytes *reserved*) a step needs room left by the
allocator's fragments too (79 MiB of them when a plan of 711 MB ran out of memory under its cap on the H200), and
a plan made without the device counts the tensors alone. So the plan is tried: with the cap set, two real steps
of the planned micro-batch, with the bytes a step holds besides (the optimizer's state) allocated beside them;
while they run out of memory, the plan is made again under an eighth less. With the cap set first, cuDNN takes
the largest workspace that fits and falls back to slimmer algorithms when none does. The trainer's
out-of-memory recovery (halving the micro-batch) stays as the last guard.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgerev._torchapi import restore_buffers, save_buffers
from edgerev.memory.measure.account import StepShape, held, weak_forward
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.memory.plan.autoplan import TrainingPlan
from edgerev.memory.solve.costs import BudgetTooSmall

OOM_SHRINK = 1 / 8  # of the cap taken off the planning budget when the tried step ran out of memory
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
    """The plan that fits the device, and each plan tried on the way (the last is the one returned)."""

    plan: TrainingPlan
    fits: tuple[Fit, ...]

    @property
    def fitted(self) -> bool:
        return self.fits[-1].measured_bytes is not None

    def summary(self) -> dict:
        return {"device_fit": [f.as_dict() for f in self.fits], "device_fitted": self.fitted}


def fit_to_device(plan_at: Callable[[int], TrainingPlan], measure: Callable[[TrainingPlan], int | None],
                  budget: int, rounds: int = ROUNDS) -> DeviceFit:
    """Plan under ``budget``, try the plan's real step, and plan again under less while it runs out of memory.

    Args:
        plan_at: the planner at a budget in bytes (raises :class:`BudgetTooSmall` below its floor).
        measure: the allocator's peak through real steps of a plan under the cap, ``None`` if they ran out.
        budget: the cap.

    Returns the first plan whose steps ran; when none did in ``rounds`` tries, the last one tried (the
    trainer's halving then guards it).

    Raises:
        BudgetTooSmall: the planner's floor is reached before a plan ran; it names the floor plus what was
            taken off the budget on the way, a budget under which the floor's plan would be tried.
    """
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
        if measured is not None:
            break
        # below the plan that ran out, not only below the budget it was planned under
        target = min(target, tp.predicted_peak_bytes) - int(budget * OOM_SHRINK)
    return DeviceFit(tp, tuple(fits))


def cuda_step_peak(model: nn.Module, plan: TrainingPlan, shape: StepShape, loss_fn: Callable[..., Tensor],
                   device: torch.device, teacher_on_device: bool = True, steps: int = 2) -> int | None:
    """The allocator's peak in bytes through ``steps`` real steps of ``plan`` (None: out of memory under the cap).

    Each step is the trainer's micro-batch loop (its first two micro-batches, as the accounting runs it) on
    random data of the step's shape. What a training step holds that this one would not (the optimizer's
    momentum, a teacher's logits, the teacher when it is not on the device yet) is allocated beside it for
    the steps' length. The model's gradients and batch-norm statistics are left as they were.
    """
    plan.apply(model)
    model.train()
    buffers = save_buffers(model)
    batch = shape.batch or plan.batch
    terms = held(model, shape, plan.batch)
    outside = terms["optimizer"] + terms["teacher_logits"] + (0 if teacher_on_device else terms["teacher"])
    peak = None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    try:
        held_beside = torch.empty(outside, dtype=torch.uint8, device=device)  # noqa: F841 (holds the bytes)
        x = torch.randn(batch, model.in_channels, shape.size, shape.size, device=device)
        targets: tuple[Tensor, ...] = (torch.randint(0, model.num_classes, (batch,), device=device),)
        if shape.unlabeled:
            targets += (torch.rand(batch, device=device),)
        if shape.teacher_bytes:
            targets += (torch.randn(batch, max(1, shape.teacher_classes), device=device),)
        parts = split_batch(batch, math.ceil(batch / plan.batch))[:2]
        for _ in range(steps):
            model.zero_grad(set_to_none=True)
            if shape.unlabeled:  # the weak views' no-grad forward before the step
                weak_forward(model, x[:min(plan.batch, shape.unlabeled)])
            accumulate(model, x, targets, parts, loss_fn)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        pass
    finally:
        held_beside = x = targets = None  # noqa: F841 (gone before the cache is emptied)
        model.zero_grad(set_to_none=True)
        restore_buffers(model, buffers)
        torch.cuda.empty_cache()
    return peak
