"""Per-layer approximate activations (store8/store4, after Chakrabarti & Moseley): gradients, masks, bytes, errors."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from edgerev import approximate
from edgerev.engine import InvertibleSequence, Mode, plain, supported_modes
from edgerev.errors import ModeError
from edgerev.layers import Coupling, HybridBlock, InvLeakyReLU
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.peak import apply_plan
from edgerev.memory.measure.tracker import MemoryTracker
from edgerev.models import create_model
from edgerev.quantize import quantize
from tests.helpers import randomize_, rel_err, residual_fn

SMALL = {
    "resnet18": dict(width=8),
    "revnet": dict(width=8),
    "revnext": dict(width=8, blocks=(1, 1, 1, 1, 1)),
}
#: the issue's targets (at init, batch 8, 32x32, default widths); here at width 8 and 16x16, where the
#: measured errors are about 0.005 (store8) and 0.09 (store4) on resnet18 and revnet
BOUNDS = {"store8": 0.03, "store4": 0.15}


def plain_and_engine(seq: InvertibleSequence, x: torch.Tensor, u: torch.Tensor,
                     params: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The gradient of ``(seq(x) * u).sum()`` by plain autograd, then through the engine: the input's,
    followed by the parameters' when ``params`` (flattened into one vector)."""
    out = []
    for reference in (True, False):
        xx = x.clone().requires_grad_()
        with plain(seq, enabled=reference):
            grads = torch.autograd.grad((seq(xx) * u).sum(), [xx, *(seq.parameters() if params else ())])
        out.append(torch.cat([g.flatten() for g in grads]))
    return out[0], out[1]


def param_grads(model: nn.Module, x: torch.Tensor, y: torch.Tensor, mode: str | None) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    if mode is not None:
        model.set_modes(mode)
    with plain(model, enabled=mode is None):
        F.cross_entropy(model(x), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


@pytest.mark.parametrize("arch", ["resnet18", "revnet", "revnext"])
@pytest.mark.parametrize("seed", [0, 1])
def test_gradient_error_is_within_the_targets(arch, seed):
    torch.manual_seed(seed)
    model = create_model(arch, **SMALL[arch])
    x, y = torch.randn(8, 3, 16, 16), torch.randint(0, 10, (8,))
    ref = param_grads(model, x, y, None)
    err = {m: rel_err(param_grads(model, x, y, m), ref) for m in BOUNDS}
    assert err["store8"] <= BOUNDS["store8"], err
    assert err["store4"] <= BOUNDS["store4"], err
    assert err["store8"] * 4 < err["store4"], err  # 16 times finer bins


def _chain() -> nn.Sequential:
    """Standard layers whose input gradients need weights, masks and indices only (no batch norm)."""
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1), nn.ReLU(), nn.Conv2d(6, 6, 3, padding=1), nn.LeakyReLU(0.1),
        nn.AvgPool2d(2), nn.MaxPool2d(2), nn.Flatten(), nn.Linear(6 * 4 * 4, 5), nn.ReLU(), nn.Linear(5, 3),
    )


@pytest.mark.parametrize("mode", ["store8", "store4"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_input_gradient_through_standard_layers_is_exact(mode, dtype):
    """The paper's point: from each layer's own copy, the gradient flowing back needs no activation value
    (ReLU and leaky-ReLU masks keep their signs, max pooling its indices); only weight gradients are approximate."""
    torch.manual_seed(0)
    seq = InvertibleSequence([_chain()], modes=[mode], pool=None).to(dtype)
    x = torch.randn(4, 3, 16, 16, dtype=dtype)
    u = torch.randn(4, 3, dtype=dtype)
    out = {}
    for reference in (True, False):
        xx = x.clone().requires_grad_()
        with plain(seq, enabled=reference):
            y = seq(xx)
            if not reference:
                assert type(y.grad_fn).__name__ == "_EngineBackward"
            grads = torch.autograd.grad((y * u).sum(), [xx, *seq.parameters()])
        out[reference] = (y.detach(), grads)
    assert torch.equal(out[True][0], out[False][0])  # the forward is exact
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(out[False][1][0], out[True][1][0], rtol=tol, atol=tol)
    weights = torch.cat([g.flatten() for g in out[False][1][1:]])
    exact = torch.cat([g.flatten() for g in out[True][1][1:]])
    assert 0 < rel_err(weights, exact) <= BOUNDS[mode]


def test_masks_are_exact_even_at_four_bits():
    """A ReLU output is half zeros: each zero comes back non-positive, each positive value positive."""
    seq = InvertibleSequence([nn.ReLU()], modes=["store4"], pool=None).double()
    x = torch.randn(3, 4, 5, 5, dtype=torch.float64)
    x[0, 0, 0, :] = 0.0
    u = torch.randn_like(x)
    grads = plain_and_engine(seq, x, u)
    assert torch.equal(grads[0], grads[1])


def _mixed(stage_before: nn.Module, before: str, stage: nn.Module, mode: str) -> InvertibleSequence:
    torch.manual_seed(0)
    seq = InvertibleSequence([stage_before, stage], modes=[before, mode], pool=None)
    return randomize_(seq, 1).double()


@pytest.mark.parametrize("mode", ["store8", "store4"])
@pytest.mark.parametrize("case", ["invertible_rebuilt", "plain_kept", "coupling_recompute"])
def test_a_stage_before_that_rebuilds_from_its_output_gets_it_exactly(case, mode):
    """An approximate stage after an ``invert``/``recompute`` stage hands back its exact input: an invertible
    one by inverting its exact output, any other by keeping it. Its own input gradient here is exact
    (leaky ReLU: signs only), so the whole gradient must equal plain autograd's."""
    if case == "invertible_rebuilt":
        seq = _mixed(HybridBlock(8), "invert", InvLeakyReLU(0.2), mode)
    elif case == "plain_kept":
        seq = _mixed(HybridBlock(8), "invert", nn.LeakyReLU(0.2), mode)
    else:
        seq = _mixed(Coupling(8, residual_fn(4), residual_fn(4)), "recompute", nn.ReLU(), mode)
    x = torch.randn(4, 8, 6, 6, dtype=torch.float64)
    u = torch.randn(4, 8, 6, 6, dtype=torch.float64)
    res = plain_and_engine(seq, x, u, params=True)
    torch.testing.assert_close(res[1], res[0], rtol=1e-9, atol=1e-11)


def _kept(seq: InvertibleSequence, x: torch.Tensor) -> int:
    with MemoryTracker() as tr:
        out = seq(x)
        kept = tr.current - out.untyped_storage().nbytes()
        out.sum().backward()
    return kept


def test_an_invertible_stage_keeps_no_float_copy_to_hand_back():
    x = torch.randn(4, 8, 6, 6, requires_grad=True)
    rebuilt = _kept(_mixed(HybridBlock(8), "invert", InvLeakyReLU(0.2), "store8").float(), x)
    kept = _kept(_mixed(HybridBlock(8), "invert", nn.LeakyReLU(0.2), "store8").float(), x)
    assert kept - rebuilt == x.numel() * 4  # the plain stage keeps its float32 input; the invertible one rebuilds it


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["resnet18", "revnet", "revnext"])
def test_the_copies_are_all_that_is_kept_and_the_prediction_is_exact(arch, monkeypatch):
    """Kept bytes are the codes plus their per-channel ranges, and fake tensors predict a whole step to the byte."""
    copies: list = []

    def spy(t, bits, rng=None, slice_bytes=None):
        copies.append(quantize(t, bits, rng, slice_bytes))
        return copies[-1]

    monkeypatch.setattr(approximate, "quantize", spy)
    torch.manual_seed(0)
    model = create_model(arch, **SMALL[arch])
    x = torch.randn(4, 3, 16, 16)
    kept = {}
    for mode in ("store8", "store4"):
        copies.clear()
        model.set_modes(mode)
        with MemoryTracker() as tr:
            out = model.body(x, samples=4)
            kept[mode] = tr.current
            out.sum().backward()
        model.zero_grad(set_to_none=True)
        codes = sum(q.codes.untyped_storage().nbytes() for q in copies)
        assert codes == sum(math.prod(q.shape) * q.bits // 8 for q in copies) + sum(
            math.prod(q.shape) % 2 for q in copies if q.bits == 4)
        ranges = sum(q.table.untyped_storage().nbytes() for q in copies)
        kept[mode + "_rest"] = kept[mode] - codes - ranges
    # what is not a copy (statistics, the last activation) does not depend on the precision
    assert kept["store8_rest"] == kept["store4_rest"] > 0
    for mode in ("store8", "store4"):
        predicted = account_step(model, StepShape(16), 4, lambda m, mode=mode: apply_plan(m, (mode,) * len(
            m.body.stages), None))
        measured = account_step(model, StepShape(16), 4, lambda m, mode=mode: apply_plan(m, (mode,) * len(
            m.body.stages), None), real=True)
        assert predicted.total == measured.total, mode


@pytest.mark.slow
def test_mixed_plans_are_predicted_to_the_byte():
    """Plans where approximate stages hand back their input (kept or rebuilt) are predicted exactly too."""
    for arch, pattern in (("revnext", ("invert", "store8", "store4")), ("revnet", ("recompute", "store4", "store8"))):
        torch.manual_seed(0)
        model = create_model(arch, **SMALL[arch])
        # the exact mode at every other stage that has it, the two approximate ones in turn elsewhere
        modes = [pattern[0] if i % 2 and Mode(pattern[0]) in supported_modes(stage) else pattern[1 + i // 2 % 2]
                 for i, stage in enumerate(model.stages)]
        assert len(set(modes)) == 3, modes
        plan = lambda m, modes=tuple(modes): apply_plan(m, modes, None)  # noqa: E731
        predicted = account_step(model, StepShape(16), 4, plan)
        measured = account_step(model, StepShape(16), 4, plan, real=True)
        assert predicted.total == measured.total, (arch, modes)


def test_batch_norm_gradient_error_stays_in_the_variance_term():
    """A conv-BN-ReLU chain: masks and weights exact, batch norm's input gradient approximate only through
    its variance term, so the input gradient is far closer than the 4-bit copies themselves."""
    torch.manual_seed(0)
    seq = InvertibleSequence([nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(),
                                            nn.Conv2d(8, 4, 3, padding=1))], modes=["store4"], pool=None).double()
    x = torch.randn(8, 3, 8, 8, dtype=torch.float64)
    u = torch.randn(8, 4, 8, 8, dtype=torch.float64)
    g = plain_and_engine(seq, x, u)
    assert rel_err(g[1], g[0]) < 0.03


def test_a_mode_a_stage_cannot_run_names_the_stage_and_the_choices():
    model = create_model("resnet18", **SMALL["resnet18"])
    modes = ["store8"] * len(model.stages)
    modes[3] = "invert"
    with pytest.raises(ModeError, match=r"stage 3 \(BasicBlock\) cannot run in invert mode; it supports store, "
                                        r"store8, store4"):
        model.set_modes(modes)
    modes[3] = "store2"
    with pytest.raises(ModeError, match=r"stage 3 \(BasicBlock\) cannot run in mode 'store2'; it supports store, "
                                        r"store8, store4"):
        model.set_modes(modes)


@pytest.mark.parametrize("mode", ["store8", "store4"])
def test_the_copies_are_made_in_the_slices_the_plan_gives_the_stage(mode):
    """A planned slice budget decides the quantizer's slices too, not the default: a plan that runs every stage
    whole-batch launches what the whole-batch default launches, and fewer kernels than the lean slices."""
    from edgerev.engine import Execution
    from edgerev.layers import chunk_budget
    from edgerev.memory.measure.profile import FlopCounter

    def kernels(slices: int | None, default: int) -> int:
        torch.manual_seed(0)
        model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1)).to("meta").train()
        model.body.set_modes(mode)
        if slices is not None:
            model.body.set_execution(Execution(slices=(slices,) * len(model.body.stages)))
        counter = FlopCounter()
        with chunk_budget(default), counter:
            x = torch.randn(16, 3, 64, 64, device="meta")
            F.cross_entropy(model(x), torch.zeros(16, dtype=torch.long, device="meta")).backward()
        return counter.kernels

    lean = 1024 * 1024
    whole = kernels(0, lean)
    assert whole == kernels(None, 0)
    assert whole < kernels(lean, 0) == kernels(None, lean)
