"""``edgerev fleet simulate``'s run: N devices in one process, each with its own data directory and daemon,
federated through Flower's ServerApp and ClientApp over :class:`edgerev.fleet.grid.InProcessGrid` (the preset
and the data: :mod:`edgerev.fleet.simulate`).

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
from pathlib import Path

import yaml

from edgerev.fleet.simulate import DeviceSpec, SimulationConfig, accuracy, device_config, own_test, test_set

log = logging.getLogger("edgerev.fleet.simulate")


def _dir_accuracy(folder: Path, data, daemon) -> float:
    """The accuracy of the model in ``folder`` (a version of ``daemon``, read with the factories its config
    allows)."""
    from edgerev.models.directory import load_model

    model, info, _ = load_model(folder, trust_factories=daemon.config.training.model.factories)
    return accuracy(model, info, data)


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

    from edgerev.fleet.client import make_client_app
    from edgerev.fleet.grid import InProcessGrid
    from edgerev.fleet.server import make_server_app
    from edgerev_daemon.learning.fleet import local_state, peak_of
    from edgerev_daemon.service.fleet import DaemonLink

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
            from edgerev.fleet.model import FleetModel, check_shared, device_model, fleet_info

            current_round["n"] = server_round
            shared = as_variances({k: torch.from_numpy(v.numpy().copy()) for k, v in arrays.items()})
            f = sim.fleet
            for node, d in devices.items():
                fm = FleetModel("eval", f.arch, dict(f.model_args), f.image_size, classes, shared, f.sharing,
                                f.share_bn_stats, f.seed, weights=f.weights or None)
                model = device_model(fm, check_shared(fm), local_state(d.daemon.config.layout.root))
                info = fleet_info(fm, model)
                own = own_test(test, d.spec)
                acc, acc_own = accuracy(model.module, info, test), accuracy(model.module, info, own)
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


