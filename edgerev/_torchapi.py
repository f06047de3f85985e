"""The private PyTorch APIs edgerev relies on, in one place so a torch upgrade has one file to check.

- ``untyped_storage()._cdata``: the identity of a tensor's storage (views and aliases share it). The
  public ``data_ptr()`` cannot tell two zero-sized or two fake storages apart.
- ``torch._subclasses.fake_tensor``: tensors with shapes and no data, on which a whole training step
  runs in well under a second and the live-bytes tracker counts exactly what it would allocate.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable

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
    """A deep copy of ``module`` whose parameters and buffers are fake tensors of ``mode``, on the CPU.

    On the CPU whatever device ``module`` is on: the callers make their fake inputs there, and the bytes
    of a step do not depend on the device (a copy on CUDA made every fake step of a CUDA model fail on
    mixed devices, the planner's profile among them).
    """
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def fake(t: Tensor) -> Tensor:
        # an uninitialised CPU twin (values never matter to a fake tensor); no copy of the device's data
        return mode.from_tensor(t if t.device.type == "cpu" else torch.empty_like(t, device="cpu"))

    with unset_fake_temporarily():
        clone = copy.deepcopy(module)
        for mod in clone.modules():
            for name, p in list(mod._parameters.items()):
                if p is not None:
                    mod._parameters[name] = nn.Parameter(fake(p.detach()), requires_grad=p.requires_grad)
            for name, b in list(mod._buffers.items()):
                if b is not None:
                    mod._buffers[name] = fake(b)
    return clone


def is_fake(t: Tensor) -> bool:
    """True for tensors without data (fake or meta)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


__all__ = ["fake_copy", "fake_mode", "is_fake", "storage_bytes", "storage_key"]
