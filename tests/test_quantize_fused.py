"""The fused quantizer: the eager path's codes bit for bit, its allocations on the meta device, its launches counted,
and the eager path taking over where the compiler fails.

Compiling the bodies (``torch.compile``, C++ on the CPU) takes a few seconds per variant: the module is ``slow``.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev import quantize as Q
from edgerev.memory.measure.profile import FlopCounter
from edgerev.models import create_model
from edgerev.quantize import LAUNCHES, dequantize, fusing, quantize
from tests.test_quantize import SMALL, sample

pytestmark = pytest.mark.slow


def both(x: torch.Tensor, bits: int, rng=None) -> tuple:
    """(eager copy, eager read-back, fused copy, fused read-back) of ``x``."""
    with fusing(False):
        q = quantize(x, bits, rng)
        d = dequantize(q)
    with fusing(True):
        qf = quantize(x, bits, rng)
        df = dequantize(qf)
    return q, d, qf, df


def assert_same(q, d, qf, df) -> None:
    assert qf.codes.dtype == q.codes.dtype and qf.codes.shape == q.codes.shape
    assert torch.equal(qf.codes, q.codes) and torch.equal(qf.table, q.table)
    assert df.shape == d.shape and df.dtype == d.dtype
    assert torch.equal(df, d)


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("shape", [(8, 6, 5, 5), (1, 3, 5, 1), (5, 2), (3, 3, 3)])
def test_the_fused_path_gives_the_eager_codes(bits, shape):
    """Every layout the engine saves (a convolution's 4-d input, a linear layer's 2-d one, a batch of one, an odd
    count of 4-bit codes; each its own compiled variant), and a given range."""
    x = sample(shape, seed=sum(shape))
    assert_same(*both(x, bits))
    if shape == (8, 6, 5, 5):
        dims = [d for d in range(x.dim()) if d != 1]
        given_range = (x.amax(dims) * 0.5, (-x.amin(dims)) * 0.25)  # values beyond it are clipped alike
        assert_same(*both(x, bits, given_range))


@settings(max_examples=100, deadline=None)
@given(bits=st.sampled_from((8, 4)), data=st.data())
def test_the_fused_path_gives_the_eager_codes_for_any_floats(bits, data):
    """Subnormals, zeros and values far apart in one channel: the same codes, hence the same signs."""
    big = torch.tensor(1e30).item()
    values = data.draw(st.lists(st.floats(-big, big, width=32), min_size=2, max_size=24))
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)
    assert_same(*both(x, bits))


@pytest.mark.parametrize("bits", (8, 4))
@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (3, 5, 7)])
def test_the_fused_operators_allocate_on_meta_what_they_return_for_real(bits, shape):
    """The meta device (the planner's accounting, the kernel count) sees the fused copy's true sizes."""
    x = sample(shape, seed=1)
    with fusing(True):
        real = quantize(x, bits)
        meta = quantize(x.to("meta"), bits)
        back = dequantize(meta)
    assert meta.codes.shape == real.codes.shape and meta.codes.dtype == real.codes.dtype
    assert meta.table.shape == real.table.shape and meta.table.dtype == real.table.dtype
    assert back.shape == x.shape and back.dtype == x.dtype and back.device.type == "meta"


def step_counts(mode: str, on: bool) -> FlopCounter:
    torch.manual_seed(0)
    model = create_model("revnext", **SMALL).to("meta").train()
    model.body.set_modes(mode)
    counter = FlopCounter()
    with fusing(on), counter:
        x = torch.randn(8, 3, 32, 32, device="meta")
        F.cross_entropy(model(x), torch.zeros(8, dtype=torch.long, device="meta")).backward()
    return counter


@pytest.mark.parametrize("mode", ["store8", "store4"])
def test_the_kernel_counter_counts_each_fused_operator_at_its_launches(mode):
    """One encode and one decode per saved activation, each at its launches; none of the eager kernels."""
    eager, fused = step_counts(mode, False), step_counts(mode, True)
    copies = eager.by_op["ceil_"]  # the eager path takes one ceil per copy (the whole batch is one slice here)
    assert fused.by_op["encode"] == LAUNCHES["encode"] * copies
    assert fused.by_op["decode"] == LAUNCHES["decode"] * copies
    assert "ceil_" not in fused.by_op and "addcdiv_" not in fused.by_op
    assert fused.kernels < eager.kernels and fused.total == eager.total  # the same FLOPs in fewer launches


def test_a_fused_step_gives_the_eager_gradients(mode="store4"):
    """Through the engine (saved-tensor hooks in the forward, read back in the backward): the same bits. (``store8``
    differs only in the codes' width, which the tests above compare.)"""
    grads = []
    for on in (False, True):
        torch.manual_seed(3)
        model = create_model("revnext", **SMALL).train()
        model.body.set_modes(mode)
        x, y = torch.randn(4, 3, 16, 16), torch.randint(0, 10, (4,))
        with fusing(on):
            F.cross_entropy(model(x), y).backward()
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


def test_a_compiler_that_fails_hands_over_to_the_eager_path_with_one_warning(monkeypatch):
    """No Triton on the device (or no C++ compiler): one warning naming the cause, then the eager kernels, the
    same codes; the fused path is not tried again."""
    calls = []

    def broken(body, *variant):
        def fail(*args):
            calls.append(body.__name__)
            raise RuntimeError("Cannot find a working triton installation")
        return fail

    monkeypatch.setattr(Q, "_compile", broken)
    monkeypatch.setattr(Q, "_broken", [])
    x = sample((4, 6, 5, 5), seed=2)
    with fusing(False):
        expected = quantize(x, 8)
    with fusing(True):
        with pytest.warns(RuntimeWarning, match="did not compile.*triton.*eager"):
            q = quantize(x, 8)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            back = dequantize(quantize(x, 8))
    assert calls == ["_encode_body"]
    assert torch.equal(q.codes, expected.codes) and torch.equal(back, dequantize(expected))


@pytest.mark.gpu
@pytest.mark.parametrize("bits", (8, 4))
def test_the_fused_path_on_cuda_gives_the_eager_codes(bits):
    """On the GPU (Triton): the default there, the same codes as the eager kernels."""
    x = sample((16, 32, 12, 12), seed=4).cuda()
    q, d, qf, df = both(x, bits)
    with fusing(None):
        auto = quantize(x, bits)
    assert torch.equal(auto.codes, qf.codes)
    assert_same(q, d, qf, df)
