"""MemoryTracker: what it counts (new storages), what it does not (views, in-place results, old tensors)."""

from __future__ import annotations

import gc

import pytest
import torch

from edgerev.errors import EdgerevError
from edgerev.memory.measure.tracker import MemoryBudgetExceeded, MemoryTracker
from tests import helpers  # noqa: F401  (sets one torch thread for these tiny shapes)


def test_counts_a_new_tensor():
    with MemoryTracker() as tr:
        a = torch.empty(1000)
        assert tr.current == 4000
        b = torch.zeros(10, 10, dtype=torch.float64)
        assert tr.current == 4000 + 800
        c = a * 2
        assert tr.current == 4800 + 4000
    assert tr.peak == 8800
    assert "mul" in tr.peak_op
    del a, b, c


def test_counts_every_output_of_a_multi_output_op():
    x = torch.randn(100, 10)
    with MemoryTracker() as tr:
        values, indices = x.max(dim=1)
        assert tr.current == 100 * 4 + 100 * 8
    del values, indices


def test_views_are_not_counted():
    with MemoryTracker() as tr:
        a = torch.randn(20, 50)
        base = tr.current
        views = [a.view(1000), a[3:7], a.t(), a.unsqueeze(0), a.transpose(0, 1)[2], a.detach(), a.narrow(1, 0, 5),
                 *a.split(5), *a.unbind(0), a.expand(2, 20, 50), a.view(torch.int32)]
        assert tr.current == base == 4000
        del views


def test_inplace_results_are_not_counted():
    with MemoryTracker() as tr:
        a = torch.randn(1000)
        a.add_(1).mul_(2).clamp_(min=0)
        torch.add(a, 1, out=a)
        a[:10] = 3.0
        a.zero_()
        assert tr.current == 4000
        assert tr.peak <= 4000 + 8  # the scalar of the slice assignment at most
    del a


def test_freed_tensors_are_uncounted():
    with MemoryTracker() as tr:
        a = torch.empty(1000)
        b = torch.empty(500)
        view = a[:10]
        del a
        assert tr.current == 6000  # a view keeps the storage alive
        del view
        assert tr.current == 2000
        del b
        assert tr.current == 0
    assert tr.peak == 6000


def test_peak_is_the_maximum():
    with MemoryTracker() as tr:
        for n in (100, 2000, 300):
            t = torch.empty(n)
            del t
        a = torch.empty(1000)
        b = torch.empty(1000)
        del a, b
        c = torch.empty(10)
        assert tr.current == 40
        assert tr.peak == 8000
        tr.reset_peak()
        assert tr.peak == 40
        d = torch.empty(20)
        assert tr.peak == 120
    del c, d


def test_baseline_is_added():
    with MemoryTracker(baseline=1234) as tr:
        assert tr.current == tr.peak == 1234
        a = torch.empty(10)
        assert tr.current == 1274
    del a


def test_pre_existing_tensors_are_not_counted():
    pre = torch.randn(100, 100)
    with MemoryTracker() as tr:
        v = pre[10:20]
        w = pre.view(-1)
        u = v.detach().t()
        pre.add_(1)
        v.mul_(2)
        assert tr.current == 0
        del v, w, u
        assert tr.current == 0  # never counted, so never uncounted
        s = pre.sum()  # a new tensor computed from the old one is counted
        assert tr.current == 4
    assert tr.peak == 4
    del s


def test_tensors_outside_the_block_are_not_counted():
    with MemoryTracker() as tr:
        pass
    a = torch.empty(1000)
    assert tr.current == tr.peak == 0
    del a


def test_autograd_backward_is_tracked():
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(32, 64)
    with MemoryTracker() as tr:
        y = (x @ w).relu().sum()
        y.backward()
    assert w.grad is not None
    # the matmul result, the relu result (saved), the gradient of w at least
    assert tr.peak >= 32 * 64 * 4 * 2
    assert tr.current >= 64 * 64 * 4  # w.grad is alive


def test_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    gib = 1 << 30
    with FakeTensorMode(), MemoryTracker() as tr:
        x = torch.empty(gib // 4)  # 1 GiB, never allocated
        assert isinstance(x, FakeTensor)
        assert tr.current == gib
        y = x * 2
        assert tr.current == 2 * gib
        z = y[::2]
        assert tr.current == 2 * gib
        del y, z
        assert tr.current == gib
    assert tr.peak == 2 * gib
    del x


def test_fake_tensor_mode_training_step():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        x = torch.randn(4, 3, 64, 64)
        with MemoryTracker() as tr:
            conv(x).square().sum().backward()
    out_bytes = 4 * 8 * 64 * 64 * 4
    assert tr.peak >= out_bytes
    assert tr.peak < 20 * out_bytes


def test_budget():
    with MemoryTracker(budget=10_000) as tr:
        a = torch.empty(2000)  # 8000 bytes: within budget
        del a
        b = torch.empty(2400)  # 9600 bytes: still within
        del b
    assert tr.peak == 9600
    with pytest.raises(MemoryBudgetExceeded, match="10000") as info:
        with MemoryTracker(budget=10_000):
            keep = torch.empty(2000)
            more = torch.empty(1000)  # 12000 bytes live
            del keep, more
    assert isinstance(info.value, EdgerevError) and isinstance(info.value, MemoryError)
    assert "empty" in str(info.value)


@pytest.mark.parametrize("how", ["resize_", "out="])
def test_in_place_resize_is_counted(how):
    with MemoryTracker() as tr:
        a = torch.empty(10)
        if how == "resize_":
            a.resize_(1000)
        else:
            torch.cat([torch.ones(500), torch.ones(500)], out=a.resize_(0))
        assert a.untyped_storage().nbytes() == 4000
        assert tr.current >= 4000
    del a


def test_step_peak_on_cpu():
    from edgerev.memory.measure.peak import step_peak
    from edgerev.models import create_model

    torch.manual_seed(0)
    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1))
    gc.collect()
    small = step_peak(model, 2, 16)
    large = step_peak(model, 4, 16)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert small.baseline_bytes >= weights
    assert small.peak_bytes > small.baseline_bytes + weights  # at least the weight gradients
    assert large.peak_bytes > small.peak_bytes
    assert small.peak_op
