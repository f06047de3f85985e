"""The one resolver: every kind of model source, its weights, and bad input in one line (nothing written)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from edgerev.config import ConfigError, from_dict
from edgerev.errors import EdgerevError, TrustError, UnknownModelError
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.models import list_models
from edgerev.models.directory import ModelInfo, load_model, save_model, save_tensors
from edgerev.models.names import ARCHS, SourceKind, source_kind
from edgerev.models.resolve import ModelSourceError, load_weights, resolve_model
from edgerev.models.spec import SpecError, check_size, model_spec
from edgerev.train.config import RunConfig
from tests.resolve_factories import TinyNet

TINY = "tests.resolve_factories:tiny"


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


@pytest.mark.parametrize("arch, kind", [
    ("revnext", SourceKind.REGISTRY), ("pkg.mod:make", SourceKind.FACTORY), ("a:B.create", SourceKind.FACTORY),
    ("model.onnx", SourceKind.ONNX), ("dir/Model.ONNX", SourceKind.ONNX), ("./run1", SourceKind.DIRECTORY),
    ("/abs/run", SourceKind.DIRECTORY), ("~/run", SourceKind.DIRECTORY),
])
def test_source_kind_from_the_spelling(arch, kind):
    assert source_kind(arch) is kind


@pytest.mark.parametrize("arch", ["vgg", "pkg.mod:", ":make", "pkg mod:make", ""])
def test_a_name_of_no_kind_is_refused_listing_the_kinds(arch):
    with pytest.raises(UnknownModelError) as e:
        source_kind(arch)
    assert "registry name" in one_line(e.value) and "package.module:callable" in str(e.value)


def test_registry_names_are_the_registry():
    assert ARCHS == tuple(list_models())


def test_registry_name_builds_with_the_classes_asked():
    model = resolve_model("resnet18", args={"width": 8}, num_classes=3)
    spec = model_spec(model)
    assert (spec.in_channels, spec.num_classes, model.arch, model.args) == (3, 3, "resnet18", {"width": 8})


def test_factory_that_takes_num_classes_is_built_with_it():
    model = resolve_model("tests.resolve_factories:tiny_with_classes", args={"width": 6}, num_classes=4)
    assert model.module.classifier.out_features == 4 and model.module.classifier.in_features == 6
    assert model.arch == "tests.resolve_factories:tiny_with_classes" and model.args == {"width": 6}


def test_factory_without_num_classes_gets_its_classifier_resized():
    model = resolve_model(TINY, num_classes=9)
    assert isinstance(model.module, TinyNet) and model.module.classifier.out_features == 9
    assert model_spec(model) == model_spec(model)  # frozen and comparable
    spec = model_spec(model)
    assert (spec.in_channels, spec.num_classes, spec.head, spec.image_size) == (3, 9, "classifier", None)


def test_spec_reads_attributes_first():
    model = TinyNet()
    model.in_channels, model.num_classes, model.image_size = 3, 5, 32
    model.mean, model.std = (0.4, 0.4, 0.4), (0.2, 0.2, 0.2)
    spec = model_spec(resolve_model(model))  # what the owner declares on a module is read where it is resolved
    assert spec.image_size == 32 and spec.mean == (0.4, 0.4, 0.4) and spec.std == (0.2, 0.2, 0.2)


def test_spec_of_a_model_without_layers_is_one_line():
    with pytest.raises(SpecError, match="no convolution or linear layer"):
        model_spec(nn.Sequential(nn.ReLU()))


def test_check_size_runs_one_forward_for_a_model_from_outside():
    model = TinyNet()
    check_size(model, 16)
    fixed = nn.Sequential(nn.Conv2d(3, 2, 3), nn.Flatten(), nn.Linear(2 * 14 * 14, 4))
    check_size(fixed, 16)
    with pytest.raises(SpecError) as e:
        check_size(fixed, 32)
    assert "cannot take 32x32" in one_line(e.value)


@pytest.mark.parametrize("fmt", ["safetensors", "state_dict", "checkpoint"])
def test_weights_load_from_safetensors_or_a_state_dict(tmp_path, fmt):
    torch.manual_seed(1)
    trained = TinyNet(classes=5)
    path = tmp_path / f"w.{'safetensors' if fmt == 'safetensors' else 'pt'}"
    if fmt == "safetensors":
        save_tensors(path, trained.state_dict())
    else:
        torch.save(trained.state_dict() if fmt == "state_dict" else {"state_dict": trained.state_dict(), "epoch": 3},
                   path)
    model = resolve_model(TINY, weights=path)
    for k, v in trained.state_dict().items():
        assert torch.equal(model.module.state_dict()[k], v), k


def test_safetensors_is_told_by_its_content_not_its_name(tmp_path):
    path = tmp_path / "weights.bin"
    save_tensors(path, TinyNet().state_dict())
    assert set(load_weights(path)) == set(TinyNet().state_dict())


def test_pretrained_weights_keep_their_classifier_then_it_is_remade_for_the_classes(tmp_path):
    torch.manual_seed(2)
    pretrained = TinyNet(classes=5)
    torch.save(pretrained.state_dict(), tmp_path / "w.pt")
    model = resolve_model(TINY, weights=tmp_path / "w.pt", num_classes=3)
    assert model.module.classifier.out_features == 3
    assert torch.equal(model.module.features[0].weight, pretrained.features[0].weight)  # the backbone is the file's


def test_weights_of_a_registry_model(tmp_path):
    torch.manual_seed(3)
    src = resolve_model("resnet18", args={"width": 8}, num_classes=4)
    save_tensors(tmp_path / "r.safetensors", src.module.state_dict())
    model = resolve_model("resnet18", args={"width": 8}, weights=tmp_path / "r.safetensors", num_classes=6)
    assert model_spec(model).num_classes == 6 and model.num_classes == 6 and model.module.num_classes == 6
    assert all(torch.equal(model.module.state_dict()[k], v) for k, v in src.module.state_dict().items()
               if "head" not in k)


def test_weights_whose_names_do_not_match_name_the_first_few(tmp_path):
    state = {f"layer{i}.weight": torch.zeros(2) for i in range(6)}
    torch.save(state, tmp_path / "w.pt")
    with pytest.raises(EdgerevError) as e:
        resolve_model(TINY, weights=tmp_path / "w.pt")
    text = one_line(e.value)
    assert "missing" in text and "unexpected layer0.weight, layer1.weight, layer2.weight" in text
    assert "layer3" not in text


def test_weights_whose_shapes_do_not_match_say_both_shapes(tmp_path):
    torch.save(TinyNet(width=8).state_dict(), tmp_path / "w.pt")
    with pytest.raises(EdgerevError) as e:
        resolve_model(TINY, weights=tmp_path / "w.pt")
    assert "features.0.weight (8x3x3x3 in the file, 4x3x3x3 in the model)" in one_line(e.value)


@pytest.mark.parametrize("content, expected", [
    (None, "does not exist"),
    (b"not weights at all", "neither safetensors nor a state_dict"),
    ("truncated", "neither safetensors nor a state_dict"),
    ("tensor", "not a state_dict"),
    ("code", "neither safetensors nor a state_dict"),
])
def test_bad_weights_files_are_one_line(tmp_path, content, expected):
    path = tmp_path / "w.pt"
    if content == "truncated":
        torch.save(TinyNet().state_dict(), path)
        path.write_bytes(path.read_bytes()[:100])
    elif content == "tensor":
        torch.save(torch.zeros(3), path)
    elif content == "code":  # a pickle that would run code: weights_only refuses it
        torch.save({"w": TinyNet()}, path)
    elif content is not None:
        path.write_bytes(content)
    with pytest.raises(ModelSourceError) as e:
        resolve_model(TINY, weights=path)
    assert expected in one_line(e.value)


def test_a_broken_safetensors_file_is_one_line(tmp_path):
    path = tmp_path / "w.safetensors"
    save_tensors(path, TinyNet().state_dict())
    path.write_bytes(path.read_bytes()[:-40])
    with pytest.raises(ModelSourceError, match="not a valid safetensors file") as e:
        resolve_model(TINY, weights=path)
    one_line(e.value)


@pytest.mark.parametrize("source, expected", [
    ("tests.no_such_module:make", "cannot import tests.no_such_module (ModuleNotFoundError"),
    ("tests.resolve_factories:missing", "tests.resolve_factories has no missing"),
    ("tests.resolve_factories:NOT_CALLABLE", "is a int, not a callable"),
    ("tests.resolve_factories:raises", "raised RuntimeError: no weights on this machine"),
    ("tests.resolve_factories:not_a_module", "returned a list, not a torch.nn.Module"),
])
def test_bad_factories_are_one_line(source, expected):
    with pytest.raises(ModelSourceError) as e:
        resolve_model(source)
    assert expected in one_line(e.value)


def test_a_factory_given_arguments_it_does_not_take_is_one_line():
    with pytest.raises(ModelSourceError, match="raised TypeError") as e:
        resolve_model(TINY, args={"depth": 3})
    one_line(e.value)


def test_model_directory_round_trip_through_the_resolver(tmp_path):
    """A factory model saved as a model directory rebuilds by its factory name, weights and all, when the
    caller allows that factory (the file alone names no code to run)."""
    model = resolve_model(TINY, args={"width": 6}, num_classes=3)
    info = ModelInfo(model.arch, ("a", "b", "c"), 16, model_args=dict(model.args))
    save_model(tmp_path / "run", model, info)
    with pytest.raises(TrustError, match="model.json: arch: 'tests.resolve_factories:tiny' is a factory"):
        load_model(tmp_path / "run")
    back, info2, _ = load_model(tmp_path / "run", trust_factories=[TINY])
    assert info2.arch == TINY and info2.model_args == {"width": 6}
    assert all(torch.equal(back.state_dict()[k], v) for k, v in model.module.state_dict().items())
    again = resolve_model(str(tmp_path / "run"), num_classes=5, trust_factories=[TINY])  # a fresh classifier
    assert model_spec(again).num_classes == 5 and again.arch == TINY
    assert torch.equal(again.module.features[0].weight, model.module.features[0].weight)


def test_a_path_that_is_no_model_directory_is_one_line(tmp_path):
    with pytest.raises(ModelSourceError, match="not a model directory") as e:
        resolve_model(str(tmp_path))
    one_line(e.value)
    with pytest.raises(ModelSourceError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.onnx"))


def test_a_module_object_is_used_as_it_is():
    net = TinyNet()
    handle = resolve_model(net)
    assert handle.module is net
    assert handle.arch == "tests.resolve_factories:TinyNet" and handle.args == {}
    assert resolve_model(net, num_classes=2).module is net and net.classifier.out_features == 2


@pytest.mark.parametrize("model, expected", [
    ({"arch": "vgg"}, "model.arch: unknown architecture 'vgg'"),
    ({"arch": "runs/one", "args": {"width": 4}}, "model.args: runs/one carries its own architecture"),
    ({"arch": "m.onnx", "weights": "w.pt"}, "model.weights: m.onnx carries its own weights"),
])
def test_recipe_refuses_in_one_line_naming_the_key(model, expected):
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, {"model": model})
    assert one_line(e.value).startswith(expected)


@pytest.mark.parametrize("arch", ["revnext", TINY, "./runs/one", "m.onnx"])
def test_recipe_accepts_every_kind_of_source(arch):
    assert from_dict(RunConfig, {"model": {"arch": arch}}).model.arch == arch


def test_the_step_accounting_takes_a_model_from_outside():
    """The issue's report: accounting read model.in_channels and model.num_classes, which only edgerev's models have."""
    model = resolve_model(TINY, num_classes=4)
    a = account_step(model.module, StepShape(16, 4, momentum=True), 2, lambda m: None, real=True)
    assert a.total > a.baseline > 0 and a.batch_input == 4 * 3 * 16 * 16 * 4


def _onnx_of(model: nn.Module, path) -> None:
    """A model exported as a user's server would (the TorchScript exporter in eval mode: batch norm folded)."""
    import warnings

    model.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (torch.zeros(1, 3, 16, 16),), str(path), input_names=["image"],
                          output_names=["scores"], dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}},
                          opset_version=17, dynamo=False)


def test_an_onnx_file_resolves_trains_and_rebuilds_from_its_model_directory(tmp_path):
    pytest.importorskip("onnx")
    import edgerev

    torch.manual_seed(4)
    original = TinyNet(classes=5)
    _onnx_of(original, tmp_path / "m.onnx")
    model = resolve_model(str(tmp_path / "m.onnx"))
    spec = model_spec(model)
    assert (model.arch, spec.in_channels, spec.num_classes) == ("onnx", 3, 5)
    x = torch.randn(2, 3, 16, 16)
    assert torch.allclose(model.module.eval()(x), original(x), atol=1e-5)
    grown = resolve_model(str(tmp_path / "m.onnx"), num_classes=3)
    assert model_spec(grown).num_classes == 3 and grown.module(x).shape == (2, 3)

    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    data = load_source(SourceConfig(kind="synthetic", samples=24, num_classes=3, seed=2), 16)
    out = edgerev.fit(str(tmp_path / "m.onnx"), data, out=tmp_path / "run", size=16, epochs=1, batch=8)
    assert (out / "source.onnx").read_bytes() == model.onnx_source  # the directory rebuilds without the file
    (tmp_path / "m.onnx").unlink()
    back, info, _ = load_model(out)
    assert info.arch == "onnx" and model_spec(back).num_classes == 3


def test_a_teachers_logits_are_counted_for_a_model_from_outside():
    """The distillation teacher's logits: its classes come from model_spec (no num_classes attribute here)."""
    from edgerev.train.memory import step_shape

    teacher = resolve_model(TINY, num_classes=6)
    assert not hasattr(teacher.module, "num_classes")
    assert step_shape(RunConfig(), teacher.module, teacher.module, 4).teacher_classes == 6


def test_a_model_that_flattens_its_images_needs_its_size_to_count_channels():
    """A first linear layer reads channels x height x width: its input features are not the image's channels."""
    mlp = nn.Sequential(nn.Flatten(), nn.Linear(3 * 8 * 8, 16), nn.ReLU(), nn.Linear(16, 4))
    with pytest.raises(SpecError, match="flattens its images into a linear layer of 192 features"):
        model_spec(mlp)
    mlp.image_size = 8
    assert (model_spec(resolve_model(mlp)).in_channels, model_spec(resolve_model(mlp)).num_classes) == (3, 4)
