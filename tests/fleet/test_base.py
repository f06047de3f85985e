"""A fleet that starts from a base model: the server's first parameters and every device's first round are the
base's weights (edgerev.fleet.model.fleet_model), its classifier sized to the fleet's classes."""

import pytest
import torch
import yaml
from safetensors.torch import save_file
from torch import nn

pytest.importorskip("flwr")

from edgerev.config import ConfigError  # noqa: E402
from edgerev.fleet.model import FleetError, FleetModel, check_shared, device_model, fleet_model, model_names  # noqa: E402
from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from edgerev.models.directory import load_model  # noqa: E402
from edgerev_daemon.learning.fleet import write_model  # noqa: E402
from tests.fleet.devices import CLASSES, FakeDevice, run_fleet  # noqa: E402

FACTORY = "tests.fleet.test_base:headed"
FLEET = ("class0", "class1", "class2")  # the classes of devices.CLASSES, in the registry's order


class Headed(nn.Module):
    """A model from outside the registry whose classifier is named ``head`` (as the fleet's aggregation wants)."""

    def __init__(self, num_classes: int = 3, width: int = 4) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.BatchNorm2d(width), nn.ReLU(),
                                      nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def headed(num_classes: int = 3, width: int = 4) -> nn.Module:
    return Headed(num_classes, width)


def pooled(num_classes: int = 3) -> nn.Module:
    """A classifier with no linear layer (a 1x1 convolution to the classes, pooled)."""
    net = nn.Sequential(nn.Conv2d(3, num_classes, 1), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    net.num_classes = num_classes
    return net


@pytest.fixture
def base(tmp_path):
    """A trained-looking base (weights and batch-norm statistics no seed draws) saved as safetensors."""
    torch.manual_seed(1234)
    model = Headed(len(FLEET))
    with torch.no_grad():
        for t in model.state_dict().values():
            if t.is_floating_point():
                t.add_(torch.rand_like(t) + 0.5)
    path = tmp_path / "base.safetensors"
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path, {k: v.clone() for k, v in model.state_dict().items()}


def _settings(weights, **kw) -> FleetSettings:
    return FleetSettings(rounds=1, arch=FACTORY, weights=str(weights), image_size=16, **kw)


def test_the_servers_first_parameters_and_a_devices_first_round_are_the_bases(base, tmp_path, identity):
    path, want = base
    settings = _settings(path)
    first = {k: torch.from_numpy(v.numpy().copy()) for k, v in initial_arrays(settings, FLEET).items()}
    params = {n for n, _ in Headed().named_parameters()}
    assert set(first) == params  # sharing "all": every trainable tensor travels; statistics stay (FedBN)
    for name in params:
        assert torch.equal(first[name], want[name]), name

    received = []

    class Recording(FakeDevice):
        def train_round(self, fm):
            received.append(fm)
            return super().train_round(fm)

    run_fleet(settings, devices={n: Recording(c) for n, c in CLASSES.items()})
    assert len(received) == 2
    for fm in received:  # the device's round model: what came, composed with its own fresh copy of the base
        assert fm.weights == str(path) and fm.classes == FLEET
        write_model(tmp_path / "round", fm, device_model(fm, check_shared(fm), None))
        model, info, _ = load_model(tmp_path / "round", trust_factories=[FACTORY])  # the fleet's, allowed here
        assert info.arch == FACTORY and info.classes == FLEET
        for name, t in model.state_dict().items():  # the batch-norm statistics too: the base's, not fresh
            assert torch.equal(t, want[name]), name


def test_a_base_with_other_classes_keeps_its_body_and_every_device_draws_the_same_head(base):
    path, want = base
    fm = FleetModel("1/1", FACTORY, {}, 16, ("a", "b", "c", "d", "e"), {}, weights=str(path), seed=7)
    one, two = fleet_model(fm).module.state_dict(), fleet_model(fm).module.state_dict()
    assert one["head.weight"].shape == (5, 4)
    for name in want:
        if name.startswith("head."):
            assert torch.equal(one[name], two[name])
        else:
            assert torch.equal(one[name], want[name]), name


def test_without_weights_the_fleet_starts_from_its_seed():
    one = fleet_model(FleetModel("1/1", FACTORY, {"width": 2}, 16, FLEET, {}, seed=3)).module.state_dict()
    two = fleet_model(FleetModel("1/1", FACTORY, {"width": 2}, 16, FLEET, {}, seed=3)).module.state_dict()
    assert one["features.0.weight"].shape == (2, 3, 3, 3)
    assert all(torch.equal(one[k], two[k]) for k in one)


class Fc(Headed):
    """A base whose classifier is named as torchvision names a ResNet's (``fc``), not ``head``."""

    def __init__(self, num_classes: int = 3, width: int = 4) -> None:
        super().__init__(num_classes, width)
        self.fc = self.head
        del self.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def fc(num_classes: int = 3, width: int = 4) -> nn.Module:
    return Fc(num_classes, width)


def test_a_classifier_of_any_name_travels_as_the_fleets_head(tmp_path):
    """The aggregation averages ``head.*`` per class: a base's classifier travels under that name whatever the
    model calls it, and comes back into the model under its own."""
    torch.manual_seed(99)
    base = Fc(len(FLEET))
    path = tmp_path / "fc.safetensors"
    save_file({k: v.contiguous() for k, v in base.state_dict().items()}, str(path))
    fm = FleetModel("1/1", "tests.fleet.test_base:fc", {}, 16, FLEET, {}, sharing="all", weights=str(path))
    state, names = model_names(fm)
    assert {"head.weight", "head.bias"} <= set(names) and not any(n.startswith("fc.") for n in state)
    assert torch.equal(state["head.weight"], base.fc.weight)
    moved = {n: state[n] + 1 for n in names}  # what a round brings back
    model = device_model(FleetModel("1/2", fm.arch, {}, 16, FLEET, moved, sharing="all", weights=str(path)),
                         state, None).module
    assert torch.equal(model.fc.weight, base.fc.weight + 1) and torch.equal(model.features[0].bias,
                                                                             base.features[0].bias + 1)


def test_a_base_the_fleet_cannot_average_or_build_is_refused_in_one_line(base, tmp_path):
    with pytest.raises(FleetError, match="has no linear classifier"):
        fleet_model(FleetModel("1/1", "tests.fleet.test_base:pooled", {}, 16, FLEET, {}))
    with pytest.raises(FleetError, match="does not exist"):
        fleet_model(FleetModel("1/1", FACTORY, {}, 16, FLEET, {}, weights=str(tmp_path / "missing.safetensors")))
    wrong = tmp_path / "wrong.safetensors"
    save_file({"features.0.weight": torch.zeros(1)}, str(wrong))
    with pytest.raises(FleetError, match="features.0.weight"):
        fleet_model(FleetModel("1/1", FACTORY, {}, 16, FLEET, {}, weights=str(wrong)))


def test_the_settings_take_any_model_source_and_read_the_weights_back(base):
    path, _ = base
    settings = _settings(path, sharing="head")
    assert FleetSettings.from_run_config(settings.to_run_config()) == settings
    with pytest.raises(ConfigError, match="weights: .*carries its own weights"):
        FleetSettings(arch="base.onnx", weights=str(path))
    with pytest.raises(ConfigError, match="model-args: .*carries its own architecture"):
        FleetSettings.from_run_config({"arch": "./run1", "model-args": '{"width": 8}'})
    with pytest.raises(ConfigError, match="arch: unknown architecture"):
        FleetSettings(arch="no-such-model")


def test_a_device_daemon_trains_its_first_round_from_the_base(base, tmp_path):
    from edgerev_daemon.config import load_config
    from edgerev_daemon.learning.fleet import train_round
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.demo import write_images

    path, want = base
    config_path = tmp_path / "daemon.yaml"
    config_path.write_text(yaml.safe_dump({
        "data_dir": str(tmp_path / "dev"), "image_size": 16, "heldout_fraction": 0.25,
        "ingest": {"settle_seconds": 0}, "schedule": {"min_new_samples": 100000}, "storage": {"min_free_space": 0},
        "training": {"model": {"arch": FACTORY, "weights": str(path)}, "train": {"batch": 8, "epochs": 1},
                     "min_samples_per_label": 1}}))
    config = load_config(config_path)
    write_images(config.inbox_path, 24, [0, 1, 2], size=16)
    settings = _settings(path, lr=1e-3)
    shared = {k: torch.from_numpy(v.numpy().copy()) for k, v in initial_arrays(settings, FLEET).items()}
    fm = FleetModel("9/1", FACTORY, {}, 16, FLEET, shared, weights=str(path), lr=1e-3)
    with Daemon(config, config_path=config_path) as daemon:
        daemon.cycle(0.0)  # ingest only
        result = train_round(daemon, fm)
    assert result.examples > 0 and set(result.shared) == set(shared)
    moved = [n for n in shared if not torch.equal(result.shared[n], want[n])]
    assert moved  # it trained; and from the base: one small step from it, far from any fresh draw
    fresh = Headed().state_dict()
    for name in shared:
        assert (result.shared[name] - want[name]).abs().max() < (fresh[name] - want[name]).abs().max(), name


SIMULATION = """\
fleet: {{rounds: 1, sharing: all, local_epochs: 1, arch: "{arch}", weights: "{weights}", image_size: 16,
        min_devices: 2}}
data: {{num_classes: 3, per_class: 12, test_per_class: 4}}
local_epochs: 1
devices:
  - {{name: d1, classes: [0, 1]}}
  - {{name: d2, classes: [1, 2]}}
daemon:
  training:
    train: {{batch: 8}}
    min_samples_per_label: 1
  promotion: {{min_heldout_per_class: 1}}
  storage: {{min_free_space: 0}}
"""


@pytest.mark.slow
def test_a_simulated_fleet_starts_from_the_base(base, tmp_path, capsys, identity):
    import json

    from edgerev.cli import main

    path, _ = base
    preset = tmp_path / "fleet.yaml"
    preset.write_text(SIMULATION.format(arch=FACTORY, weights=path))
    assert main(["fleet", "simulate", "--config", str(preset), "--out", str(tmp_path / "run"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rounds"] == 1 and [d["name"] for d in report["devices"]] == ["d1", "d2"]
    for d in report["devices"]:
        assert 0.0 <= d["accuracy_federated"] <= 1.0 and d["per_round"][0]["round"] == 1


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as a user's file was written
def test_an_onnx_base_shares_its_last_gemm_as_the_head(tmp_path):
    """An ONNX file as the fleet's base: its classifier (the import's last Gemm) travels as head.*, a round's
    update comes back into it, and the device's model directory rebuilds from the file's copy."""
    from edgerev.models.designs import mobilenet_v2

    torch.manual_seed(0)
    net = mobilenet_v2(num_classes=3, width=0.25).eval()
    path = tmp_path / "base.onnx"
    torch.onnx.export(net, (torch.zeros(1, 3, 16, 16),), str(path), dynamo=False, input_names=["image"],
                      output_names=["scores"], dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})
    fm = FleetModel("1/1", str(path), {}, 16, FLEET, {}, sharing="head")
    state, names = model_names(fm)
    assert names == ["head.weight", "head.bias"]
    assert torch.allclose(state["head.weight"], net.classifier[1].weight)
    after = FleetModel("1/2", str(path), {}, 16, FLEET, {n: state[n] + 1 for n in names}, sharing="head")
    write_model(tmp_path / "round", after, device_model(after, check_shared(after), None))
    model, info, _ = load_model(tmp_path / "round")
    assert info.arch == "onnx" and info.classes == FLEET
    assert torch.allclose(model.get_submodule(model.head_name).weight, net.classifier[1].weight + 1)
