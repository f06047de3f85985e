"""Value checks: at once outside a training step, folded into the step's one read of the host inside one."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.errors import NonFiniteError
from edgerev.finite import check_finite, deferred_checks
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.memory.measure.profile import FlopCounter
from edgerev.models import create_model
from edgerev.train.cap import train_step

FLOATS = st.floats(width=32)  # the extremes, infinities and NaN included


@settings(max_examples=300, deadline=None)
@given(st.lists(FLOATS, min_size=1, max_size=12))
def test_check_finite_raises_exactly_when_a_value_is_not_finite(values):
    """Any float32 values, in one read of the host."""
    t = torch.tensor(values, dtype=torch.float32)
    if all(math.isfinite(v) for v in values):
        check_finite(t, "values")
    else:
        with pytest.raises(NonFiniteError, match="values"):
            check_finite(t, "values")


@settings(max_examples=200, deadline=None)
@given(st.lists(st.lists(FLOATS, min_size=1, max_size=6), min_size=0, max_size=5),
       st.floats(width=32, allow_nan=False, allow_infinity=False))
def test_deferred_checks_raise_at_the_read_for_the_first_that_failed(tensors, loss):
    """Inside the block nothing raises; the read names the first tensor that held NaN or infinity, in the order
    they were checked, or gives the loss back when every one was finite."""
    with deferred_checks() as checks:
        for i, values in enumerate(tensors):
            check_finite(torch.tensor(values, dtype=torch.float32), f"tensor {i}")
    first = next((i for i, values in enumerate(tensors) if not all(math.isfinite(v) for v in values)), None)
    if first is None:
        assert checks.read(torch.tensor(loss)) == pytest.approx(loss)
    else:
        with pytest.raises(NonFiniteError, match=f"^tensor {first} holds NaN or infinity$"):
            checks.read(torch.tensor(loss))


def test_a_nan_loss_with_finite_checks_is_read_as_it_is():
    with deferred_checks() as checks:
        check_finite(torch.ones(3), "ones")
    assert math.isnan(checks.read(torch.tensor(float("nan"))))


def test_deferred_blocks_nest_and_end():
    with deferred_checks() as outer:
        check_finite(torch.ones(2), "outer")
        with deferred_checks() as inner:
            check_finite(torch.tensor([math.inf]), "inner")
        check_finite(torch.zeros(1), "outer again")
    assert list(outer.flags) == ["outer", "outer again"]
    assert list(inner.flags) == ["inner"]
    with pytest.raises(NonFiniteError, match="inner"):
        check_finite(torch.tensor([math.inf]), "inner")  # the blocks are over: at once again


def test_fake_and_empty_tensors_are_never_read():
    check_finite(torch.empty(0), "empty")
    check_finite(torch.empty(3, device="meta"), "meta")
    with deferred_checks() as checks:
        check_finite(torch.empty(3, device="meta"), "meta")
    assert checks.read(torch.empty((), device="meta")) == 0.0


def tiny(mode: str):
    torch.manual_seed(0)
    model = create_model("revnext", width=4, blocks=(1, 1, 1, 1, 1))
    model.set_modes(mode)
    g = torch.Generator().manual_seed(1)
    return model, torch.randn(6, 3, 16, 16, generator=g), torch.randint(0, 10, (6,), generator=g)


@pytest.mark.parametrize("mode", ["invert", "floor", "recompute", "store", "store8"])
@pytest.mark.parametrize("micro_batches", [1, 3])
def test_a_training_step_reads_the_host_once(mode, micro_batches):
    """The trainer's step, clipped, in every mode and any micro-batches: one value read back, at its end, and it
    is the loss the step computed."""
    model, x, y = tiny(mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    counter = FlopCounter()
    with counter:
        result = train_step(model, optimizer, x, y, micro_batches=micro_batches, clip_grad_norm=1.0)
    assert counter.syncs == 1
    model, x, y = tiny(mode)
    with torch.no_grad():
        expected = sum(float(F.cross_entropy(model(x[p]), y[p])) * (p.stop - p.start) / 6
                       for p in split_batch(6, micro_batches))
    assert result.loss == pytest.approx(expected, rel=1e-5)


def test_a_training_step_on_the_meta_device_reads_nothing():
    """Meta tensors cannot be read at all: a whole step runs on them, so nothing in it waits for the device."""
    model, x, y = tiny("invert")
    model.to("meta")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    result = train_step(model, optimizer, x.to("meta"), y.to("meta"), micro_batches=2, clip_grad_norm=1.0)
    assert result.loss == 0.0


@pytest.mark.parametrize("where", ["input", "weights"])
def test_a_step_that_meets_nan_raises_at_its_read(where):
    """A NaN in the batch, or weights that hold one, is said at the step's read, naming what held it first."""
    model, x, y = tiny("invert")
    if where == "input":
        x[2, 1, 3, 3] = math.nan
    else:
        with torch.no_grad():
            next(model.stages[1].parameters()).view(-1)[0] = math.inf
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    match = "the input batch" if where == "input" else "the output of the invertible sequence"
    with pytest.raises(NonFiniteError, match=match):
        train_step(model, optimizer, x, y, micro_batches=2)


def test_a_step_keeps_one_flag_per_check_however_many_micro_batches():
    """What a step keeps does not grow with its micro-batches: the accounting runs two of them for all."""
    model, x, y = tiny("store")
    summed = accumulate(model, x, (y,), split_batch(6, 3), F.cross_entropy)
    assert list(summed.checks.flags) == ["the input batch",
                                         "the output of the invertible sequence (diverged weights or a bad input)"]
    assert summed.read() == pytest.approx(float(summed.loss))
    with deferred_checks() as checks:
        for values in ([1.0], [math.nan], [2.0]):
            check_finite(torch.tensor(values), "the same")
    with pytest.raises(NonFiniteError, match="the same"):
        checks.read(torch.tensor(0.0))
