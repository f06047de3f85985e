"""Live tensor bytes, measured on any device: a dispatch mode that sees every op's output storage.

Each storage is counted once, the first time an op returns it, and uncounted by a weakref finalizer
when it dies. Views and in-place ops return storages already seen and so count nothing. Under
``FakeTensorMode`` the same tracker predicts the peak of a step without allocating it.

Only tensors produced inside the ``with`` block are counted; what existed before (weights, the
input batch) is the caller's baseline. Memory an operator uses internally and frees before it
returns (a convolution workspace) is invisible to it, except where library memory is being counted
(:mod:`edgerev.memory.measure.workspaces`, where a CUDA step is planned): then each such operator's
bytes, measured on the device, are added to the live tensors while it runs. On CUDA, :class:`CudaPeak`
reads the allocator itself.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from edgerev._torchapi import storage_bytes, storage_key
from edgerev.errors import EdgerevError
from edgerev.memory.measure.workspaces import active


class MemoryBudgetExceeded(EdgerevError, MemoryError):
    """The tracked live bytes went over the budget given to :class:`MemoryTracker`."""


class MemoryTracker(TorchDispatchMode):
    """Count live tensor bytes created inside the block.

    Attributes:
        current: bytes live now (counted storages not yet freed).
        peak: the largest value ``current`` reached.
        peak_op: the operator that allocated at the moment of the peak (where to look).
        section_peaks: the largest value ``current`` reached in each section named by :meth:`enter`.

    Args:
        budget: if set, raise :class:`MemoryBudgetExceeded` as soon as ``current`` passes it.
        baseline: bytes to add to every figure (e.g. weights and inputs that live throughout).
    """

    def __init__(self, budget: int | None = None, baseline: int = 0) -> None:
        super().__init__()
        self.budget, self.baseline = budget, baseline
        self.current = self.peak = baseline
        self.peak_op = ""
        self._live: dict[int, int] = {}
        self.section: object = None
        self.section_peaks: dict[object, int] = {}

    def enter(self, section: object) -> None:
        """Attribute what follows to ``section`` (None: to no section) in :attr:`section_peaks`."""
        self.section = section
        if section is not None and self.current > self.section_peaks.get(section, -1):
            self.section_peaks[section] = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        # an output on the storage of an input is a view or an in-place result: nothing new, unless
        # the op grew a storage this tracker counts (resize_, out= ops)
        inputs = {storage_key(a) for a in _tensors(args)} | {storage_key(a) for a in _tensors(kwargs.values())}
        for t in _tensors((out,)):
            key = storage_key(t)
            if key not in inputs or key in self._live:
                self._see(t, func)
        lib = active()
        if lib is not None:  # what the operator took inside itself, beside its inputs and outputs, while it ran
            inside = lib.transient(func, args, kwargs)
            if inside:
                self._reached(self.current + inside, func, " (with its workspace)")
        return out

    def _see(self, t: torch.Tensor, func) -> None:
        storage = t.untyped_storage()
        key = storage_key(t)
        nbytes = storage.nbytes()
        known = self._live.get(key)
        if known is None:
            self._live[key] = nbytes
            weakref.finalize(storage, self._free, key)
            self.current += nbytes
        elif nbytes != known:  # resized in place
            self._live[key] = nbytes
            self.current += nbytes - known
        else:
            return
        self._reached(self.current, func)

    def _reached(self, total: int, func, what: str = "") -> None:
        """The live bytes were ``total`` during ``func``: the peaks, and the budget."""
        if total > self.peak:
            self.peak, self.peak_op = total, f"{func}{what}"
        if self.section is not None and total > self.section_peaks.get(self.section, -1):
            self.section_peaks[self.section] = total
        if self.budget is not None and total > self.budget:
            raise MemoryBudgetExceeded(
                f"live tensors reached {total} bytes, over the budget of {self.budget} bytes (at {func}{what})"
            )

    def _free(self, key: int) -> None:
        self.current -= self._live.pop(key, 0)

    def reset_peak(self) -> None:
        self.peak = self.current


def _tensors(values) -> Iterator[torch.Tensor]:
    """The tensors among an ATen op's arguments or results: tensors, or lists and tuples of them (an ATen schema
    nests no deeper; ``tree_flatten`` costs a fifth of the tracker's time per op)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            for w in v:
                if isinstance(w, torch.Tensor):
                    yield w


class CudaPeak:
    """``torch.cuda.max_memory_allocated`` over the block, with the bytes live before as baseline.

    Attributes:
        peak: the most bytes allocated (live tensors, in the allocator's rounded blocks, workspaces included).
        reserved: the most bytes the caching allocator held from the driver (``max_memory_reserved``): what
            the cap of ``set_per_process_memory_fraction`` bounds and what other processes cannot use.
    """

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        self.baseline = self.peak = self.reserved = 0

    def __enter__(self) -> CudaPeak:
        torch.cuda.synchronize(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline = torch.cuda.memory_allocated(self.device)
        return self

    def __exit__(self, *exc) -> None:
        torch.cuda.synchronize(self.device)
        self.peak = torch.cuda.max_memory_allocated(self.device)
        self.reserved = torch.cuda.max_memory_reserved(self.device)


__all__ = ["CudaPeak", "MemoryBudgetExceeded", "MemoryTracker", "storage_bytes"]
