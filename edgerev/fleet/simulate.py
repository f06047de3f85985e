"""``edgerev fleet simulate``'s preset and data: N devices in one process, each with its own data directory
and daemon (the run: :mod:`edgerev_daemon.service.simulate`).

A preset (``configs/fleet/*.yaml``, :func:`load_simulation`) names the devices and the classes each sees, the
fleet's settings, the generated data set, the daemon config keys the devices share, and the faults to inject:
``offline: {device: [rounds]}`` (unreachable: the server goes on without it), ``drop: {device: [rounds]}``
(trains, then its reply is lost mid-round: its job is left with a checkpoint and superseded next round).
Each device's daemon config is :func:`device_config`; the test set every device is scored on is
:func:`test_set` (images of every class, disjoint from every device's).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from edgerev.config import ConfigError, check, from_dict, load_yaml, merged
from edgerev.fleet.settings import FleetSettings


@dataclass(frozen=True)
class DeviceSpec:
    """One simulated device: its name, the class indices it sees, its daemon config overrides."""

    name: str
    classes: tuple[int, ...]
    daemon: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        check(self.name.isidentifier(), "name", f"must be a plain name, got {self.name!r}")
        check(len(self.classes) >= 2, "classes", "a device needs at least two classes (a first model)")


@dataclass(frozen=True)
class DataSpec:
    """The generated data set: ``num_classes``, training images per class per device, test images per class."""

    num_classes: int = 10
    per_class: int = 60
    test_per_class: int = 30
    seed: int = 0
    noise: float = 40.0

    def __post_init__(self) -> None:
        check(self.num_classes >= 2, "num_classes", f"must be at least 2, got {self.num_classes}")
        check(self.per_class >= 5, "per_class", f"must be at least 5, got {self.per_class}")
        check(self.test_per_class >= 1, "test_per_class", f"must be at least 1, got {self.test_per_class}")


@dataclass(frozen=True)
class Faults:
    offline: dict = field(default_factory=dict)
    drop: dict = field(default_factory=dict)


@dataclass(frozen=True)
class SimulationConfig:
    """``fleet``: :class:`FleetSettings`; ``daemon``: daemon config keys every device shares (``data_dir`` is
    set per device); ``local_epochs``: the local-only job's epochs."""

    devices: tuple[DeviceSpec, ...]
    fleet: FleetSettings = field(default_factory=FleetSettings)
    data: DataSpec = field(default_factory=DataSpec)
    daemon: dict = field(default_factory=dict)
    local_epochs: int = 3
    faults: Faults = field(default_factory=Faults)

    def __post_init__(self) -> None:
        check(len(self.devices) >= 1, "devices", "name at least one device")
        names = [d.name for d in self.devices]
        check(len(set(names)) == len(names), "devices", f"names must be distinct, got {names}")
        for d in self.devices:
            check(all(0 <= c < self.data.num_classes for c in d.classes), "devices",
                  f"{d.name}: classes must lie in 0..{self.data.num_classes - 1}")
        for kind in ("offline", "drop"):
            for name in getattr(self.faults, kind):
                check(name in names, f"faults.{kind}", f"no device named {name!r}")


def load_simulation(path: str | Path) -> SimulationConfig:
    """Read a simulation preset (``yaml.safe_load``); every key is checked."""
    return from_dict(SimulationConfig, load_yaml(Path(path)))


def device_config(sim: SimulationConfig, spec: DeviceSpec, folder: Path) -> dict:
    """The daemon config of one device: its training is the fleet's model; one job on arrival."""
    f = sim.fleet
    base = {"data_dir": ".", "image_size": f.image_size, "heldout_fraction": 0.15,
            "ingest": {"settle_seconds": 0.0}, "schedule": {"min_new_samples": 1},
            "training": {"model": {"arch": f.arch, "args": dict(f.model_args),
                                   **({"weights": f.weights} if f.weights else {})},
                         "train": {"epochs": sim.local_epochs}}}
    return merged(merged(base, sim.daemon), spec.daemon)


def test_set(sim: SimulationConfig):
    """Images of every class of the data set, disjoint from every device's (the same seed, another range)."""
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    d = sim.data
    source = SourceConfig(samples=d.test_per_class * d.num_classes, num_classes=d.num_classes, seed=d.seed,
                          noise=d.noise, start=9_000_000)
    return load_source(source, sim.fleet.image_size)


def accuracy(model, info, data) -> float:
    """The share of ``data`` that ``model`` (described by ``info``) classifies right, by class name."""
    from edgerev.train.evaluate import predict_logits

    logits = predict_logits(model, data, info)
    names = [info.classes[k] for k in logits.argmax(1).tolist()]
    truth = [data.classes[k] for k in data.labels.tolist()]
    return sum(p == t for p, t in zip(names, truth)) / len(truth)


def own_test(test, spec: DeviceSpec):
    """The part of the all-classes test set of the device's own classes."""
    return test.restrict([test.classes[c] for c in spec.classes])


def check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: a simulation starts from empty data directories")
