"""Invertible blocks: round trips, the engine face (forward_/inverse_/backward_), gradchecks, bad input."""

from __future__ import annotations

import copy

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from edgerev.engine import InvertibleSequence, plain
from edgerev.errors import ShapeError
from edgerev.layers import (
    BatchPool,
    Coupling,
    HybridBlock,
    InvBatchNorm2d,
    InvConv2d,
    InvLeakyReLU,
    Tape,
    chunk_budget,
)
from tests.helpers import (
    BLOCKS,
    LAYERWISE,
    MODES,
    block_modes,
    engine_fn,
    make_block,
    params_of,
    randomize_,
    residual_fn,
)

TIGHT = dict(rtol=1e-10, atol=1e-10)
POOLS = ("channel_pool", "batch_pool")
BN_KINDS = ("bn_train", "bn_eval", "hybrid", "coupling")


def sample(shape=(3, 8, 4, 4), seed: int = 1, dtype=torch.float64) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=dtype)


def pooled(kind: str, x: torch.Tensor) -> torch.Size:
    b, c, h, w = x.shape
    return torch.Size((b, 4 * c, h // 2, w // 2) if kind == "channel_pool" else (4 * b, c, h // 2, w // 2))


# ---- round trips --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BLOCKS)
def test_inverse_of_forward(kind):
    block = make_block(kind)
    x = sample()
    with torch.no_grad():
        y = block(x)
        x_rec = block.inverse(y)
    assert y.shape == (pooled(kind, x) if kind in POOLS else x.shape)
    if kind not in POOLS:
        assert not torch.allclose(y, x)  # the block does something
    if kind in POOLS:
        assert torch.equal(x_rec, x)
    else:
        torch.testing.assert_close(x_rec, x, **TIGHT)


@pytest.mark.parametrize("kind", ["bn_eval", "leaky_0.2", "leaky_0.5", "conv", "channel_pool", "batch_pool",
                                  "coupling", "hybrid"])
def test_forward_of_inverse_any_output(kind):
    """forward(inverse(y)) == y for any y: every block whose inverse does not depend on a batch.

    Batch norm (and the hybrid block holding it) is put in eval mode: in training mode its inverse
    uses the statistics of the previous forward, which the forward of the inverse re-measures.
    An additive coupling is exact even in training mode: ``G`` sees the same ``y1`` both ways.
    """
    block = make_block(kind)
    if kind == "hybrid":
        block.eval()
    y = sample(seed=7)
    if kind == "channel_pool":
        y = sample((3, 32, 2, 2), seed=7)
    elif kind == "batch_pool":
        y = sample((12, 8, 2, 2), seed=7)
    with torch.no_grad():
        x = block.inverse(y)
        y_rec = block(x)
    if kind in POOLS:
        assert x.shape == ((3, 8, 4, 4))
        assert torch.equal(y_rec, y)
    else:
        torch.testing.assert_close(y_rec, y, **TIGHT)


@pytest.mark.parametrize("kind", ["bn_train", "hybrid"])
def test_forward_of_inverse_train_mode_on_forward_outputs(kind):
    """In training mode forward(inverse(y)) == y holds for outputs of the last forward, not for any y."""
    block = make_block(kind)
    z = sample(seed=3)
    with torch.no_grad():
        y = block(z)  # the forward whose statistics ``inverse`` uses
        torch.testing.assert_close(block(block.inverse(y)), y, **TIGHT)
        # a tensor that is not an output of that forward has other batch statistics
        other = sample(seed=4) * 3.0 + 1.0
        block(z)
        assert not torch.allclose(block(block.inverse(other)), other, atol=1e-3)


@pytest.mark.parametrize("kind", POOLS)
def test_pool_layout(kind):
    """Sub-image (a, b) of sample n goes to channel block 2a+b (channel pool) or sample 4n+2a+b (batch pool)."""
    x = sample((2, 3, 4, 6))
    y = make_block(kind)(x)
    assert y.shape == pooled(kind, x)
    for a in range(2):
        for b in range(2):
            k = 2 * a + b
            sub = x[:, :, a::2, b::2]
            if kind == "channel_pool":
                assert torch.equal(y[:, 3 * k: 3 * (k + 1)], sub)
            else:
                assert torch.equal(y[k::4], sub)


@pytest.mark.parametrize("kind", POOLS)
def test_pool_engine_face_exact(kind):
    block = make_block(kind)
    x = sample((3, 8, 4, 6))
    y = block(x)
    with chunk_budget(1):  # one sample per slice
        y_ = block.forward_(x.clone(), Tape())
        assert torch.equal(y_, y)
        assert torch.equal(block.inverse_(y_.clone(), Tape()), x)
    with chunk_budget(0):  # no slicing
        assert torch.equal(block.forward_(x.clone(), Tape()), y)


# ---- the engine face ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", BLOCKS)
def test_forward_inplace_matches_forward(kind):
    block = make_block(kind)
    x = sample()
    with torch.no_grad():
        ref = block(x)
        tape = Tape()
        y = block.forward_(x.clone(), tape)
    torch.testing.assert_close(y, ref, rtol=1e-12, atol=1e-12)
    tape.replay = True
    with torch.no_grad():
        x_rec = block.inverse_(y.clone(), tape)
    if kind in POOLS:
        assert torch.equal(x_rec, x)
    else:
        torch.testing.assert_close(x_rec, x, **TIGHT)


@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "channel_half", "one_pixel"])
def test_batch_norm_training_forward_in_place_over_any_layout(layout):
    """The engine's training forward normalizes a dense working buffer over its own storage (no copy back) and a
    strided one (a channel half of a block) through a copy: both give autograd's output, statistics and running
    estimates, bit for bit, and the buffer keeps its storage."""
    ref, bn = InvBatchNorm2d(8), InvBatchNorm2d(8)
    randomize_(ref)
    bn.load_state_dict(ref.state_dict())
    ref.train(), bn.train()
    h, w = (1, 1) if layout == "one_pixel" else (5, 4)  # one pixel: dense with channel stride 1 (CUDA's NHWC kernel)
    base = sample((3, 16 if layout == "channel_half" else 8, h, w), seed=4, dtype=torch.float32)

    def laid_out(t):  # the kernels reduce in an order of their layout's: compare within one layout
        return {"contiguous": t, "one_pixel": t, "channels_last": t.contiguous(memory_format=torch.channels_last),
                "channel_half": t[:, 8:]}[layout]

    x = laid_out(base.clone())
    with torch.no_grad():
        y_ref = ref(laid_out(base.clone()))
        tape = Tape()
        pointer = x.data_ptr()
        y = bn.forward_(x, tape)
    assert y.data_ptr() == pointer
    assert torch.equal(y, y_ref)
    mean, invstd, n = tape.stats[bn]
    assert torch.equal(mean, ref._last_stats[0]) and torch.equal(invstd, ref._last_stats[1]) and n == 3 * h * w
    assert torch.equal(bn.running_mean, ref.running_mean) and torch.equal(bn.running_var, ref.running_var)


@pytest.mark.parametrize("budget", [0, 1, 1100])
def test_conv_forward_out_leaves_its_input_and_matches_forward(budget):
    """``forward_out`` writes each sum straight into a new tensor: the same values as the in-place forward, bit for
    bit, at any slice budget, and the input is left as it was."""
    conv = make_block("conv")
    x = sample()
    kept = x.clone()
    with torch.no_grad(), chunk_budget(budget):
        y = conv.forward_out(x, Tape())
        y_inplace = conv.forward_(x.clone(), Tape())
    assert torch.equal(x, kept)
    assert torch.equal(y, y_inplace) and y.is_contiguous()


@pytest.mark.parametrize("budget", [0, 1, 1100])
@pytest.mark.parametrize("kind", LAYERWISE)
def test_layerwise_backward_matches_autograd(kind, budget):
    block = make_block(kind)
    x = sample()
    params = params_of(block)
    # reference: plain autograd
    xx = x.clone().requires_grad_()
    y_ref = block(xx)
    gy = sample(y_ref.shape, seed=11)
    ref = torch.autograd.grad((y_ref * gy).sum(), [xx, *params])
    # engine face
    with torch.no_grad(), chunk_budget(budget):
        tape = Tape()
        y = block.forward_(x.clone(), tape)
        tape.replay = True
        buffers = [b.clone() for b in block.buffers()]
        grads = {}
        x_rec, gx = block.backward_(y.clone(), gy.clone(), tape, grads)
    for before, after in zip(buffers, block.buffers()):
        assert torch.equal(before, after), "backward_ touched a running statistic"
    if kind in POOLS:
        assert torch.equal(x_rec, x)
    else:
        torch.testing.assert_close(x_rec, x, rtol=0, atol=1e-10)
    torch.testing.assert_close(gx, ref[0], rtol=0, atol=1e-10)
    assert set(grads) == set(params)
    for p, g in zip(params, ref[1:]):
        torch.testing.assert_close(grads[p], g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("budget", [0, 1, 1100])
@pytest.mark.parametrize("kind", ["bn_train", "bn_eval", "leaky_0.2", "leaky_0.5", "conv", "chain"])
def test_restore_undoes_the_backward(kind, budget):
    """``restore_`` after ``backward_`` gives back the output and the output gradient (floor mode's way by
    restoring), and touches no parameter gradient; a chain (conv, BN, leaky ReLU, twice) undoes it layer by layer."""
    from edgerev.layers import InvSequential

    if kind == "chain":
        torch.manual_seed(0)
        block = randomize_(InvSequential(InvConv2d(8), InvBatchNorm2d(8), InvLeakyReLU(0.2),
                                         InvConv2d(8), InvBatchNorm2d(8), InvLeakyReLU(0.2)).double())
    else:
        block = make_block(kind)
    x, gy = sample(), sample(seed=11)
    with torch.no_grad(), chunk_budget(budget):
        tape = Tape()
        y = block.forward_(x.clone(), tape)
        tape.replay = True
        grads: dict = {}
        x_rec, gx = block.backward_(y.clone(), gy.clone(), tape, grads)
        kept = {p: g.clone() for p, g in grads.items()}
        y_back, gy_back = block.restore_(x_rec, gx.clone(), tape)
    assert not torch.allclose(gx, gy)  # the backward did change the gradient
    torch.testing.assert_close(y_back, y, rtol=0, atol=1e-10)
    torch.testing.assert_close(gy_back, gy, rtol=0, atol=1e-10)
    assert grads.keys() == kept.keys() and all(torch.equal(grads[p], kept[p]) for p in kept)


def test_a_layer_without_an_undo_says_so():
    block = make_block("channel_pool")
    with pytest.raises(NotImplementedError, match="cannot undo its gradient map"):
        block.restore_(sample(), sample(), Tape())


def test_layerwise_backward_accumulates_into_existing_grads():
    block = make_block("conv")
    x, gy = sample(), sample(seed=2)
    seed_grads = {p: torch.ones_like(p) for p in params_of(block)}
    fresh: dict = {}
    with torch.no_grad():
        for grads in (fresh, seed_grads):
            tape = Tape()
            y = block.forward_(x.clone(), tape)
            tape.replay = True
            block.backward_(y, gy.clone(), tape, grads)
    for p in params_of(block):
        torch.testing.assert_close(seed_grads[p], fresh[p] + 1, **TIGHT)


def test_generic_coupling_has_no_layerwise_backward():
    block = make_block("coupling")
    assert "invert" not in block.modes
    x = sample()
    tape = Tape()
    with torch.no_grad():
        y = block.forward_(x.clone(), tape)
    tape.replay = True
    with pytest.raises(NotImplementedError):
        block.backward_(y, torch.ones_like(y), tape, {})


def test_two_tapes_keep_their_own_statistics():
    """Statistics of a forward live on its tape: a second forward does not disturb the first backward."""
    block = make_block("hybrid")
    x1, x2 = sample(seed=1), sample(seed=2) * 2 + 1
    gy = sample(seed=3)
    xx = x1.clone().requires_grad_()
    ref = torch.autograd.grad((block(xx) * gy).sum(), [xx])[0]
    with torch.no_grad():
        t1, t2 = Tape(), Tape()
        y1 = block.forward_(x1.clone(), t1)
        block.forward_(x2.clone(), t2)
        t1.replay = True
        x_rec, gx = block.backward_(y1, gy.clone(), t1, {})
    torch.testing.assert_close(x_rec, x1, **TIGHT)
    torch.testing.assert_close(gx, ref, **TIGHT)


# ---- gradcheck ----------------------------------------------------------------------------------


def _gradcheck_case(kind: str):
    block = make_block(kind, channels=4, seed=5)
    x = sample((2, 4, 4, 4), seed=6).requires_grad_()
    return block, x


@pytest.mark.parametrize(
    "kind,mode", [(k, m) for k in BLOCKS for m in MODES if m in block_modes(k)]
)
def test_gradcheck_engine(kind, mode):
    block, x = _gradcheck_case(kind)
    seq = InvertibleSequence([block], modes=[mode], pool=None)
    params = params_of(seq)
    assert torch.autograd.gradcheck(engine_fn(seq), (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("kind", ["hybrid", "coupling"])
def test_gradcheck_engine_mean_pool(kind):
    block, x = _gradcheck_case(kind)
    seq = InvertibleSequence([block, make_block("batch_pool"), copy.deepcopy(block)], pool="mean")
    params = params_of(seq)
    assert torch.autograd.gradcheck(engine_fn(seq), (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("kind", BLOCKS)
def test_gradcheck_plain(kind):
    block, x = _gradcheck_case(kind)
    seq = InvertibleSequence([block], pool=None)
    params = params_of(seq)

    def fn(x, *ps):
        with plain(seq):
            return seq(x)

    assert torch.autograd.gradcheck(fn, (x, *params), eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_catches_a_wrong_gradient():
    """The gradcheck harness can fail: a block whose layer-wise backward drops a term is caught."""

    class Broken(InvLeakyReLU):
        def backward_(self, y, gy, tape, grads):
            x, g = super().backward_(y, gy, tape, grads)
            return x, g * 1.01

    seq = InvertibleSequence([Broken(0.5)], modes="invert", pool=None).double()
    x = sample((2, 4, 4, 4)).requires_grad_()
    assert not torch.autograd.gradcheck(engine_fn(seq), (x,), raise_exception=False)


def test_engine_graph_is_single_use():
    """The engine rebuilds activations in place, so its graph cannot be back-propagated twice
    (which is why the gradchecks above go through ``FreshEngine``); it says so clearly."""
    block, x = _gradcheck_case("hybrid")
    seq = InvertibleSequence([block], modes="invert", pool=None)
    with pytest.raises(RuntimeError, match="once"):
        torch.autograd.gradcheck(lambda x, *ps: seq(x), (x, *params_of(seq)))


# ---- bad input ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", POOLS)
@pytest.mark.parametrize("hw", [(5, 4), (4, 7), (3, 3)])
def test_pool_odd_size(kind, hw):
    block = make_block(kind)
    x = sample((2, 4, *hw))
    size = f"{hw[0]}x{hw[1]}"
    with pytest.raises(ShapeError, match=size):
        block(x)
    with pytest.raises(ShapeError, match=size):
        block.forward_(x.clone(), Tape())
    seq = InvertibleSequence([make_block("conv", 4), block], pool=None)
    with pytest.raises(ShapeError, match=size):
        seq(x.requires_grad_())


@pytest.mark.parametrize("kind", POOLS)
def test_pool_needs_4d(kind):
    with pytest.raises(ShapeError):
        make_block(kind)(torch.randn(4, 4, 4))


@pytest.mark.parametrize("channels", [1, 3, 5, 7])
def test_odd_channel_count_rejected(channels):
    with pytest.raises(ShapeError, match=str(channels)):
        InvConv2d(channels)
    with pytest.raises(ShapeError, match=str(channels)):
        Coupling(channels, nn.Identity(), nn.Identity())
    with pytest.raises(ShapeError, match=str(channels)):
        HybridBlock(channels)


def test_hybrid_needs_multiple_of_four():
    with pytest.raises(ShapeError, match="6"):
        HybridBlock(6)
    HybridBlock(4)


@pytest.mark.parametrize("kind", ["bn_train", "bn_eval", "conv", "coupling", "hybrid"])
def test_wrong_channel_count(kind):
    block = make_block(kind)
    x = sample((2, 6, 4, 4))
    with pytest.raises(ShapeError, match="8"):
        block(x)
    with pytest.raises(ShapeError, match="8"):
        block.forward_(x.clone(), Tape())
    with pytest.raises(ShapeError):
        InvertibleSequence([block], pool=None)(x.requires_grad_())
    with pytest.raises(ShapeError):
        block(sample((8, 4, 4)))


@pytest.mark.parametrize("slope", [0.0, -0.2, 1.5])
def test_bad_slope(slope):
    with pytest.raises(ValueError, match="slope"):
        InvLeakyReLU(slope)


def test_slope_one_is_identity():
    x = sample()
    assert torch.equal(InvLeakyReLU(1.0)(x), x)


def test_bad_hyperparameters():
    with pytest.raises(ValueError):
        InvBatchNorm2d(4, eps_i=0.0)
    with pytest.raises(ValueError):
        InvConv2d(4, kernel_size=2)


def test_bn_scale_is_bounded_away_from_zero():
    """The authors' scale ``|gamma| + eps_i``: bounded below by ``eps_i`` and continuous at ``gamma = 0``."""
    bn = InvBatchNorm2d(3, eps_i=0.1).double()
    with torch.no_grad():
        bn.weight.copy_(torch.tensor([0.0, -1e-9, 2.0]))
    torch.testing.assert_close(bn.scale(), torch.tensor([0.1, 0.1 + 1e-9, 2.1], dtype=torch.float64))
    x = sample((4, 3, 2, 2))
    torch.testing.assert_close(bn.inverse(bn(x)), x, **TIGHT)


@settings(max_examples=40, deadline=None)
@given(gamma=st.floats(-1e-3, 1e-3), delta=st.floats(-2e-3, 2e-3), seed=st.integers(0, 2**16))
def test_bn_output_is_continuous_in_gamma(gamma, delta, seed):
    """Moving ``gamma`` by ``delta`` moves the output by at most ``|delta| |xhat|``, across 0 too. A signed
    scale ``sign(gamma) (|gamma| + eps_i)`` jumped by ``2 eps_i`` there, where a zero initialization
    put every last scale: a first SGD step at lr 1e-5 flipped half of them and moved the loss 200x
    more than its gradient predicted."""
    bn = InvBatchNorm2d(4, eps_i=0.1).double()
    x = sample((6, 4, 3, 3), seed)
    with torch.no_grad():
        bn.weight.fill_(gamma)
        y0 = bn(x)
        bn.weight.fill_(gamma + delta)
        y1 = bn(x)
    xhat = torch.nn.functional.batch_norm(x, None, None, training=True, eps=bn.eps)
    assert float((y1 - y0).abs().max()) <= abs(delta) * float(xhat.abs().max()) * (1 + 1e-9) + 1e-15


# ---- running statistics -------------------------------------------------------------------------


def _bn_stack() -> InvertibleSequence:
    torch.manual_seed(0)
    seq = InvertibleSequence([
        InvBatchNorm2d(8), HybridBlock(8), Coupling(8, residual_fn(4), residual_fn(4)), InvConv2d(8),
        InvLeakyReLU(0.3), BatchPool(), InvBatchNorm2d(8),
    ], pool="mean")
    return randomize_(seq, 3).double()


def _stats(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in module.state_dict().items() if "running" in k or "num_batches" in k}


@pytest.mark.parametrize("modes", ["invert", "floor", "recompute", "store",
                                   ["store", "invert", "recompute", "invert", "store", "recompute", "invert"],
                                   ["invert", "floor", "store", "recompute", "store8", "store", "invert"],
                                   ["recompute", "store", "store", "recompute", "invert", "store", "recompute"],
                                   "store8", "store4",
                                   ["invert", "store8", "recompute", "store4", "invert", "store8", "recompute"],
                                   ["store4", "recompute", "store8", "invert", "store8", "store4", "invert"]])
def test_running_stats_updated_once_per_step(modes):
    seq = _bn_stack()
    seq.set_modes(modes)
    ref = copy.deepcopy(seq)
    initial = _stats(seq)
    x = sample((4, 8, 4, 4), seed=9) * 2 + 0.5
    with plain(ref):
        ref(x.clone().requires_grad_()).sum().backward()
    expected = _stats(ref)

    out = seq(x.clone().requires_grad_())
    assert type(out.grad_fn).__name__ == "_EngineBackward"
    after_forward = _stats(seq)
    out.sum().backward()
    after_backward = _stats(seq)

    assert len(expected) == 6 * 2 + 2 * 3  # 6 invertible BNs (4 in the hybrid block), 2 nn.BatchNorm2d
    for k, v in expected.items():
        if "num_batches" in k:
            assert v.item() == initial[k].item() + 1, k
        else:
            assert not torch.allclose(v, initial[k]), f"{k} was not updated by the reference step"
        torch.testing.assert_close(after_forward[k], v, rtol=1e-12, atol=1e-12, msg=k)
        assert torch.equal(after_backward[k], after_forward[k]), f"{k} changed during the backward"


@settings(max_examples=300, deadline=None)
@given(n=st.integers(0, 70), row=st.integers(1, 50), budget=st.integers(0, 4000),
       width=st.sampled_from([0.5, 1.0, 2.0]))
def test_batch_slices_are_as_few_as_the_budget_allows_and_even(n, row, budget, width):
    """The slices cover the batch in order; none holds more than the budget allows (one sample at least); there are as
    few as that allows (one for a budget of 0); and the largest is as small as that many slices can make it."""
    from edgerev.layers.base import batch_slices

    t = torch.empty(n, row, dtype=torch.uint8)
    per = max(1, int(row * width))
    most = n if budget <= 0 else max(1, budget // per)
    sizes = [s.stop - s.start for s in batch_slices(t, width, budget)]
    assert sum(sizes) == n and all(s > 0 for s in sizes)
    assert [s.start for s in batch_slices(t, width, budget)] == [sum(sizes[:i]) for i in range(len(sizes))]
    assert all(s <= most for s in sizes)
    assert len(sizes) == (0 if n == 0 else -(-n // most))
    assert not sizes or max(sizes) == -(-n // len(sizes))
