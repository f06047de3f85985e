"""The hard memory cap, and training steps that survive running into it.

On CUDA the cap is the allocator's: ``torch.cuda.set_per_process_memory_fraction``. On CPU the
live-tensor tracker enforces the same budget and raises :class:`MemoryBudgetExceeded`, so the
behaviour is the same and testable without a GPU.

The CPU cap counts tensors, not the interpreter: Python objects, the allocator's slack and the
libraries' own buffers are outside it (the systemd unit's ``MemoryMax=`` is the outer guard). Its
figure is exact for tensors, and a step's tensors depend only on the shapes and the plan, not on
the values: :class:`CpuCap` therefore runs the tracker on the first step of each new (shapes, plan,
weights) and trusts the plan for the steps that repeat it, so a capped run costs what an uncapped
one does (the tracker's dispatch on every op was 1.48x a step).

:func:`train_step` runs one optimizer step on a batch. If the step runs out of memory, it restores
what the failed attempt touched (gradients, batch-norm running statistics), splits the batch into
twice as many micro-batches, accumulates their gradients and tries again, down to micro-batches of
one sample. Each loss is weighted by its share of the batch, so the update equals the full-batch one
wherever the loss is a sum over samples (batch norm in training mode normalizes each micro-batch by
its own statistics, as with any gradient accumulation). The optimizer steps exactly once per call,
after every micro-batch succeeded. The loop over the micro-batches is memory's
(:mod:`edgerev.memory.measure.microbatch`): the step's accounting runs the same function on fake tensors.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev._torchapi import restore_buffers, save_buffers, storage_bytes
from edgerev.errors import EdgerevError
from edgerev.memory.measure.microbatch import StepLoss, accumulate, split_batch, step_signature
from edgerev.memory.measure.tracker import MemoryBudgetExceeded, MemoryTracker
from edgerev.train.graphs import StepGraphs
from edgerev.train.optim import adaptive_clip_

OOM_ERRORS: tuple[type[BaseException], ...] = (MemoryBudgetExceeded, torch.cuda.OutOfMemoryError)


class StepFailed(EdgerevError):
    """Even micro-batches of one sample do not fit the cap."""


# With expandable segments the allocator checks a request against the cap and then maps whole pages of
# its pool (2 MiB small, 20 MiB large), so the bytes it reserves may pass the cap by up to a large page
# less its 2 MiB granule: measured 2 MiB over a 400 MiB cap on an H100 (docs/concepts/measurements.md).
EXPANDABLE_PAGE = 20 * 2**20
ALLOC_CONF_VARIABLES = ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF")  # torch's newer name, and the older


def expandable_segments(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether the caching allocator may map its memory in pages: ``expandable_segments:True`` in either
    of the variables torch reads its allocator settings from when CUDA starts (newer versions read the
    first and ignore the second when both are set, older ones only the second: either counts, since a
    page kept back costs less than a cap passed)."""
    return any(_expandable(environ.get(name, "")) for name in ALLOC_CONF_VARIABLES)


def _expandable(settings: str) -> bool:
    for option in settings.split(","):
        key, _, value = option.partition(":")
        if key.strip() == "expandable_segments":
            return value.strip().lower() == "true"
    return False


def cuda_cap_fraction(budget: int, totals: tuple[int, ...], expandable: bool) -> float:
    """The memory fraction under which the allocator reserves at most ``budget`` bytes: torch versions
    differ in which device total they multiply (the device properties' or ``cudaMemGetInfo``'s), so the
    fraction is taken of the larger, and with expandable segments a large page is kept back.

    Raises:
        EdgerevError: the budget is more than the device has, or not above one page with expandable
            segments."""
    total = max(totals)
    if budget > min(totals):
        raise EdgerevError(f"a cap of {budget:,} bytes is more than the device's {min(totals):,} bytes")
    allowed = budget - EXPANDABLE_PAGE if expandable else budget
    if allowed <= 0:
        raise EdgerevError(f"a cap of {budget:,} bytes leaves nothing once expandable segments' page of "
                           f"{EXPANDABLE_PAGE:,} bytes is kept back; raise the cap or unset expandable_segments")
    return allowed / total


def apply_cuda_cap(budget: int, device: torch.device | str = "cuda") -> float:
    """Limit the bytes this process's CUDA allocator reserves to ``budget``; returns the fraction set."""
    device = torch.device(device)
    if device.index is None:  # set_per_process_memory_fraction refuses a device without an index ("cuda")
        device = torch.device("cuda", torch.cuda.current_device())
    totals = (torch.cuda.get_device_properties(device).total_memory, torch.cuda.mem_get_info(device)[1])
    fraction = cuda_cap_fraction(budget, totals, expandable_segments())
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


class CpuCap:
    """The CPU cap of a run: ``budget`` bytes over a fixed ``baseline`` (what the step accounting says
    lives outside the step: weights, buffers, optimizer state, the teacher, the batch).

    A step whose signature (:func:`edgerev.memory.measure.microbatch.step_signature`: input and target shapes,
    micro-batches, the model's modes and execution, its parameter shapes) was already verified under the
    tracker runs without it: its tensors are the same. Anything that changes memory changes the signature and
    is verified again.

    ``peak``: the most bytes the tracker saw alive in a verified step, baseline included (0 before the
    first): the measured figure to set against ``budget``.
    """

    def __init__(self, budget: int, baseline: int) -> None:
        self.budget, self.baseline = budget, baseline
        self._verified: set[tuple] = set()
        self.verified_steps = self.trusted_steps = 0
        self.peak = 0

    @classmethod
    def over_alive(cls, budget: int, model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor,
                   target: Tensor | tuple[Tensor, ...]) -> CpuCap:
        """A cap of ``budget`` bytes over the tensors alive now: the weights, buffers, the batch, its targets and
        the optimizer's state (for a step no accounting gave a baseline; a fresh one verifies every step)."""
        targets = target if isinstance(target, tuple) else (target,)
        state = [s for st in optimizer.state.values() for s in st.values() if isinstance(s, Tensor)]
        return cls(budget, storage_bytes([*model.parameters(), *model.buffers(), x, *targets, *state]))

    def needs_check(self, key: tuple) -> bool:
        return key not in self._verified

    def verified(self, key: tuple) -> None:
        self._verified.add(key)


@dataclass
class StepResult:
    loss: float
    micro_batches: int
    retries: int


def train_step(model: nn.Module, optimizer: torch.optim.Optimizer, x: Tensor, target: Tensor | tuple[Tensor, ...], *,
               micro_batches: int = 1, loss_fn: Callable[..., Tensor] = F.cross_entropy,
               clip_grad_norm: float | None = None, adaptive_clip: float | None = None, cap: CpuCap | None = None,
               graphs: StepGraphs | None = None) -> StepResult:
    """One optimizer step on ``(x, target)``, split into micro-batches as memory requires.

    Args:
        target: the labels, or a tuple of per-sample tensors (labels, a teacher's logits ...) that
            are split with the batch and passed to ``loss_fn(logits, *target)``.
        micro_batches: split to start from (a previous step's answer; halving only ever grows it).
        clip_grad_norm: scale the summed gradient down to this norm before the step (None: never).
        adaptive_clip: scale each unit's summed gradient down to this fraction of its weight's norm before the step
            (:func:`edgerev.train.optim.adaptive_clip_`; None: never); before ``clip_grad_norm`` where both are set.
        cap: the CPU cap: its budget over its baseline, verified once per new (shapes, plan) and trusted
            afterwards (see :class:`CpuCap`; :meth:`CpuCap.over_alive` for a baseline of what is alive now).
            None: no CPU cap; on CUDA, set the cap once with :func:`apply_cuda_cap`.
        graphs: on CUDA, replay the step as a CUDA graph while its shapes, plan and weights repeat
            (:class:`edgerev.train.graphs.StepGraphs`: the micro-batch loop is replayed, the update runs as here);
            not for a step under a CUDA cap (the graph's pool lends nothing to the update beside it); None: every
            step launches its kernels one by one.

    The step reads the host once, at its end: its loss with the model's value checks (:mod:`edgerev.finite`).

    Raises:
        NonFiniteError: the input batch or an activation held NaN or infinity. It is raised at that read, after
            the update: end the run there (its weights are what the bad values made of them).
    """
    n = x.shape[0]
    targets = target if isinstance(target, tuple) else (target,)
    if graphs is not None and cap is None:
        replayed = graphs.step(model, x, targets, micro_batches, loss_fn, split_batch(n, micro_batches))
        if replayed is not None:
            return _update(model, optimizer, (adaptive_clip, clip_grad_norm), replayed, micro_batches, 0)
    buffers = save_buffers(model)
    retries = 0
    while True:
        optimizer.zero_grad(set_to_none=True)
        key = step_signature(model, x, targets, micro_batches) if cap is not None else None
        checked = cap is not None and cap.needs_check(key)
        guard = cpu_cap(cap.budget, cap.baseline) if checked else contextlib.nullcontext()
        try:
            parts = split_batch(n, micro_batches)
            with guard as tracker:
                total = accumulate(model, x, targets, parts, loss_fn)
        except OOM_ERRORS as e:
            optimizer.zero_grad(set_to_none=True)
            restore_buffers(model, buffers)  # the failed forward must not count as a step for batch norm
            if x.is_cuda:
                torch.cuda.empty_cache()
            if micro_batches >= n:
                raise StepFailed(f"a micro-batch of one sample does not fit the memory cap: {e}") from None
            micro_batches = min(2 * micro_batches, n)
            retries += 1
            continue
        if cap is not None:
            if checked:
                cap.verified(key)
                cap.verified_steps += 1
                cap.peak = max(cap.peak, tracker.peak)
            else:
                cap.trusted_steps += 1
        if graphs is not None:
            graphs.ran_eagerly(model, x, targets, micro_batches, loss_fn)
        return _update(model, optimizer, (adaptive_clip, clip_grad_norm), total, micro_batches, retries)


def _update(model: nn.Module, optimizer: torch.optim.Optimizer, clip: tuple[float | None, float | None],
            total: StepLoss, micro_batches: int, retries: int) -> StepResult:
    """The optimizer's step on the summed gradients (clipped first where ``clip``, the unit-wise ratio and the global
    norm, asks), then the step's one read of the host: its loss and value checks."""
    adaptive, norm = clip
    if adaptive is not None or norm is not None:
        params = [p for p in model.parameters() if p.grad is not None]
        if adaptive is not None:
            adaptive_clip_(params, adaptive)
        if norm is not None:
            torch.nn.utils.clip_grad_norm_(params, norm)
    optimizer.step()
    return StepResult(total.read(), micro_batches, retries)
