"""Bytes a device sends and receives per fleet round, for each sharing setting (``head``, ``head+last``,
``all``), averaged in clear and by secure aggregation (SecAgg+), as JSON.

The fleet's own ServerApp and ClientApp run over the in-process Grid, which serializes every message to
Flower's wire format (a protobuf ``Message``) and counts its bytes per device and per round. The devices
answer without training (they send back the weights they received, with their class counts): what
travels does not depend on the values, only on the tensors shared and the fleet's classes. A round is a
class query, a train message and its reply, an evaluate message and its reply; the figures are bytes
per device per round (received: from the server; sent: to it), with the number of shared floats. Under
SecAgg+ the train reply carries counts only, and the update travels masked in the protocol's four more
messages (keys, encrypted shares, the masked vector, shares to unmask).

    python benchmarks/fleet_traffic.py --config configs/fleet/cpu-4x3.yaml --out results/fleet_traffic.json
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

from _common import write_json


class EchoLink:
    """A device that lists its classes and answers each round with the weights it received."""

    def __init__(self, classes: list[str], per_class: int) -> None:
        self.counts = {c: per_class for c in classes}

    def classes(self) -> dict[str, int]:
        return dict(self.counts)

    def train_round(self, fm):
        from edgerev.fleet.model import RoundResult

        counts = [self.counts.get(c, 0) for c in fm.classes]
        return RoundResult(dict(fm.shared), counts, sum(counts), None, None, 0)

    def consider(self, fm):
        from edgerev.fleet.model import Consideration

        return Consideration(False, "not judged (traffic only)", None, 0.0, 0)

    def refused(self, what: str, error: str) -> None:
        raise AssertionError(f"{what} refused: {error}")


def traffic(sim, sharing: str, rounds: int, secagg: bool = False) -> dict:
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    from edgerev.fleet.client import make_client_app
    from edgerev.fleet.grid import InProcessGrid
    from edgerev.fleet.server import initial_arrays, make_server_app

    settings = replace(sim.fleet, sharing=sharing, rounds=rounds, min_devices=len(sim.devices), secagg=secagg)
    links = {i + 2: EchoLink([f"class{c}" for c in d.classes], sim.data.per_class) for i, d in enumerate(sim.devices)}
    app = make_client_app(lambda ctx: links[int(ctx.node_config["node"])])
    nodes = {n: (app, Context(1, n, {"node": n}, RecordDict(), settings.to_run_config())) for n in links}
    grid = InProcessGrid(nodes, 1)
    saved = (TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id)
    TaskIdentity.task_id, TaskIdentity.run_id, TaskIdentity.node_id = 1, 1, SUPERLINK_NODE_ID
    try:
        make_server_app()(grid, Context(1, SUPERLINK_NODE_ID, {}, RecordDict(), settings.to_run_config()))
    finally:
        TaskIdentity._task_id, TaskIdentity._run_id, TaskIdentity._node_id = saved
    classes = sorted({f"class{c}" for d in sim.devices for c in d.classes})
    floats = sum(int(a.numpy().size) for a in initial_arrays(settings, tuple(classes)).values())
    per_device = []
    for t, d in zip(grid.traffic.values(), sim.devices):
        last = t.by_round[str(rounds)]
        per_device.append({"name": d.name, "round": rounds, "received": last["received"], "sent": last["sent"]})
    return {"sharing": sharing, "secagg": secagg, "shared_floats": floats, "shared_bytes": 4 * floats,
            "fleet_classes": len(classes), "per_device_per_round": per_device}


def main() -> None:
    from edgerev.fleet.simulate import load_simulation

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default="configs/fleet/cpu-4x3.yaml")
    p.add_argument("--rounds", type=int, default=2, help="the last round is reported (the first has no new class)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sim = load_simulation(args.config)
    rows = [traffic(sim, s, args.rounds, secure) for secure in (False, True) for s in ("head", "head+last", "all")]
    f = sim.fleet
    write_json({"config": args.config, "arch": f.arch, "model_args": f.model_args, "image_size": f.image_size,
                "devices": len(sim.devices), "settings": rows}, args.out)


if __name__ == "__main__":
    main()
