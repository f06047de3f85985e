"""Is the fleet worth joining? The preset's simulation, measured the way the issue asks, as JSON.

Runs ``edgerev fleet simulate`` on a preset (``configs/fleet/cpu-4x3.yaml`` by default: four devices, three
of ten generated classes each) and reports, per device, on the all-classes test set and on its own classes'
part of it: the local-only model (the first job, before the fleet), the device's copy of the last fleet
model (the aggregate with its own batch-norm statistics), and the model in service at the end, with the
gate's last decision and its reason; and per device the gain of the model in service over local-only on
all classes, against the issue's target (+20 points, no device worse on its own classes beyond its gate's
evidence), the wall time against 15 minutes, and the CPU seconds of the process (the wall time depends on
what else the machine runs).

    python benchmarks/fleet_teach.py --out results/fleet_teach.json [--config configs/fleet/cpu-4x3.yaml]
"""

from __future__ import annotations

import argparse
import resource
import tempfile
import time
from pathlib import Path

from _common import write_json

TARGET_POINTS = 20.0
TARGET_SECONDS = 15 * 60


def row(d: dict) -> dict:
    """One device's line of the table."""
    gain = None
    if d["accuracy_in_service"] is not None and d["accuracy_local"] is not None:
        gain = round(100 * (d["accuracy_in_service"] - d["accuracy_local"]), 1)
    return {"device": d["name"], "classes": d["classes"],
            "local": {"all": d["accuracy_local"], "own": d["accuracy_local_own"]},
            "fleet": {"all": d["accuracy_federated"], "own": d["accuracy_federated_own"]},
            "in_service": {"version": d["in_service"], "all": d["accuracy_in_service"],
                           "own": d["accuracy_in_service_own"]},
            "gain_points": gain, "gate": d["gate"]}


def table(rows: list[dict]) -> str:
    lines = ["| device | local all / own | fleet all / own | in service all / own | gain | gate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [f"{r[k]['all']} / {r[k]['own']}" for k in ("local", "fleet", "in_service")]
        lines.append(f"| {r['device']} | {' | '.join(cells)} ({r['in_service']['version']}) | "
                     f"{r['gain_points']:+.1f} | {r['gate']} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=Path("configs/fleet/cpu-4x3.yaml"))
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    import logging

    from edgerev.fleet.simulate import load_simulation
    from edgerev_daemon.service.simulate import simulate

    logging.basicConfig(level=logging.WARNING)
    sim = load_simulation(a.config)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        report = simulate(sim, Path(tmp) / "fleet")
    seconds = time.perf_counter() - started
    rows = [row(d) for d in report["devices"]]
    gains = [r["gain_points"] for r in rows]
    result = {
        "config": str(a.config), "rounds": report["rounds"], "settings": report["settings"], "devices": rows,
        "seconds": round(seconds, 1), "cpu_seconds": round(resource.getrusage(resource.RUSAGE_SELF).ru_utime
                                                           + resource.getrusage(resource.RUSAGE_SELF).ru_stime, 1),
        "target": {"points": TARGET_POINTS, "seconds": TARGET_SECONDS,
                   "least_gain_points": min((g for g in gains if g is not None), default=None),
                   "met_points": all(g is not None and g >= TARGET_POINTS for g in gains),
                   "met_seconds": seconds <= TARGET_SECONDS},
        "per_round": {d["name"]: d["per_round"] for d in report["devices"]},
    }
    write_json(result, a.out)
    print(table(rows))


if __name__ == "__main__":
    main()
