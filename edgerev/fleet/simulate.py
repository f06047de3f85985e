"""``edgerev fleet simulate``: N devices in one process, each with its own data directory and daemon,
federated through Flower's ServerApp and ClientApp over :class:`edgerev.fleet.grid.InProcessGrid`.

The run, step by step:

1. each device gets ``OUT/<name>/`` (its daemon's data directory and config) and generated images of its
   own classes in its inbox (:func:`edgerev_daemon.service.demo.write_images`, one data set, disjoint samples);
2. each daemon runs one cycle: ingest, then a job on its own data only (``local_epochs`` epochs): the
   model in service before the fleet, and the *local-only* figure;
3. the ServerApp runs ``fleet.rounds`` rounds; each device's ClientApp asks its daemon for the round
   (a job) and puts the aggregated model through its own promotion gate;
4. after each round, every device's copy of the fleet model (the aggregate with its own batch-norm
   statistics) and its model in service are scored on a test set of *all* the fleet's classes, and on
   the part of it of the device's own classes (``*_own``: what its gate weighs the fleet model on).

Faults (``faults:``): ``offline: {device: [rounds]}`` (unreachable: the server goes on without it),
``drop: {device: [rounds]}`` (trains, then its reply is lost mid-round: its job is left with a
checkpoint and superseded next round).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from edgerev.config import ConfigError, check, from_dict, load_yaml
from edgerev.fleet.settings import FleetSettings

log = logging.getLogger("edgerev.fleet.simulate")


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


def _deep(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _deep(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def device_config(sim: SimulationConfig, spec: DeviceSpec, folder: Path) -> dict:
    """The daemon config of one device: its training is the fleet's model; one job on arrival."""
    f = sim.fleet
    base = {"data_dir": ".", "image_size": f.image_size, "heldout_fraction": 0.15,
            "ingest": {"settle_seconds": 0.0}, "schedule": {"min_new_samples": 1},
            "training": {"model": {"arch": f.arch, "args": dict(f.model_args),
                                   **({"weights": f.weights} if f.weights else {})},
                         "train": {"epochs": sim.local_epochs}}}
    return _deep(_deep(base, sim.daemon), spec.daemon)


def test_set(sim: SimulationConfig):
    """Images of every class of the data set, disjoint from every device's (the same seed, another range)."""
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    d = sim.data
    source = SourceConfig(samples=d.test_per_class * d.num_classes, num_classes=d.num_classes, seed=d.seed,
                          noise=d.noise, start=9_000_000)
    return load_source(source, sim.fleet.image_size)


def _accuracy(model, info, data) -> float:
    from edgerev.train.evaluate import predict_logits

    logits = predict_logits(model, data, info)
    names = [info.classes[k] for k in logits.argmax(1).tolist()]
    truth = [data.classes[k] for k in data.labels.tolist()]
    return sum(p == t for p, t in zip(names, truth)) / len(truth)


def own_test(test, spec: DeviceSpec):
    """The part of the all-classes test set of the device's own classes."""
    return test.restrict([test.classes[c] for c in spec.classes])


def _dir_accuracy(folder: Path, data, daemon) -> float:
    """The accuracy of the model in ``folder`` (a version of ``daemon``, read with the factories its config
    allows)."""
    from edgerev.train.checkpoint import load_model

    model, info, _ = load_model(folder, trust_factories=daemon.config.training.model.factories)
    return _accuracy(model, info, data)


class Device:
    """A simulated device: its daemon (held open for the run) and what its rounds reported."""

    def __init__(self, spec: DeviceSpec, folder: Path, node_id: int) -> None:
        self.spec, self.folder, self.node_id = spec, folder, node_id
        self.daemon = None
        self.peaks: list[int] = []
        self.cap: int | None = None
        self.rounds: list[dict] = []
        self.stop_now = False
        self.seen_event = 0

    def open(self, sim: SimulationConfig) -> None:
        from edgerev_daemon.config import load_config
        from edgerev_daemon.service.daemon import Daemon
        from edgerev_daemon.service.demo import write_images

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self.folder / "daemon.yaml"
        path.write_text(yaml.safe_dump(device_config(sim, self.spec, self.folder), sort_keys=False))
        config = load_config(path)
        d = sim.data
        if not config.layout.database.exists():
            write_images(config.inbox_path, d.per_class * len(self.spec.classes), list(self.spec.classes),
                         seed=d.seed, start=100_000 * self.node_id, num_classes=d.num_classes, size=config.image_size)
        self.daemon = Daemon(config, config_path=path)
        self.cap = config.training.memory.budget

    def decision(self, fleet_round: str, current: str | None) -> tuple[str, bool]:
        """What this device's gate decided on the fleet model of ``fleet_round`` and whether it is the model
        in service; a device that did not judge it says why (its last fleet refusal since the last round)."""
        from edgerev_daemon.storage.records import EventKind

        store = self.daemon.store
        decided = [v for v in store.versions() if v.metrics.get("fleet_round") == fleet_round]
        refusals = store.events(EventKind.ERROR, after_id=self.seen_event, limit=1000)
        self.seen_event = max([self.seen_event, *(e.id for e in refusals)])
        if decided:
            return decided[-1].reason, bool(decided[-1].promoted and decided[-1].id == current)
        why = [e.message.get("error") for e in refusals if str(e.message.get("where", "")).startswith("fleet")]
        return f"not judged: {why[-1] if why else 'no fleet model reached this device'}", False

    def close(self) -> None:
        if self.daemon is not None:
            self.daemon.close()
            self.daemon = None


def simulate(sim: SimulationConfig, out: str | Path) -> dict:
    """Run the simulation into ``out``; returns the JSON report (see the module docstring)."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from edgerev.fleet.client import DaemonLink, make_client_app
    from edgerev.fleet.grid import InProcessGrid
    from edgerev.fleet.server import make_server_app
    from edgerev_daemon.learning.fleet import local_state, peak_of

    started = time.perf_counter()
    out = Path(out)
    run_id = 1
    devices = {i + 2: Device(spec, out / spec.name, i + 2) for i, spec in enumerate(sim.devices)}
    test = test_set(sim)
    try:
        for d in devices.values():
            d.open(sim)
        local: dict[str, float | None] = {}
        local_own: dict[str, float | None] = {}
        for d in devices.values():
            report = d.daemon.cycle()
            job = report.job or {}
            version = d.daemon.registry.current_path()
            local[d.spec.name] = _dir_accuracy(version, test, d.daemon) if version is not None else None
            local_own[d.spec.name] = (_dir_accuracy(version, own_test(test, d.spec), d.daemon) if version is not None
                                      else None)
            v = d.daemon.store.get_version(job["version"]) if job.get("version") else None
            peak = peak_of((v.metrics.get("training") or {}).get("plan") or {}) if v else None
            if peak:
                d.peaks.append(int(peak))
            log.info("%s: local model %s (%s)", d.spec.name, job.get("version"), job.get("reason") or job.get("status"))

        current_round = {"n": 0}

        def reachable(node: int) -> bool:
            return current_round["n"] + 1 not in sim.faults.offline.get(devices[node].spec.name, [])

        def deliver(node: int, msg) -> bool:
            dropped = current_round["n"] + 1 in sim.faults.drop.get(devices[node].spec.name, [])
            return not (dropped and msg.metadata.message_type.startswith("train"))

        class Link(DaemonLink):
            def __init__(self, device: Device) -> None:
                super().__init__(device.daemon, stop=lambda: device.stop_now)
                self.device = device

            def train_round(self, fm):
                r = current_round["n"] + 1
                self.device.stop_now = False
                if r in sim.faults.drop.get(self.device.spec.name, []):
                    # drops out mid-round: the job stops after its first step, with a checkpoint
                    steps = {"n": 0}

                    def stop() -> bool:
                        steps["n"] += 1
                        return steps["n"] >= 1

                    self.stop = stop
                else:
                    self.stop = lambda: False
                result = super().train_round(fm)
                if result.peak_bytes:
                    self.device.peaks.append(int(result.peak_bytes))
                return result

        links = {node: Link(d) for node, d in devices.items()}
        client_app = make_client_app(lambda ctx: links[int(ctx.node_config["node"])])
        nodes = {node: (client_app, Context(run_id, node, {"node": node}, RecordDict(), sim.fleet.to_run_config()))
                 for node in devices}
        grid = InProcessGrid(nodes, run_id, reachable, deliver)

        def on_round(server_round: int, arrays, classes: tuple[str, ...]) -> None:
            import torch

            from edgerev.fleet.aggregate import as_variances
            from edgerev_daemon.learning.fleet import FleetModel, check_shared, device_model, fleet_info

            current_round["n"] = server_round
            shared = as_variances({k: torch.from_numpy(v.numpy().copy()) for k, v in arrays.items()})
            f = sim.fleet
            for node, d in devices.items():
                fm = FleetModel("eval", f.arch, dict(f.model_args), f.image_size, classes, shared, f.sharing,
                                f.share_bn_stats, f.seed, weights=f.weights or None)
                model = device_model(fm, check_shared(fm), local_state(d.daemon.config.layout.root))
                info = fleet_info(fm, model)
                own = own_test(test, d.spec)
                acc, acc_own = _accuracy(model, info, test), _accuracy(model, info, own)
                current = d.daemon.registry.current()
                cur_acc = _dir_accuracy(d.daemon.registry.current_path(), test, d.daemon) if current else None
                cur_own = _dir_accuracy(d.daemon.registry.current_path(), own, d.daemon) if current else None
                gate, promoted = d.decision(f"{run_id}/{server_round}", current)
                if server_round < f.judge_from:
                    gate = f"not judged: the devices judge the fleet model from round {f.judge_from} (judge-from)"
                traffic = grid.traffic[node].by_round
                d.rounds.append({"round": server_round, "accuracy_federated": round(acc, 4),
                                 "accuracy_federated_own": round(acc_own, 4), "in_service": current,
                                 "accuracy_in_service": cur_acc and round(cur_acc, 4),
                                 "accuracy_in_service_own": cur_own and round(cur_own, 4),
                                 "gate": gate, "promoted": promoted,
                                 "bytes_sent": sum(t["sent"] for k, t in traffic.items() if k == str(server_round)),
                                 "bytes_received": sum(t["received"] for k, t in traffic.items()
                                                       if k == str(server_round))})
                log.info("round %d %s: fleet %.4f, in service %s", server_round, d.spec.name, acc, current)

        server_app = make_server_app(on_round)
        saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
        TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, run_id, SUPERLINK_NODE_ID
        try:
            server_app(grid, Context(run_id, SUPERLINK_NODE_ID, {}, RecordDict(), sim.fleet.to_run_config()))
        finally:
            TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
        result = {"rounds": sim.fleet.rounds, "settings": {k: v for k, v in sim.fleet.to_run_config().items()},
                  "devices": [], "seconds": 0.0}
        for node, d in devices.items():
            last = d.rounds[-1] if d.rounds else {}
            t = grid.traffic[node]
            result["devices"].append({
                "name": d.spec.name, "classes": [f"class{c}" for c in d.spec.classes],
                "accuracy_federated": last.get("accuracy_federated"), "accuracy_local": local[d.spec.name],
                "accuracy_federated_own": last.get("accuracy_federated_own"),
                "accuracy_local_own": local_own[d.spec.name],
                "accuracy_in_service": last.get("accuracy_in_service"),
                "accuracy_in_service_own": last.get("accuracy_in_service_own"), "gate": last.get("gate"),
                "bytes_sent": t.sent, "bytes_received": t.received,
                "peak_bytes": max(d.peaks) if d.peaks else None, "cap_bytes": d.cap,
                "in_service": d.daemon.registry.current(), "per_round": d.rounds})
        result["seconds"] = round(time.perf_counter() - started, 1)
        (out / "fleet.json").write_text(json.dumps(result, indent=2) + "\n")
        return result
    finally:
        for d in devices.values():
            d.close()


def check_out(out: Path) -> None:
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"{out} is not empty: a simulation starts from empty data directories")
