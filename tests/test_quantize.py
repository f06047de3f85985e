"""Sign-preserving 8/4-bit activation copies: the quantizer itself, the bytes store8/store4 keep, their gradients."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev import approximate
from edgerev.engine import InvertibleSequence, plain
from edgerev.layers import InvBatchNorm2d, InvLeakyReLU
from edgerev.memory.measure.profile import stage_inputs
from edgerev.memory.measure.tracker import MemoryTracker
from edgerev.models import create_model
from edgerev.quantize import bn_range, channel_range, dequantize, quantize
from tests.helpers import cosine, rel_err

BITS = (8, 4)


def sample(shape, seed: int = 0, dtype: torch.dtype = torch.float32, zeros: float = 0.1,
           outliers: float = 0.01) -> torch.Tensor:
    """Gaussian values with a fraction of exact zeros and of large values (ten times larger), reproducible."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    x[torch.rand(shape, generator=g) < zeros] = 0.0
    x[torch.rand(shape, generator=g) < outliers] *= 10.0
    return x.to(dtype)


def codes_of(hi: torch.Tensor, lo: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The documented split: ``2**bits`` codes shared by the signs in proportion to their ranges, one at least."""
    total = 2**bits
    npos = (total * hi / (hi + lo)).round().clamp(1, total - 1)
    return npos, total - npos


def reference(x: torch.Tensor, bits: int, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The documented rule, element by element: the middle of the bin of its sign's share of the codes."""
    shape = (1, -1, *([1] * (x.dim() - 2)))
    eps = torch.finfo(x.dtype).eps
    hi, lo = hi.clamp_min(eps), lo.clamp_min(eps)
    npos, nneg = (c.view(shape) for c in codes_of(hi, lo, bits))
    hi, lo = hi.view(shape), lo.view(shape)
    pos = x > 0
    up = (x * npos / hi).floor().clamp(min=0).minimum(npos - 1) + 0.5
    down = (-x * nneg / lo).floor().clamp(min=0).minimum(nneg - 1) + 0.5
    return torch.where(pos, up * hi / npos, -down * lo / nneg)


# ---- the quantizer ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("shape", [(4, 6, 5, 5), (3, 5, 7), (1, 3, 5, 1), (2, 1, 1, 1), (5, 2)])
@pytest.mark.parametrize("seed", range(3))
def test_sign_is_preserved_exactly(bits, shape, seed):
    x = sample(shape, seed)
    x.view(-1)[0] = 0.0  # at least one exact zero
    dq = dequantize(quantize(x, bits))
    assert dq.shape == x.shape and dq.dtype == x.dtype
    assert torch.equal(dq > 0, x > 0)
    assert bool((dq[x == 0] <= 0).all()), "an exact zero must come back non-positive (leaky ReLU treats 0 as negative)"
    assert bool((dq[x < 0] < 0).all())


@settings(max_examples=200, deadline=None)
@given(bits=st.sampled_from(BITS), data=st.data())
def test_sign_is_preserved_for_any_floats(bits, data):
    """Any float32 values, subnormals and values far apart in one channel included, keep their sign."""
    big = torch.tensor(1e30).item()  # as float32 holds it; ranges far beyond overflow the bin widths' arithmetic
    values = data.draw(st.lists(st.floats(-big, big, width=32), min_size=2, max_size=24))
    x = torch.tensor(values, dtype=torch.float32).view(1, 1, -1, 1)
    dq = dequantize(quantize(x, bits))
    assert torch.isfinite(dq).all()
    assert torch.equal(dq > 0, x > 0), f"{dq.flatten().tolist()} for {values}"
    assert bool((dq[x <= 0] <= 0).all())


def test_a_subnormal_next_to_a_large_range_stays_positive():
    """Its value over a bin width above 1 underflows to zero: the sign still puts it among the positive codes."""
    tiny = torch.finfo(torch.float32).tiny / 2**20  # subnormal
    x = torch.tensor([1e4, tiny, 0.0, -1.0]).view(1, 1, 2, 2)
    for bits in BITS:
        dq = dequantize(quantize(x, bits))
        assert torch.equal(dq > 0, x > 0), f"{bits} bits: {dq.flatten().tolist()}"


@pytest.mark.parametrize("bits", BITS)
def test_zeros_come_back_non_positive_even_in_an_all_zero_channel(bits):
    x = torch.zeros(2, 3, 4, 4)
    x[:, 1] = torch.randn(2, 4, 4)
    dq = dequantize(quantize(x, bits))
    assert torch.equal(dq > 0, x > 0)
    assert bool((dq[:, 0] <= 0).all()) and bool((dq[:, 2] <= 0).all())
    assert torch.isfinite(dq).all()


@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_error_is_at_most_half_a_bin(bits, dtype):
    """With the range measured on the batch, every value is within half a bin of its copy."""
    x = sample((4, 6, 5, 5), 1, dtype)
    q = quantize(x, bits)
    hi, lo = channel_range(x)
    assert torch.equal(q.pos, hi) and torch.equal(q.neg, lo)
    npos, nneg = codes_of(hi, lo, bits)
    assert bool((npos + nneg == 2**bits).all()) and bool((npos >= 1).all()) and bool((nneg >= 1).all())
    view = (1, -1, 1, 1)
    half = torch.where(x > 0, (hi / npos).view(view), (lo / nneg).view(view)) / 2
    dq = dequantize(q)
    slack = 4 * torch.finfo(dtype).eps * x.abs().amax()
    assert bool(((dq - x).abs() <= half + slack).all())
    torch.testing.assert_close(dq, reference(x, bits, hi, lo), rtol=0, atol=float(slack))


def test_eight_bits_are_much_more_accurate_than_four():
    x = sample((8, 16, 6, 6), 2, zeros=0.0, outliers=0.0)
    e8 = rel_err(dequantize(quantize(x, 8)), x)
    e4 = rel_err(dequantize(quantize(x, 4)), x)
    assert e8 < 0.01
    assert e4 < 0.15
    assert e8 * 8 < e4  # 16 times finer bins: the error shrinks about 16 times


@pytest.mark.parametrize("bits", BITS)
def test_per_channel_ranges(bits):
    """Channels of very different scales each keep their own relative accuracy."""
    x = sample((4, 3, 6, 6), 3, zeros=0.0, outliers=0.0) * torch.tensor([1e-3, 1.0, 1e3]).view(1, 3, 1, 1)
    dq = dequantize(quantize(x, bits))
    bound = 0.01 if bits == 8 else 0.15
    for c in range(3):
        assert rel_err(dq[:, c], x[:, c]) < bound, f"channel {c}"


@pytest.mark.parametrize("bits", BITS)
def test_values_are_clipped_to_the_given_range(bits):
    scale = torch.tensor([0.5, -1.0, 2.0])
    shift = torch.tensor([0.2, -0.5, 1.0])
    hi, lo = bn_range(scale, shift, k=1.0)
    torch.testing.assert_close(hi, torch.tensor([0.7, 0.5, 3.0]))
    torch.testing.assert_close(lo, torch.tensor([0.3, 1.5, 1.0]))
    x = sample((4, 3, 5, 5), 4) * 4.0  # well outside the range
    dq = dequantize(quantize(x, bits, (hi, lo)))
    npos, nneg = codes_of(hi, lo, bits)
    top = ((npos - 0.5) / npos * hi).view(1, 3, 1, 1).expand_as(x)
    bottom = ((nneg - 0.5) / nneg * lo).view(1, 3, 1, 1).expand_as(x)
    assert torch.equal(dq > 0, x > 0)
    assert bool((dq <= top + 1e-6).all()) and bool((-dq <= bottom + 1e-6).all())
    above, below = x > top, x < -bottom
    assert above.any() and below.any()
    torch.testing.assert_close(dq[above], top[above])  # clipped to the top bin
    torch.testing.assert_close(dq[below], -bottom[below])
    torch.testing.assert_close(dq, reference(x, bits, hi, lo))


@pytest.mark.parametrize("bits", BITS)
def test_sign_survives_a_range_with_no_positive_part(bits):
    """``bn_range`` gives ``hi = 0`` when ``shift <= -k |scale|``; a batch-norm output can still be positive
    (``xhat > k``), and the module promises its copy stays positive."""
    hi, lo = bn_range(torch.tensor([1.0]), torch.tensor([-10.0]))
    assert hi.item() == 0.0
    x = torch.tensor([-3.0, 0.5, 2.0, 0.0]).view(1, 1, 2, 2)
    dq = dequantize(quantize(x, bits, (hi, lo)))
    assert torch.equal(dq > 0, x > 0), f"{dq.flatten().tolist()} for {x.flatten().tolist()}"


@pytest.mark.parametrize("numel_shape", [(2, 3, 5, 5), (1, 3, 5, 1), (3, 1, 1, 1), (1, 1, 1, 1), (2, 5)])
def test_four_bit_codes_are_packed_two_per_byte(numel_shape):
    x = sample(numel_shape, 5)
    n = x.numel()
    q8, q4 = quantize(x, 8), quantize(x, 4)
    assert q8.codes.dtype == q4.codes.dtype == torch.uint8
    assert q8.nbytes == n
    assert q4.nbytes == math.ceil(n / 2)
    assert q4.shape == x.shape and q4.bits == 4
    # the packed codes decode to the same values as the rule applied element by element, last element included
    hi, lo = channel_range(x)
    torch.testing.assert_close(dequantize(q4), reference(x, 4, hi, lo), rtol=0, atol=1e-6)
    # and two 4-bit codes in a byte are the low and high nibble of consecutive elements
    view = (1, -1, *[1] * (x.dim() - 2))
    eps = torch.finfo(x.dtype).eps
    hi, lo = hi.clamp_min(eps), lo.clamp_min(eps)
    npos, nneg = (c.view(view) for c in codes_of(hi, lo, 4))
    up = (x * npos / hi.view(view)).floor().clamp(min=0).minimum(npos - 1) + nneg  # positives after the others
    down = nneg - 1 - (-x * nneg / lo.view(view)).floor().clamp(min=0).minimum(nneg - 1)  # in the values' order
    codes = torch.where(x > 0, up, down).to(torch.uint8).flatten()
    if n % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    assert torch.equal(q4.codes.flatten(), codes[0::2] | (codes[1::2] << 4))


@pytest.mark.parametrize("bits", BITS)
def test_float64_input(bits):
    x = sample((3, 4, 3, 3), 6, torch.float64, outliers=0.0)
    q = quantize(x, bits)
    dq = dequantize(q)
    assert dq.dtype == torch.float64 and q.dtype == torch.float64
    assert torch.equal(dq > 0, x > 0)
    assert rel_err(dq, x) < (0.01 if bits == 8 else 0.15)
    assert q.nbytes == (x.numel() if bits == 8 else math.ceil(x.numel() / 2))


def test_the_input_is_left_untouched():
    x = sample((2, 3, 4, 4), 7)
    before = x.clone()
    for bits in BITS:
        quantize(x, bits)
    assert torch.equal(x, before)


def test_bad_arguments():
    with pytest.raises(ValueError, match="8 or 4"):
        quantize(torch.randn(2, 3, 4, 4), 2)
    with pytest.raises(ValueError, match="batch, channels"):
        quantize(torch.randn(5), 8)


# ---- what the engine keeps, and the gradients it gets from the copies ------------------------------------------------

SMALL = dict(width=8, blocks=(1, 1, 1, 1, 1))


def kept_bytes(model, x: torch.Tensor, mode: str) -> int:
    """Live bytes the forward of the body leaves for its backward (the pooled output included)."""
    model.body.set_modes(mode)
    with MemoryTracker() as tr:
        out = model.body(x, samples=x.shape[0])
        kept = tr.current
        assert out.grad_fn is not None
        out.sum().backward()  # and the backward runs on what was kept
    model.zero_grad(set_to_none=True)
    return kept


def test_store4_keeps_less_than_store8_less_than_store(monkeypatch):
    torch.manual_seed(0)
    model = create_model("revnext", **SMALL)
    batch, size = 4, 16
    x = torch.randn(batch, 3, size, size)
    copies: list = []

    def spy(t, bits, rng=None, slice_bytes=None):
        copies.append(quantize(t, bits, rng, slice_bytes))
        return copies[-1]

    monkeypatch.setattr(approximate, "quantize", spy)
    kept, numels = {}, {}
    for m in ("store", "store8", "store4", "invert"):
        copies.clear()
        kept[m] = kept_bytes(model, x, m)
        numels[m] = [math.prod(q.shape) for q in copies]
    assert kept["invert"] < kept["store4"] < kept["store8"] < kept["store"], kept
    # one copy per saved activation of every layer, the same ones at either precision
    assert numels["store8"] == numels["store4"] and len(numels["store8"]) > len(stage_inputs(model, size))
    # the difference is exactly the codes: one byte per element of every copy, or half a byte (rounded up)
    n = numels["store8"]
    assert kept["store8"] - kept["store4"] == sum(n) - sum(math.ceil(k / 2) for k in n)
    # and 8-bit copies of every layer's saved activations are at least 3 times smaller than the graphs
    assert kept["store8"] * 3 < kept["store"]


def param_grads(model, x, y, reference: bool) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    with plain(model, enabled=reference):
        F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def test_store8_gradients_are_close_and_store4_no_closer():
    torch.manual_seed(1)
    model = create_model("revnext", **SMALL)
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    ref = param_grads(model, x, y, reference=True)
    cos = {}
    for mode in ("invert", "store8", "store4"):
        model.body.set_modes(mode)
        g = param_grads(model, x, y, reference=False)
        cos[mode] = cosine(g, ref)
    assert cos["invert"] > 0.99999, cos  # exact mode: the control
    assert cos["store8"] > 0.98, cos
    assert 0.9 < cos["store4"] <= cos["store8"], cos


@pytest.mark.parametrize("mode", ["store8", "store4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_leaky_relu_gradient_is_exact_from_the_copy(mode, dtype):
    """The leaky ReLU backward depends only on signs, and the copy keeps every sign."""
    seq = InvertibleSequence([InvLeakyReLU(0.2)], modes=[mode], pool=None)
    x = sample((3, 4, 5, 5), 8, dtype)
    u = sample((3, 4, 5, 5), 9, dtype, zeros=0.0)
    grads = []
    for reference in (False, True):
        xx = x.clone().requires_grad_()
        with plain(seq, enabled=reference):
            out = seq(xx)
            if not reference:
                assert type(out.grad_fn).__name__ == "_EngineBackward"
            (g,) = torch.autograd.grad((out * u).sum(), [xx])
        grads.append(g)
    assert torch.equal(grads[0], grads[1])


def test_leaky_relu_after_batch_norm_gradient_is_exact_in_store8():
    bn = InvBatchNorm2d(2).double()
    with torch.no_grad():
        bn.weight.fill_(0.9)  # scale 1.0 with eps_i = 0.1
        bn.bias.fill_(-5.0)
    seq = InvertibleSequence([bn, InvLeakyReLU(0.2)], modes=["store", "store8"], pool=None)
    x = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x[0, :, 0, 0] = 50.0  # an outlier: normalized to about +7.9, so its batch-norm output is positive
    u = torch.randn(1, 2, 8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    grads = []
    for reference in (False, True):
        xx = x.clone().requires_grad_()
        with plain(seq, enabled=reference):
            out = seq(xx)
            assert int((out > 0).sum()) == 2
            (g,) = torch.autograd.grad((out * u).sum(), [xx])
        grads.append(g)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-9, atol=1e-12)
