"""Every registered model: default construction, training step, engine/plain agreement, input checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from edgerev.engine import Mode, plain, supported_modes
from edgerev.errors import ShapeError, UnknownModelError
from edgerev.models import create_model, list_models, register_model
from tests.helpers import MODES, cosine, exact_modes

KNOWN = {"irevnet", "layerwise", "resnet18", "revnet", "revnext"}
MODELS = list_models()


def model_modes(model) -> list[str]:
    """Every exact engine mode (invert, recompute, store) at least one stage of ``model`` supports."""
    return sorted({m for s in model.body.stages for m in exact_modes(s)})


@pytest.fixture(scope="module")
def images() -> torch.Tensor:
    return torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))


def build(name: str, seed: int = 0):
    torch.manual_seed(seed)
    return create_model(name)


def test_registry_lists_the_known_models():
    assert KNOWN <= set(MODELS)
    assert MODELS == sorted(MODELS)


@pytest.mark.parametrize("name", MODELS)
def test_training_step(name, images):
    model = build(name)
    model.train()
    target = torch.tensor([1, 7])
    out = model(images)
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()
    loss = F.cross_entropy(out, target)
    loss.backward()
    assert torch.isfinite(loss)
    for n, p in model.named_parameters():
        assert p.grad is not None, f"{n} got no gradient"
        assert p.grad.shape == p.shape
        assert torch.isfinite(p.grad).all(), f"{n} has a non-finite gradient"
    assert sum(p.grad.abs().sum().item() for p in model.parameters()) > 0


@pytest.mark.parametrize("name", MODELS)
def test_engine_output_equals_plain_in_every_mode(name, images):
    model = build(name)
    with torch.no_grad(), plain(model):
        ref = model(images)
    modes = model_modes(model)
    assert "store" in modes
    for mode in modes:
        model.body.set_modes(mode)
        for stage, m in zip(model.body.stages, model.body.modes):
            assert m is (Mode(mode) if Mode(mode) in supported_modes(stage) else supported_modes(stage)[0])
        features = model.body(images, samples=2)
        assert type(features.grad_fn).__name__ == "_EngineBackward", "the engine did not run"
        out = model(images)
        torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-5, msg=f"{name} in {mode} mode")
        out.sum().backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        model.zero_grad(set_to_none=True)


@pytest.mark.parametrize("name", MODELS)
def test_supported_modes(name):
    model = build(name)
    modes = model_modes(model)
    if name == "revnext":  # hybrid blocks: also floor
        assert modes == ["floor", "invert", "recompute", "store"]
    if name in ("layerwise", "irevnet"):
        assert modes == ["invert", "recompute", "store"]
    if name == "revnet":  # generic couplings: no layer-wise inverse
        assert modes == ["recompute", "store"]
    if name == "resnet18":
        assert modes == ["store"]
    assert model.body.modes[0] is Mode.STORE  # the stem convolution


@pytest.mark.parametrize("name", MODELS)
def test_eval_forward_without_grad(name, images):
    # float64: in float32 the convolutions' rounding, which differs between batch sizes, reaches 4e-5
    # of revnext's logits; a sample that depended on another would differ by far more
    model, images = build(name).double(), images.double()
    model(images).sum().backward()  # move the running statistics away from their initial values
    model.eval()
    with torch.no_grad():
        out = model(images)
        again = model(images[:1])
    assert out.shape == (2, 10)
    assert torch.isfinite(out).all()
    assert out.grad_fn is None
    torch.testing.assert_close(again, out[:1], rtol=1e-5, atol=1e-5)  # eval: samples are independent
    model.train()
    with torch.no_grad():
        train_out = model(images)
    assert not torch.allclose(train_out, out, atol=1e-4)  # eval really used the running statistics


@pytest.mark.parametrize("name", MODELS)
def test_bad_inputs(name):
    model = build(name)
    divisor = model.divisor
    odd = 32 - divisor // 2 if divisor > 1 else None
    with pytest.raises(ShapeError, match="30x30"):
        model(torch.randn(2, 3, 30, 30))
    if odd:
        with pytest.raises(ShapeError, match=str(divisor)):
            model(torch.randn(2, 3, 32, odd))
    with pytest.raises(ShapeError, match="channel"):
        model(torch.randn(2, 4, 32, 32))
    with pytest.raises(ShapeError, match="channel"):
        model(torch.randn(2, 1, 32, 32))
    with pytest.raises(ShapeError, match=r"\(3, 32, 32\)"):
        model(torch.randn(3, 32, 32))
    with pytest.raises(ShapeError, match=name):
        model(torch.randn(2, 3, 32))
    with torch.no_grad(), pytest.raises(ShapeError):
        model(torch.randn(2, 3, 30, 30))


def test_unknown_model():
    with pytest.raises(UnknownModelError) as info:
        create_model("resnet1000")
    message = str(info.value)
    assert "resnet1000" in message
    for name in MODELS:
        assert name in message
    assert isinstance(info.value, KeyError) and isinstance(info.value, ValueError)


def test_bad_model_arguments():
    with pytest.raises(UnknownModelError, match="revnext"):
        create_model("revnext", no_such_argument=1)


def test_register_twice():
    def revnet():  # same name as a registered model
        raise AssertionError("never built")

    with pytest.raises(ValueError, match="revnet"):
        register_model(revnet)


def test_revnext_large_input_inference():
    model = build("revnext").eval()
    with torch.no_grad():
        out = model(torch.randn(1, 3, 240, 240))
    assert out.shape == (1, 10)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", MODELS)
def test_parameter_count(name):
    model = build(name)
    n = sum(p.numel() for p in model.parameters())
    assert 1e6 <= n <= 5e6, f"{name}: {n} parameters"


@pytest.mark.parametrize("name", ["revnext", "layerwise"])
def test_batch_pooling_keeps_samples_apart(name, images):
    """Batch pooling moves sub-images to the batch axis; in eval mode each sample's logits depend
    only on that sample (the head undoes the pooling sample-major)."""
    model = build(name).eval()
    x = images.clone()
    with torch.no_grad():
        out = model(x)
        x[1] = torch.randn(3, 32, 32)
        out2 = model(x)
    torch.testing.assert_close(out2[0], out[0], rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out2[1], out[1])


# ---- CUDA ----------------------------------------------------------------------------------------

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@requires_cuda
def test_cuda_step_peak():
    from edgerev.memory.measure.peak import step_peak

    model = build("revnext").cuda()
    result = step_peak(model, 2, 32, device="cuda")
    assert result.peak_bytes > 0
    assert result.peak_bytes >= result.baseline_bytes
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    assert result.baseline_bytes >= weights


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("mode", MODES)
def test_cuda_gradients_match_cpu(mode):
    torch.manual_seed(0)
    cpu = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1)).double()
    gpu = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1)).double()
    gpu.load_state_dict(cpu.state_dict())
    gpu.cuda()
    for m in (cpu, gpu):
        m.body.set_modes(mode)
    x = torch.randn(4, 3, 32, 32, dtype=torch.float64)
    cpu(x).square().sum().backward()
    out = gpu(x.cuda())
    assert type(gpu.body(x.cuda(), samples=4).grad_fn).__name__ == "_EngineBackward"
    out.square().sum().backward()
    for (n, a), b in zip(cpu.named_parameters(), gpu.parameters()):
        torch.testing.assert_close(b.grad.cpu(), a.grad, rtol=1e-8, atol=1e-10, msg=n)
        assert cosine(b.grad.cpu(), a.grad) > 0.999999


@pytest.mark.parametrize("name, kwargs, message", [
    ("revnext", {"width": 6}, r"revnext: width must be a positive multiple of 4 .*got 6"),
    ("revnext", {"width": 0}, r"revnext: width must be a positive multiple of 4"),
    ("revnext", {"blocks": (2, 2)}, r"revnext: blocks must be 5 integers >= 1, one per level .*got \[2, 2\]"),
    ("revnext", {"blocks": (1, 0, 1, 1, 1)}, r"revnext: blocks must be 5 integers >= 1"),
    ("revnext", {"blocks": 3}, r"revnext: blocks must be 5 integers >= 1"),
    ("revnext", {"depth": 0}, r"revnext: depth must be an integer >= 1"),
    ("layerwise", {"layers": (1, 1, 1)}, r"layerwise: layers must be 5 integers >= 1"),
    ("layerwise", {"width": 10}, r"layerwise: width must be a positive multiple of 4"),
])
def test_a_shape_the_paper_cannot_build_is_one_clear_error(name, kwargs, message):
    from edgerev.errors import ArchitectureError

    with pytest.raises(ArchitectureError, match=message):
        create_model(name, **kwargs)


def test_revnext_is_built_as_the_paper_builds_it():
    from edgerev.layers import HybridBlock, InvBatchNorm2d, InvLeakyReLU
    from edgerev.models.head import ScaledLinear

    model = create_model("revnext", width=8, blocks=(1, 2, 1, 1, 1))
    stem = list(model.stages[:3])
    assert isinstance(stem[0], torch.nn.Conv2d) and isinstance(stem[1], InvBatchNorm2d)
    assert isinstance(stem[2], InvLeakyReLU)
    blocks = [s for s in model.stages if isinstance(s, HybridBlock)]
    assert [len(b.f.layers) // 3 for b in blocks] == [1, 2, 2, 2, 2, 2]  # one triple right after the stem
    assert all(float(m.weight.min()) == float(m.weight.max()) == 1.0 for m in model.modules()
               if isinstance(m, InvBatchNorm2d))
    assert isinstance(model.head, ScaledLinear) and model.head.bias is None and model.head.scale == 0.125
    assert model.body.pool == "max"
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    model = model.double().eval()
    with torch.no_grad():
        feats = model.body(x, samples=2)
    torch.testing.assert_close(model(x), 0.125 * feats @ model.head.weight.T)


def test_grown_head_keeps_its_kind():
    from edgerev.models.head import ScaledLinear
    from edgerev.train.continual import grow_head

    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=2)
    old = model.head.weight.detach().clone()
    grow_head(model, ("a", "b"), ("a", "b", "c"))
    assert isinstance(model.head, ScaledLinear) and model.head.bias is None and model.head.scale == 0.125
    assert torch.equal(model.head.weight[:2], old) and model.head.out_features == 3


def test_the_light_names_are_the_registry():
    """edgerev.models.names (what configs check model.arch against, without torch) lists the registry."""
    from edgerev.models.names import ARCHS

    assert ARCHS == tuple(list_models())
