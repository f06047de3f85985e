"""edgerev's uses of torch's internals (``edgerev._torchapi``) that the engine and the trainer rely on."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgerev._torchapi import foreach, restore_buffers, save_buffers
from edgerev.memory.measure.profile import FlopCounter


def _net() -> nn.Module:
    """Buffers of three dtypes: batch norms' float32 statistics and int64 counters, and a float64 buffer."""
    net = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.ReLU(), nn.Conv2d(4, 2, 1), nn.BatchNorm2d(2))
    net.register_buffer("scale", torch.arange(3, dtype=torch.float64))
    return net


def test_buffers_saved_before_a_step_are_put_back_whole():
    net = _net().train()
    before = {k: v.clone() for k, v in net.named_buffers()}
    saved = save_buffers(net)
    assert {k: (v.dtype, v.shape) for k, v in saved.items()} == {k: (v.dtype, v.shape) for k, v in before.items()}
    assert all(saved[k].data_ptr() != v.data_ptr() for k, v in net.named_buffers())  # copies, not the buffers
    net(torch.randn(4, 3, 8, 8))  # a step that would run out of memory: its statistics moved
    net.get_buffer("scale").add_(1)
    assert not torch.equal(net[1].running_mean, before["1.running_mean"])
    restore_buffers(net, saved)
    assert all(torch.equal(v, before[k]) for k, v in net.named_buffers())


def test_saving_and_restoring_the_buffers_launches_a_kernel_per_dtype_not_per_buffer():
    """The trainer saves them before every step: on a GPU, one multi-tensor copy per dtype (counted on meta)."""
    net = _net().to("meta")
    with FlopCounter() as saving:
        saved = save_buffers(net)
    with FlopCounter() as restoring:
        restore_buffers(net, saved)
    assert len(list(net.buffers())) == 7
    assert saving.kernels == restoring.kernels == 3  # float32, int64, float64


@pytest.mark.parametrize("name, extra", [("mul", 2.0), ("sub", None), ("clamp_min_", 0.5), ("div_", None),
                                         ("norm", ()), ("reciprocal", ()), ("copy_", None)])
def test_a_multi_tensor_op_this_torch_lacks_runs_tensor_by_tensor_alike(monkeypatch, name, extra):
    g = torch.Generator().manual_seed(0)
    shapes = [(3,), (2, 4), (5, 1, 2)]

    def args():
        first = [torch.rand(s, generator=g) + 0.1 for s in shapes]
        second = [torch.rand(s, generator=g) + 0.1 for s in shapes] if extra is None else extra
        return (first,) if extra == () else (first, second)

    fused_args = args()
    fallback_args = tuple([t.clone() for t in a] if isinstance(a, list) else a for a in fused_args)
    fused = foreach(name, *fused_args)
    monkeypatch.delattr(torch, f"_foreach_{name}")
    slow = foreach(name, *fallback_args)
    if name.endswith("_"):  # in place: the first list is the result
        fused, slow = fused_args[0], fallback_args[0]
    assert len(fused) == len(slow) and all(torch.equal(a, b) for a, b in zip(fused, slow, strict=True))
