"""The model handle: every kind of source makes one through its own handler, and nothing after the resolver
probes a module for the attributes edgerev once stamped on it."""

from __future__ import annotations

import ast
import dataclasses
import json
from pathlib import Path

import pytest
import torch
from torch import nn

import edgerev
from edgerev.models.handle import Exporter, ModelHandle
from edgerev.models.names import SourceKind
from edgerev.models.resolve import HANDLERS, rebuild_error, resolve_model
from edgerev.train.config import SourceConfig
from edgerev.train.labeled import load_source
from edgerev.train.trainer import RunError
from tests.resolve_factories import TinyNet

ROOT = Path(__file__).resolve().parents[2]
TINY = "tests.resolve_factories:tiny"
#: what the resolver once stamped on a module, or what a consumer probed it for
STAMPED = {"arch", "model_args", "mean", "std", "onnx_source", "body", "head", "head_name", "check_input",
           "num_classes", "in_channels", "image_size", "io"}


def _probes(path: Path) -> list[str]:
    """``getattr(x, "name"...)`` and ``hasattr(x, "name")`` calls in ``path`` whose name is a stamped attribute."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2 and isinstance(node.args[1], ast.Constant) and node.args[1].value in STAMPED):
            found.append(f"{path.name}:{node.lineno}: {node.func.id}(..., {node.args[1].value!r})")
    return found


def test_no_module_of_edgerev_or_the_daemon_probes_a_model_for_stamped_attributes():
    files = sorted([*(ROOT / "edgerev").rglob("*.py"), *(ROOT / "daemon").rglob("*.py")])
    assert len(files) > 50  # the walk found the packages
    probes = [p for f in files for p in _probes(f)]
    assert probes == [], "\n".join(probes)


def test_the_probe_finder_finds_a_probe(tmp_path):
    """The check above can fail: a file with the probes the issue counted is caught, each one."""
    f = tmp_path / "sample.py"
    f.write_text('def f(model):\n    return hasattr(model, "body") or getattr(model, "arch", None)\n')
    assert [p.split(": ")[1] for p in _probes(f)] == ["hasattr(..., 'body')", "getattr(..., 'arch')"]


def test_every_kind_of_source_has_one_handler():
    assert set(HANDLERS) == set(SourceKind)


def test_each_kind_of_source_resolves_to_a_frozen_handle(tmp_path):
    registry = resolve_model("resnet18", args={"width": 8}, num_classes=3)
    factory = resolve_model(TINY, num_classes=4)
    module = resolve_model(TinyNet(classes=2))
    for h in (registry, factory, module):
        assert isinstance(h, ModelHandle) and h.exporter == Exporter.TRACED
        assert (h.input_name, h.output_name) == ("pixels", "logits") and h.onnx_source is None
        with pytest.raises(dataclasses.FrozenInstanceError):
            h.arch = "other"
    assert registry.engine is not None and factory.engine is None  # the planning surface: engine stages or a graph
    assert (registry.head, factory.head, module.head) == ("head", "classifier", "classifier")
    assert (registry.num_classes, factory.num_classes, module.num_classes) == (3, 4, 2)
    assert module.arch == "tests.resolve_factories:TinyNet" and module.mean is None
    assert not hasattr(module.module, "arch") and not hasattr(factory.module, "arch")  # nothing stamped


def test_the_head_the_handle_grows_is_what_it_counts():
    h = resolve_model("revnext", args={"width": 4}, num_classes=3)
    h.set_head_rows(5)
    assert h.num_classes == 5 and h.module.head.out_features == 5 and h.module.num_classes == 5
    assert resolve_model(h, num_classes=2) is h and h.num_classes == 2


def _onnx_file(path: Path) -> Path:
    """A small classifier as a user's server would write it (names of its own, a fixed 16x16 input)."""
    import warnings

    torch.manual_seed(3)
    model = TinyNet(classes=3).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 3, 16, 16),), str(path), input_names=["image"],
                          output_names=["scores"], dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}},
                          opset_version=17, dynamo=False)
    return path


def test_an_onnx_handle_keeps_the_files_names_and_bytes(tmp_path):
    pytest.importorskip("onnx")
    path = _onnx_file(tmp_path / "m.onnx")
    h = resolve_model(str(path))
    assert (h.arch, h.input_name, h.output_name, h.exporter) == ("onnx", "image", "scores", Exporter.IMPORTED)
    assert isinstance(h.onnx_source, bytes) and h.num_classes == 3 and h.engine is None


def test_plan_verify_takes_an_onnx_file(tmp_path, capsys, monkeypatch):
    """The issue's report: ``edgerev plan --arch model.onnx --verify`` failed on a probe for ``body``."""
    pytest.importorskip("onnx")
    from edgerev.cli import main

    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))
    path = _onnx_file(tmp_path / "m.onnx")
    budget = 64 * 2**20
    rc = main(["plan", "--arch", str(path), "--size", "16", "--budget", "64MiB", "--batch", "4", "--json",
               "--verify"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    d = json.loads(out)
    assert d["arch"] == str(path) and d["budget_bytes"] == budget
    assert d["predicted_peak_bytes"] <= budget and d["measured_peak_bytes"] <= budget
    assert d["samples_per_second"] > 0


def test_fit_refuses_a_module_its_run_directory_cannot_rebuild(tmp_path):
    """A class that needs arguments, from no package whose builders edgerev knows: a run of it could not be exported
    later, so fit refuses it before anything is written, in one line with the way out."""
    from tests.resolve_factories import NeedsLayers

    model = NeedsLayers([4, 8], classes=3)
    assert "layers" in rebuild_error(resolve_model(model))
    data = load_source(SourceConfig(kind="synthetic", samples=12, num_classes=3, seed=1), 16)
    with pytest.raises(RunError) as e:
        edgerev.fit(model, data, out=tmp_path / "run", size=16, epochs=1, batch=4)
    message = str(e.value)
    assert "\n" not in message and "NeedsLayers" in message and "missing 1 required positional argument" in message
    assert 'fit("torchvision.models:resnet18"' in message and "model_args" in message  # the ways out
    assert not (tmp_path / "run").exists()  # refused before anything was written


def _fit_and_export(model: torch.nn.Module, factory: str, args: dict, tmp_path: Path, size: int = 32,
                    normalization: tuple | None = None) -> None:
    """``fit`` a module object of a known package, then export its run directory with the owner's trust: the
    directory names ``factory`` (and ``normalization``, where the package gives one), is refused without that trust
    (naming it), and its ONNX file agrees with the module fit trained."""
    from edgerev.errors import TrustError
    from edgerev.export.onnx import export_onnx
    from edgerev.models.directory import read_info

    pytest.importorskip("onnxruntime")
    import numpy as np
    import onnxruntime as ort

    data = load_source(SourceConfig(kind="synthetic", samples=8, num_classes=3, seed=1), size)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    out = edgerev.fit(model, data, out=tmp_path / "run", size=size, epochs=1, batch=4, lr=0.01)
    info = read_info(out)[0]
    assert (info.arch, info.model_args) == (factory, args)
    if normalization is not None:
        assert (info.mean, info.std) == normalization
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # fit trained this module
    with pytest.raises(TrustError) as e:
        export_onnx(out, tmp_path / "m.onnx")
    assert "\n" not in str(e.value) and f"--trust-factory {factory}" in str(e.value)
    done = export_onnx(out, tmp_path / "m.onnx", trust_factories=[factory])
    session = ort.InferenceSession(str(done.path))
    assert ([i.name for i in session.get_inputs()], [o.name for o in session.get_outputs()]) == (["pixels"], ["logits"])
    x = torch.randn(2, 3, size, size)
    with torch.no_grad():
        expected = model.eval()(x).numpy()
    got = session.run(None, {"pixels": x.numpy()})[0]
    assert got.shape == (2, 3)
    np.testing.assert_allclose(got, expected, rtol=1e-3, atol=1e-3)


@pytest.mark.slow  # a ResNet-18 epoch at 32 px and its export: ~20 s CPU
def test_a_torchvision_module_given_to_fit_comes_back_as_a_run_that_exports(tmp_path):
    """torchvision's ResNet needs block and layers; its builder, found among torchvision's, rebuilds it."""
    torchvision = pytest.importorskip("torchvision")
    torch.manual_seed(0)
    _fit_and_export(torchvision.models.resnet18(num_classes=3), "torchvision.models:resnet18", {}, tmp_path)


def test_a_model_without_a_linear_head_keeps_the_logits_it_has():
    """SqueezeNet's classifier is a convolution: asked for the count it returns, nothing is refused (its builder took
    num_classes already), so its model directory rebuilds it; another count is refused in one line."""
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        handle = resolve_model(torchvision.models.squeezenet1_1(num_classes=10))
    assert handle.head is None and handle.num_classes == 10
    resolve_model(handle, num_classes=10)
    assert rebuild_error(handle) is None
    with pytest.raises(edgerev.EdgerevError, match="no linear layer whose rows could be its 4 classes"):
        resolve_model(handle, num_classes=4)


@pytest.mark.slow  # an epoch of timm's smallest LCNet and its export
def test_a_timm_module_given_to_fit_comes_back_as_a_run_that_exports(tmp_path):
    """timm's MobileNetV3 needs block_args; timm.create_model with the name the model carries rebuilds it. At 64 px:
    at 32 its last stage is 1x1, and the planner's capture runs batch norm in training mode on one example."""
    timm = pytest.importorskip("timm")
    torch.manual_seed(0)
    _fit_and_export(timm.create_model("lcnet_050", num_classes=3), "timm:create_model", {"model_name": "lcnet_050"},
                    tmp_path, size=64, normalization=(IMAGENET_MEAN, IMAGENET_STD))


IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # timm's pretrained_cfg of lcnet_050


def test_a_timm_module_carries_the_normalization_timm_pairs_with_it():
    """timm pairs each model with a configuration: its mean and std are the module's normalization, from a module
    object and from the factory alike, unless the owner declared their own; one for other channels is not taken."""
    timm = pytest.importorskip("timm")
    h = resolve_model(timm.create_model("lcnet_050", num_classes=3))
    assert (h.mean, h.std) == (IMAGENET_MEAN, IMAGENET_STD)
    built = resolve_model("timm:create_model", args={"model_name": "lcnet_050", "num_classes": 3})
    assert (built.mean, built.std) == (IMAGENET_MEAN, IMAGENET_STD)
    own = timm.create_model("lcnet_050", num_classes=3)
    own.mean, own.std = (0.5, 0.5, 0.5), (0.25, 0.25, 0.25)
    assert (resolve_model(own).mean, resolve_model(own).std) == ((0.5, 0.5, 0.5), (0.25, 0.25, 0.25))
    gray = resolve_model(timm.create_model("mobilenetv3_small_050", in_chans=1, num_classes=4))
    assert (gray.mean, gray.std) == (None, None)  # timm's three values are for colour images


def test_a_timm_module_of_other_input_channels_records_them():
    timm = pytest.importorskip("timm")
    h = resolve_model(timm.create_model("mobilenetv3_small_050", in_chans=1, num_classes=4))
    assert (h.arch, dict(h.args), h.in_channels) == ("timm:create_model",
                                                     {"model_name": "mobilenetv3_small_050", "in_chans": 1}, 1)
    assert rebuild_error(h) is None


def test_a_timm_module_built_for_another_image_size_records_it():
    """EfficientFormerV2's attention biases are sized by the image size it is built for, which the module does not
    keep: the size whose build has every weight's name and shape is recorded, and its directory rebuilds it."""
    timm = pytest.importorskip("timm")
    with torch.device("meta"):
        small = resolve_model(timm.create_model("efficientformerv2_s0", img_size=64, num_classes=4))
        default = resolve_model(timm.create_model("efficientformerv2_s0", num_classes=4))
    assert dict(small.args) == {"model_name": "efficientformerv2_s0", "img_size": 64}
    assert rebuild_error(small) is None
    assert dict(default.args) == {"model_name": "efficientformerv2_s0"}  # the default size: nothing to record


def test_a_torchvision_module_built_with_arguments_it_keeps_is_rebuilt_with_them():
    """GoogLeNet built without its auxiliary classifiers keeps ``aux_logits=False`` as an attribute: its builder is
    found with it, and its model directory rebuilds it; built with the defaults it records none."""
    torchvision = pytest.importorskip("torchvision")
    with torch.device("meta"):
        handle = resolve_model(torchvision.models.googlenet(num_classes=10, aux_logits=False, init_weights=True))
        default = resolve_model(torchvision.models.googlenet(num_classes=10, init_weights=True))
    assert (handle.arch, dict(handle.args)) == ("torchvision.models:googlenet", {"aux_logits": False})
    assert rebuild_error(handle) is None
    assert (default.arch, dict(default.args)) == ("torchvision.models:googlenet", {})


def test_kept_arguments_are_the_attributes_named_as_arguments_that_differ_from_their_defaults():
    from edgerev.models.builders import kept_arguments

    class Net(nn.Module):
        def __init__(self, width: int = 4, flag: bool = True, name: str = "a", scale: float = 1.0, layers=None,
                     ratio: float = 0.5, depth: int = 2) -> None:
            super().__init__()
            self.width, self.flag, self.name, self.scale, self.layers = width, flag, name, scale, layers
            self.ratio = int(ratio)  # another type than its default's: not the argument
            self.conv = nn.Conv2d(3, width, 1)

    assert kept_arguments(Net()) == {}
    assert kept_arguments(Net(width=8, flag=False, name="b", scale=2.0, layers=[1], ratio=3.0, depth=5)) == \
        {"width": 8, "flag": False, "name": "b", "scale": 2.0}


def test_a_torchvision_module_no_builder_makes_is_refused_in_one_line():
    """A ResNet of layers no registered builder uses: recorded by its class, and refused with the reason."""
    torchvision = pytest.importorskip("torchvision")
    from torchvision.models.resnet import BasicBlock, ResNet

    h = resolve_model(ResNet(BasicBlock, [1, 1, 1, 1], num_classes=3))
    assert h.arch == "torchvision.models.resnet:ResNet"
    why = rebuild_error(h)
    assert "\n" not in why and why.startswith("no torchvision builder makes a ResNet") and "resnet18" in why
    assert torchvision.models.resnet18  # the package was the module's own


def test_a_torchvision_module_two_builders_make_is_refused_in_one_line(monkeypatch):
    """Two registered builders that make the same weights' names and shapes: which one built it is unknown."""
    pytest.importorskip("torchvision")
    from torchvision.models import _api, resnet18

    from tests.resolve_factories import resnet18_twin

    monkeypatch.setitem(_api.BUILTIN_MODELS, "resnet18_twin", resnet18_twin)
    h = resolve_model(resnet18(num_classes=3))
    assert h.arch == "torchvision.models.resnet:ResNet"
    why = rebuild_error(h)
    assert "\n" not in why and why.startswith("torchvision builders resnet18, resnet18_twin all build this ResNet")


def test_an_owners_declared_arch_wins_over_the_builder_found():
    pytest.importorskip("torchvision")
    from torchvision.models import resnet18

    model = resnet18(num_classes=3)
    model.arch, model.model_args = "torchvision.models:resnet18", {"zero_init_residual": True}
    h = resolve_model(model)
    assert (h.arch, dict(h.args)) == ("torchvision.models:resnet18", {"zero_init_residual": True})


def test_a_module_whose_class_rebuilds_it_is_accepted():
    assert rebuild_error(resolve_model(TinyNet(classes=2))) is None
    assert rebuild_error(resolve_model(TINY, num_classes=4)) is None


@pytest.mark.slow  # a ResNet-18 step and its export: ~1 min CPU
def test_a_factory_named_for_the_same_model_trains_and_exports(tmp_path):
    """The way out the refusal names: the factory rebuilds what fit trained, and export --run loads it."""
    pytest.importorskip("torchvision")
    from edgerev.export.onnx import export_onnx

    data = load_source(SourceConfig(kind="synthetic", samples=8, num_classes=2, seed=1), 32)
    out = edgerev.fit("torchvision.models:resnet18", data, out=tmp_path / "run", size=32, epochs=1, batch=4,
                      trust_factories=["torchvision.models:resnet18"])
    done = export_onnx(out, tmp_path / "m.onnx", trust_factories=["torchvision.models:resnet18"])
    assert done.path.is_file() and done.max_abs_diff < 1e-3


def test_a_model_without_a_linear_layer_counts_its_classes_by_a_forward_without_data():
    """SqueezeNet's classifier is a 1x1 convolution: the width of its logits is read from a forward on the meta
    device (nothing computed, the module itself untouched); a model whose output is no ``[batch, classes]`` is
    refused in one line."""
    from edgerev.models.handle import SpecError, describe

    conv_head = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.Conv2d(8, 7, 1),
                                    torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    conv_head.train()
    handle = describe(conv_head)
    assert handle.head is None and handle.num_classes == 7 and handle.in_channels == 3
    assert conv_head.training and all(p.device.type == "cpu" for p in conv_head.parameters())
    maps = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3))
    with pytest.raises(SpecError, match=r"^Sequential has no linear layer to count its classes from, and returns a "
                                        r"tensor of shape \(2, 4, 222, 222\) for two images, not \[batch, classes\]$"):
        describe(maps)
    small = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Conv2d(4, 4, 3))
    with pytest.raises(SpecError, match=r"^Sequential has no linear layer to count its classes from, and its forward "
                                        r"at 4x4 failed \(RuntimeError: "):
        describe(small, image_size=4)
