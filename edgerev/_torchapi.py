"""The private PyTorch APIs edgerev relies on, in one place so a torch upgrade has one file to check.

- ``untyped_storage()._cdata``: the identity of a tensor's storage (views and aliases share it). The
  public ``data_ptr()`` cannot tell two zero-sized or two fake storages apart.
- ``torch._subclasses.fake_tensor``: tensors with shapes and no data, on which a whole training step
  runs and the live-bytes tracker counts exactly what it would allocate. The accounting runs on the
  public ``meta`` device instead (:func:`shadowed`: the same bytes, three to four times fewer seconds
  per op, since a fake tensor's op runs the meta kernel and its own bookkeeping around it); fake tensors
  remain for the ops that have no meta kernel.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

import torch
from torch import Tensor, nn


def storage_key(t: Tensor) -> int:
    """An id of the storage behind ``t``, shared by its views and aliases, unique while it lives."""
    return t.untyped_storage()._cdata


def storage_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases counted once)."""
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            total += s.nbytes()
    return total


def fake_mode():
    """A new ``FakeTensorMode``: inside it, factories make fake tensors and nothing is allocated."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    return FakeTensorMode()


def fake_copy(module: nn.Module, mode) -> nn.Module:
    """A deep copy of ``module`` whose parameters, buffers and tensor attributes are fake tensors of ``mode``, on the
    CPU.

    On the CPU whatever device ``module`` is on: the callers make their fake inputs there, and the bytes
    of a step do not depend on the device (a copy on CUDA made every fake step of a CUDA model fail on
    mixed devices, the planner's profile among them).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def fake(t: Tensor) -> Tensor:
        # an uninitialised CPU twin (values never matter to a fake tensor); no copy of the device's data
        return mode.from_tensor(t if t.device.type == "cpu" else torch.empty_like(t, device="cpu"))

    with unset_fake_temporarily():
        return _copy_as(module, fake)


def meta_copy(module: nn.Module) -> nn.Module:
    """A deep copy of ``module`` on the meta device: its parameters, buffers and tensor attributes have shapes and no
    data."""
    return _copy_as(module, lambda t: t.to("meta"))


def _copy_as(module: nn.Module, convert: Callable[[Tensor], Tensor]) -> nn.Module:
    """A deep copy of ``module`` with ``convert`` applied to each of its tensors (parameters stay parameters, trainable
    as they were): each is converted *before* the copy, so no weight's data is copied on the way."""
    memo: dict[int, object] = {}
    for mod in module.modules():
        for p in mod._parameters.values():
            if p is not None and id(p) not in memo:
                memo[id(p)] = nn.Parameter(convert(p.detach()), requires_grad=p.requires_grad)
        for b in mod._buffers.values():
            if b is not None and id(b) not in memo:
                memo[id(b)] = convert(b)
        for value in vars(mod).values():  # a captured graph's constants are plain attributes
            if isinstance(value, Tensor) and id(value) not in memo:
                memo[id(value)] = convert(value.detach())
    return copy.deepcopy(module, memo)


T = TypeVar("T")


def shadowed(module: nn.Module, fn: Callable[[nn.Module], T]) -> T:
    """``fn(copy)`` on a copy of ``module`` whose tensors hold no data, with tensors made without a device made
    the same way: where it runs, nothing is allocated and every op returns what it would (shapes, strides,
    storages), so the live-bytes tracker counts a step's bytes exactly.

    The copy is on the meta device; a step using an op with no meta kernel (PyTorch raises
    ``NotImplementedError``) runs again on fake tensors, which have fallbacks for those ops. ``fn`` must make its
    tensors without naming a device."""
    try:
        with torch.device("meta"):
            return fn(meta_copy(module))
    except NotImplementedError as e:
        logging.getLogger(__name__).debug("no meta kernel (%s): accounting on fake tensors", e)
    with fake_mode() as mode:
        return fn(fake_copy(module, mode))


def is_fake(t: Tensor) -> bool:
    """True for tensors without data (fake or meta)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


__all__ = ["fake_copy", "fake_mode", "is_fake", "meta_copy", "shadowed", "storage_bytes", "storage_key"]
