"""What the math libraries take on a CUDA device beside the tensors: counted where a CUDA step is planned.

The accounting (:mod:`edgerev.memory.measure.account`) counts every tensor a step makes, exactly: on an H200 the
live-tensor count of a planned RevNeXt step at batch 32, 240x240 was the prediction to the byte. CUDA's allocator
held more, in two kinds of memory no tensor of the step owns:

* kept for the process: cuBLAS's and cuBLASLt's workspaces, one each per stream, made by the first matrix
  product and held from then on (65 MiB on an H200; their sizes are torch's, ``CUBLAS_WORKSPACE_CONFIG`` and
  ``CUBLASLT_WORKSPACE_SIZE``, read from torch where it says them and measured where it does not):
  :attr:`LibraryMemory.persistent`, part of a step's baseline;
* taken inside one operator and given back before it returns: cuDNN's convolution workspace and the copies
  its wrapper makes (172 MB of workspace and a 29 MB copy inside the stem's convolution backward of that step,
  whole batch at 240x240, where the step's tensors peaked): :meth:`LibraryMemory.transient`, added to the
  live tensors at the moment that operator runs.

Neither can be bounded from PyTorch: it has no cuDNN workspace limit, and cuDNN's ``CUDNN_CONV_WSCAP_DBG`` left
the H200's peaks unchanged to the byte at 0, 16 and 64 MiB. So both are measured on the device itself. A
convolution is run once per signature (operator, shapes, strides, dtypes, arguments) on tensors of its shapes,
and the bytes allocated at its peak beyond its inputs and outputs are its transient. That run also chooses the
algorithm torch keeps for the signature (cuDNN's plan is cached by its parameters), so the step then runs with
the workspace measured. Under a cap set first, cuDNN takes the largest workspace that fits and the probe sees
that one.

A CUDA plan counts them where the planning process has the device (:func:`for_device`); planned elsewhere (a
CPU machine planning for a GPU), they are not counted and the plan's summary says so.
"""

from __future__ import annotations

import contextlib
import contextvars
import itertools
from collections.abc import Callable, Iterator

import torch

from edgerev._torchapi import (
    clear_cublas_workspaces,
    cublas_workspace_bytes,
    storage_bytes,
    without_dispatch_modes,
)
from edgerev.errors import described

#: the operators whose kernels take memory of their own: convolutions (cuDNN's workspace; the native kernels'
#: columns where cuDNN is off)
LIBRARY_OPS = frozenset({torch.ops.aten.convolution.default, torch.ops.aten.convolution_backward.default})

Probe = Callable[[object, tuple, dict], int]
_SERIALS = itertools.count(1)


def signature(func, args: tuple, kwargs: dict) -> tuple:
    """What decides an operator's workspace: the operator, each tensor argument's shape, strides and dtype (its
    values do not matter), and the other arguments."""
    def key(v):
        if isinstance(v, torch.Tensor):
            return ("T", tuple(v.shape), tuple(v.stride()), v.dtype)
        if isinstance(v, (list, tuple)):
            return tuple(key(x) for x in v)
        return v
    return (str(func), key(tuple(args)), tuple(sorted((k, key(v)) for k, v in kwargs.items())))


class LibraryMemory:
    """The math libraries' memory on one device: kept for the process, and taken inside each probed operator.

    Args:
        persistent: bytes the libraries keep allocated once a step has run.
        probe: measures one operator call's transient bytes (its arguments are tensors without data); the
            default runs it on ``device``.
        device: where the default probe runs.

    Attributes:
        failures: why a signature could not be probed (its transient counted as 0, and the summary's
            ``unprobed`` counts them), by signature.
    """

    def __init__(self, persistent: int, probe: Probe | None = None, device: torch.device | str = "cuda") -> None:
        self.serial = next(_SERIALS)  # what a cache of accounts keys them by: each instance its own figures
        self.persistent = persistent
        self.device = torch.device(device)
        self._probe = probe or self._on_device
        self._transient: dict[tuple, int] = {}
        self.failures: dict[tuple, str] = {}

    def transient(self, func, args: tuple, kwargs: dict) -> int:
        """Bytes ``func`` takes inside itself beyond its inputs and outputs (0 for operators that take none)."""
        if func not in LIBRARY_OPS:
            return 0
        key = signature(func, args, kwargs)
        if key not in self._transient:
            try:
                self._transient[key] = max(0, int(self._probe(func, args, kwargs)))
            # out of memory (its tensors alone do not fit: the step would not either) or a kernel that refused the
            # probe: counted as 0, and said
            except Exception as e:  # noqa: BLE001
                self._transient[key] = 0
                self.failures[key] = described(e)[:200]
        return self._transient[key]

    def summary(self) -> dict:
        """For a plan's summary: what was counted."""
        return {"counted": True, "persistent_bytes": self.persistent, "probed": len(self._transient),
                "largest_transient_bytes": max(self._transient.values(), default=0),
                **({"unprobed": len(self.failures)} if self.failures else {})}

    def _on_device(self, func, args: tuple, kwargs: dict) -> int:
        """Run ``func`` once on this device on uninitialized tensors of the arguments' shapes: the bytes allocated
        at its peak beyond the inputs and outputs. Resets the device's peak statistics."""
        dev = self.device

        def real(v):
            if isinstance(v, torch.Tensor):
                return torch.empty_strided(tuple(v.shape), tuple(v.stride()), dtype=v.dtype, device=dev)
            if isinstance(v, (list, tuple)):
                return type(v)(real(x) for x in v)
            return v

        with without_dispatch_modes(), torch.no_grad():
            a, kw = real(tuple(args)), {k: real(v) for k, v in kwargs.items()}
            torch.cuda.synchronize(dev)
            before = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            out = func(*a, **kw)
            torch.cuda.synchronize(dev)
            peak = torch.cuda.max_memory_allocated(dev)
            outs = storage_bytes(t for t in (out if isinstance(out, (list, tuple)) else (out,))
                                 if isinstance(t, torch.Tensor))
            del out, a, kw
        return peak - before - outs


_ACTIVE: contextvars.ContextVar[LibraryMemory | None] = contextvars.ContextVar("edgerev_library_memory",
                                                                               default=None)
_DEVICES: dict[torch.device, LibraryMemory] = {}


def active() -> LibraryMemory | None:
    """The library memory the accounting counts now (None: none, as on the CPU)."""
    return _ACTIVE.get()


def active_key() -> int:
    """Which library memory the accounting counts now, for a cache of accounts (0: none)."""
    lib = _ACTIVE.get()
    return 0 if lib is None else lib.serial


@contextlib.contextmanager
def counting(lib: LibraryMemory | None) -> Iterator[LibraryMemory | None]:
    """Count ``lib`` in every account and tracker inside the block (None: count none)."""
    token = _ACTIVE.set(lib)
    try:
        yield lib
    finally:
        _ACTIVE.reset(token)


def for_device(device: torch.device | str) -> LibraryMemory | None:
    """The library memory of ``device`` when it is a CUDA device this process can run on (one per device and
    process: a signature is probed once); None otherwise."""
    dev = torch.device(device)
    if dev.type != "cuda" or not torch.cuda.is_available():
        return None
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev not in _DEVICES:
        _DEVICES[dev] = LibraryMemory(_kept(dev), device=dev)
    return _DEVICES[dev]


def _kept(dev: torch.device) -> int:
    """The bytes cuBLAS and cuBLASLt keep on ``dev`` once a step has run: their sizes where torch says them, else
    measured: the workspaces are let go of, then a classifier head's forward and backward runs on small tensors
    (its product with a bias through cuBLASLt, its gradients through cuBLAS), and what stays allocated is theirs."""
    sizes = cublas_workspace_bytes()
    if sizes is not None:
        return sizes
    with torch.cuda.device(dev), without_dispatch_modes():
        torch.cuda.synchronize(dev)
        clear_cublas_workspaces()
        before = torch.cuda.memory_allocated(dev)
        x = torch.ones(8, 64, device=dev, requires_grad=True)
        w = torch.ones(10, 64, device=dev, requires_grad=True)
        b = torch.zeros(10, device=dev, requires_grad=True)
        torch.nn.functional.linear(x, w, b).sum().backward()
        del x, w, b
        torch.cuda.synchronize(dev)
        return max(0, torch.cuda.memory_allocated(dev) - before)


def not_counted(device: torch.device | str) -> dict:
    """A plan's summary entry where a CUDA step was planned without its device."""
    return {"counted": False, "why": f"planned without {device} in this process: the math libraries' workspaces "
                                      "are not in the prediction"}


__all__ = ["LIBRARY_OPS", "LibraryMemory", "active", "active_key", "counting", "for_device", "not_counted", "signature"]
