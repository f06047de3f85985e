"""Value checks: an input batch or an activation that holds NaN or infinity, said in one clear error.

A check computes on the device whether a tensor holds a value that is not finite; telling the host needs a read
back, and every read waits for the device to finish all it was given. Outside a training step a check reads at
once (:func:`check_finite`). Inside one (:func:`deferred_checks`, opened by the micro-batch loop the trainer and
the accounting share) every check only computes its flag, and the step folds them into its loss and reads that
one value at its end (:meth:`FiniteChecks.read`): a step reads the host once, whatever its micro-batches, and
nothing in between waits for the device (what a CUDA graph of the step needs).

A deferred check that fails raises at that read, after the step's update: the weights then hold what the bad
values made of them, so the caller ends the run there. The trainer does: a diverged run is one error, and it
saves a checkpoint only after a step whose read passed.

On fake and meta tensors the flags are computed (the same ops and bytes as a real step, so the accounting
matches it) and never read.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from contextvars import ContextVar

import torch
from torch import Tensor

from edgerev._torchapi import is_fake
from edgerev.errors import NonFiniteError


class FiniteChecks:
    """The value checks of one step: for each thing checked, in the order first checked, a flag on the device
    (True while every tensor checked as it held only finite values).

    A check made again (the same ``what``: the next micro-batch's input) folds into its flag in place, so what a
    step keeps does not grow with its micro-batches (the accounting runs two of them for all).
    """

    def __init__(self) -> None:
        self.flags: dict[str, Tensor] = {}

    def add(self, finite: Tensor, what: str) -> None:
        """Keep ``finite`` (a one-element flag) as the check of ``what``."""
        kept = self.flags.get(what)
        if kept is None:
            self.flags[what] = finite
        else:
            kept.logical_and_(finite)

    def read(self, loss: Tensor) -> float:
        """``loss`` (a one-element tensor) as a float, read back with every flag in one read of the host.

        The flags fold into the value on the device (NaN where any check failed), so a step whose checks pass
        reads one scalar; only a NaN reads the flags again, to say which check failed. On fake or meta tensors
        nothing is read: 0.0.

        Raises:
            NonFiniteError: for the first check whose tensor held NaN or infinity.
        """
        value = loss.detach().reshape(()).float()
        if is_fake(value):
            return 0.0
        if self.flags:
            finite = torch.stack([flag.to(value.device) for flag in self.flags.values()])
            value = value.masked_fill(finite.all().logical_not_(), math.nan)
        read = value.item()
        if math.isnan(read) and self.flags:
            for what, ok in zip(self.flags, finite.tolist()):
                if not ok:
                    raise NonFiniteError(f"{what} holds NaN or infinity")
        return read


_deferred: ContextVar[FiniteChecks | None] = ContextVar("edgerev_deferred_checks", default=None)


@contextlib.contextmanager
def deferred_checks() -> Iterator[FiniteChecks]:
    """Within the block, :func:`check_finite` keeps its flag in the checks this yields instead of reading it;
    the caller reads them all at once (:meth:`FiniteChecks.read`). Blocks nest: an inner one keeps its own."""
    checks = FiniteChecks()
    token = _deferred.set(checks)
    try:
        yield checks
    finally:
        _deferred.reset(token)


def all_finite(t: Tensor) -> Tensor:
    """A one-element flag on ``t``'s device: True where every value of ``t`` (not empty) is finite."""
    lo, hi = torch.aminmax(t.detach())
    # 0 * lo is NaN for an infinite or NaN lo, and hi adds its own: one flag for both ends
    return torch.isfinite(lo.mul(0).add_(hi))


def check_finite(t: Tensor, what: str) -> None:
    """Raise :class:`NonFiniteError` if ``t`` holds NaN or infinity; inside :func:`deferred_checks`, keep the
    flag for the step's read instead. Empty tensors pass; fake and meta ones are never read."""
    if t.numel() == 0:
        return
    checks = _deferred.get()
    if checks is not None:
        checks.add(all_finite(t), what)
    elif not is_fake(t) and not bool(all_finite(t)):
        raise NonFiniteError(f"{what} holds NaN or infinity")


__all__ = ["FiniteChecks", "all_finite", "check_finite", "deferred_checks"]
