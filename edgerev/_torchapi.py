"""The private PyTorch APIs edgerev relies on, in one place so a torch upgrade has one file to check.

- ``untyped_storage()._cdata``: the identity of a tensor's storage (views and aliases share it). The
  public ``data_ptr()`` cannot tell two zero-sized or two fake storages apart.
- ``torch._subclasses.fake_tensor``: tensors with shapes and no data, on which a whole training step
  runs and the live-bytes tracker counts exactly what it would allocate. The accounting runs on the
  public ``meta`` device instead (:func:`shadowed`: the same bytes, three to four times fewer seconds
  per op, since a fake tensor's op runs the meta kernel and its own bookkeeping around it); fake tensors
  remain for the ops that have no meta kernel.
- ``torch.utils._python_dispatch.TorchDispatchMode``: the hook under autograd through which a meta op is answered
  from what the same call returned before (:class:`MetaMemo`), and the live-bytes tracker and the kernel counter see
  every op.
- ``torch._inductor.config``: the compiler's option that makes a compiled float32 division round as eager's
  (:func:`exact_division_options`).
- ``torch._C._cuda_getCublasWorkspaceSize`` and ``_cuda_getCublasLtWorkspaceSize``: the sizes of the workspaces
  cuBLAS and cuBLASLt keep per stream (:func:`cublas_workspace_bytes`), and ``_cuda_clearCublasWorkspaces``
  (:func:`clear_cublas_workspaces`); ``torch.utils._python_dispatch.
  _disable_current_modes``: real kernels run from inside a dispatch mode (:func:`without_dispatch_modes`).
"""

from __future__ import annotations

import contextlib
import copy
import logging
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode


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
    ``NotImplementedError``) runs again on fake tensors, which have fallbacks for those ops. On the meta device an op
    called before with the same arguments is answered from :class:`MetaMemo`. ``fn`` must make its tensors without
    naming a device."""
    try:
        with torch.device("meta"):
            copy = meta_copy(module)
            with MetaMemo():
                return fn(copy)
    except NotImplementedError as e:
        logging.getLogger(__name__).debug("no meta kernel (%s): accounting on fake tensors", e)
    with fake_mode() as mode:
        return fn(fake_copy(module, mode))


_UNCACHEABLE = object()
_SIMPLE = (int, float, bool, str, type(None), torch.dtype, torch.device, torch.layout, torch.memory_format)


class MetaMemo(TorchDispatchMode):
    """Meta-device ops answered from what the same op returned before for the same arguments.

    On the meta device an op's results depend on its arguments' shapes, strides, dtypes and on its other arguments
    alone, and have no data. Yet PyTorch computes many of them in Python (its decompositions replace the C++ meta
    kernels of ``leaky_relu``, ``add.out``, ``native_batch_norm``...: 0.1-2 ms an op), and a planned step repeats the
    same few hundred calls over its slices, blocks and candidates. The first call of each runs; later ones get new
    tensors of the recorded shapes and strides, or the very argument the op returned (an in-place or ``out=`` op).

    Only what replays exactly is recorded: results that are arguments, or tensors on storages of their own, made
    whole by ``empty_strided``, where the call changed no argument's shape, strides or storage (an ``out=`` resized);
    views run as they are. The record is per process, keyed also by the default dtype."""

    _calls: dict[tuple, object] = {}
    LIMIT = 100_000  # recorded calls at most (a long-lived process planning many models starts again past it)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.is_view:
            return func(*args, **kwargs)
        leaves: list[Tensor] = []
        storages: dict[int, int] = {}
        key = _call_key(func, args, kwargs, leaves, storages)
        record = self._calls.get(key) if key is not _UNCACHEABLE else _UNCACHEABLE
        if record is None:
            out = func(*args, **kwargs)
            record = _record(out, leaves, storages)
            if record is not _UNCACHEABLE and _argument_keys(leaves) != key[3]:
                record = _UNCACHEABLE  # the op changed an argument's metadata (resized an out=)
            if len(self._calls) >= self.LIMIT:
                self._calls.clear()
            self._calls[key] = record
            return out
        if record is _UNCACHEABLE:
            return func(*args, **kwargs)
        return _replay(record, leaves)


def _call_key(func, args: tuple, kwargs: dict, leaves: list[Tensor], storages: dict[int, int]):
    """What a meta op's results depend on; fills ``leaves`` (its tensor arguments in order) and ``storages`` (each
    distinct storage's index: which arguments alias which). :data:`_UNCACHEABLE` for an argument of another kind."""
    try:
        shape = (_value(args, leaves, storages), _value(tuple(kwargs.items()), leaves, storages))
    except TypeError:
        return _UNCACHEABLE
    return (func, torch.get_default_dtype(), shape, _argument_keys(leaves))


def _value(v, leaves: list[Tensor], storages: dict[int, int]):
    if isinstance(v, Tensor):
        if v.device.type != "meta" or type(v) is not Tensor and not isinstance(v, nn.Parameter):
            raise TypeError("not a plain meta tensor")
        leaves.append(v)
        return storages.setdefault(storage_key(v), len(storages))
    if isinstance(v, (list, tuple)):
        return (type(v), tuple(_value(w, leaves, storages) for w in v))
    if isinstance(v, _SIMPLE):
        return (type(v), v)
    raise TypeError(f"{type(v).__name__} argument")


def _argument_keys(leaves: list[Tensor]) -> tuple:
    return tuple((t.shape, t.stride(), t.storage_offset(), t.dtype, t.untyped_storage().nbytes()) for t in leaves)


def _record(out, leaves: list[Tensor], storages: dict[int, int]):
    """How to make ``out`` again: an argument by its index, a new tensor by its shape, strides and dtype, a list or
    tuple of those, or a constant; :data:`_UNCACHEABLE` where that would not be exact. (No closure: a recursive one
    is a reference cycle that would keep the op's tensors alive, to the tracker, until the garbage collector runs.)"""
    try:
        return _recorded(out, leaves, storages, set())
    except TypeError:
        return _UNCACHEABLE


def _recorded(o, leaves: list[Tensor], storages: dict[int, int], fresh: set[int]):
    if isinstance(o, Tensor):
        for i, t in enumerate(leaves):
            if o is t:
                return ("arg", i)
        key = storage_key(o)
        if type(o) is not Tensor or key in storages or key in fresh or o.storage_offset() != 0:
            raise TypeError("a view or a shared storage")
        fresh.add(key)
        if o.untyped_storage().nbytes() != _strided_bytes(o.shape, o.stride(), o.element_size()):
            raise TypeError("a storage larger than its tensor")
        return ("new", tuple(o.shape), o.stride(), o.dtype)
    if isinstance(o, (list, tuple)):
        return (type(o), tuple(_recorded(w, leaves, storages, fresh) for w in o))
    if isinstance(o, (int, float, bool, type(None))):
        return ("const", o)
    raise TypeError(f"{type(o).__name__} result")


def _strided_bytes(shape, stride, itemsize: int) -> int:
    if any(n == 0 for n in shape):
        return 0
    return (1 + sum((n - 1) * s for n, s in zip(shape, stride))) * itemsize


def _replay(record, leaves: list[Tensor]):
    kind = record[0]
    if kind == "arg":
        return leaves[record[1]]
    if kind == "new":
        return torch.empty_strided(record[1], record[2], dtype=record[3], device="meta")
    if kind == "const":
        return record[1]
    return kind(_replay(r, leaves) for r in record[1])


def is_fake(t: Tensor) -> bool:
    """True for tensors without data (fake or meta)."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(t, FakeTensor) or t.device.type == "meta"


def exact_division_options() -> dict[str, bool]:
    """``torch.compile`` options under which a compiled float32 division rounds to nearest as eager's does. Triton
    lowers ``/`` to an approximate division by default (``div.full``: within 2 units of the last place), so a
    compiled body's quotient could differ from the eager kernel's in its last bit; the option
    (``eager_numerics.division_rounding`` in torch 2.14, read here under whichever of its names this torch's
    configuration has) makes it ``div_rn``. Empty where it has none: its division is the approximate one."""
    from torch._inductor import config

    names = [k for k in config.get_config_copy() if k.rsplit(".", 1)[-1] in ("division_rounding",
                                                                            "emulate_divison_rounding",
                                                                            "emulate_division_rounding")]
    return {k: True for k in names}


def cublas_workspace_bytes() -> int | None:
    """Bytes cuBLAS and cuBLASLt keep allocated for a stream once a matrix product has run on it, as torch sizes
    them: cuBLAS's workspace and cuBLASLt's own (the same one where ``TORCH_CUBLASLT_UNIFIED_WORKSPACE`` is set).
    None where this torch does not say (torch 2.11 has neither getter)."""
    import os

    names = ["_cuda_getCublasWorkspaceSize"]
    if os.environ.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE", "0") in ("", "0"):
        names.append("_cuda_getCublasLtWorkspaceSize")
    if not all(hasattr(torch._C, n) for n in names):
        return None
    return sum(int(getattr(torch._C, n)()) for n in names)


def clear_cublas_workspaces() -> bool:
    """Free the workspaces cuBLAS and cuBLASLt keep (the next product makes them again, as torch does itself before
    it captures a CUDA graph); False where this torch cannot."""
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is None:
        return False
    clear()
    return True


@contextlib.contextmanager
def without_dispatch_modes() -> Iterator[None]:
    """Inside the block no dispatch mode sees an op (fake tensors, the trackers, the memo): real kernels run."""
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        yield


__all__ = ["clear_cublas_workspaces", "copy_all", "cublas_workspace_bytes", "exact_division_options", "fake_copy",
           "fake_mode", "foreach", "is_fake", "left_as_it_was", "meta_copy", "restore_buffers", "save_buffers",
           "shadowed", "storage_bytes", "storage_key", "without_dispatch_modes"]


def foreach(name: str, *args):
    """``torch._foreach_<name>`` over lists (one multi-tensor kernel, a few launches on a GPU for any number of
    tensors), or the same op tensor by tensor where this torch lacks it. An argument that is not a list or tuple is
    used for every tensor."""
    fn = getattr(torch, f"_foreach_{name}", None)
    if fn is not None:
        return fn(*args)
    lists = [a if isinstance(a, (list, tuple)) else [a] * len(args[0]) for a in args]
    return [getattr(Tensor, name)(*xs) for xs in zip(*lists, strict=True)]


def copy_all(dst: list[Tensor], src: list[Tensor]) -> None:
    """``dst[i].copy_(src[i])`` for each pair, in one multi-tensor copy per device and dtype (:func:`foreach`)."""
    groups: dict[tuple, tuple[list[Tensor], list[Tensor]]] = {}
    for d, s in zip(dst, src, strict=True):
        to, of = groups.setdefault((d.device, d.dtype, s.device, s.dtype), ([], []))
        to.append(d)
        of.append(s)
    with torch.no_grad():
        for to, of in groups.values():
            foreach("copy_", to, of)


def save_buffers(model: nn.Module) -> dict[str, Tensor]:
    """A copy of every buffer of ``model`` (batch norms' running statistics among them). The trainer takes one
    before every step (a step that runs out of memory puts them back), so it is a few kernel launches, not one per
    buffer (RevNeXt has 86, a tenth of a plain step's launches)."""
    named = dict(model.named_buffers())
    copies = {k: torch.empty_like(v) for k, v in named.items()}
    copy_all(list(copies.values()), list(named.values()))
    return copies


def restore_buffers(model: nn.Module, state: dict[str, Tensor]) -> None:
    """Put back the buffers :func:`save_buffers` copied."""
    named = dict(model.named_buffers())
    copy_all(list(named.values()), [state[k] for k in named])


@contextlib.contextmanager
def left_as_it_was(model: nn.Module) -> Iterator[None]:
    """Real steps on ``model`` that must leave no trace (a measurement): its buffers (batch norms' statistics),
    gradients and modules' modes are put back on exit. Its weights are not saved: nothing inside may step them."""
    buffers, modes = save_buffers(model), [(m, m.training) for m in model.modules()]
    grads = [(p, p.grad) for p in model.parameters()]
    try:
        yield
    finally:
        restore_buffers(model, buffers)
        for p, g in grads:
            p.grad = g
        for m, mode in modes:
            m.training = mode
