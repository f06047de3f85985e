"""``edgerev fleet simulate`` (thin: parse, load the preset, call :func:`edgerev_daemon.service.simulate.simulate`,
print)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def cmd_simulate(args: argparse.Namespace) -> int:
    try:
        import flwr  # noqa: F401
    except ImportError:
        raise ValueError("Flower is not installed: pip install 'edgerev[fleet]' (Python >= 3.11)") from None
    from edgerev.fleet.simulate import check_out, load_simulation
    from edgerev_daemon.service.simulate import simulate

    sim = load_simulation(args.config)
    out = Path(args.out)
    check_out(out)
    if not args.json:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    result = simulate(sim, out)
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(f"{result['rounds']} rounds, {len(result['devices'])} devices, {result['seconds']} s")
    for d in result["devices"]:
        print(f"{d['name']}: federated {d['accuracy_federated']}, local only {d['accuracy_local']}, "
              f"sent {d['bytes_sent']:,} B, received {d['bytes_received']:,} B, peak {d['peak_bytes']} of cap "
              f"{d['cap_bytes']}, in service {d['in_service']}")
    return 0


def add_parser(sub) -> None:
    f = sub.add_parser("fleet", help="federated fine-tuning of a fleet of devices over Flower",
                       description="Federated fine-tuning over Flower (pip install 'edgerev[fleet]').")
    fs = f.add_subparsers(dest="fleet_command", required=True)
    s = fs.add_parser("simulate", help="N devices with their own data directories and daemons, in one process",
                      description="Run N simulated devices, each with its own data directory and daemon, through "
                                  "Flower's ServerApp and ClientApp over an in-process Grid (no Ray).")
    s.add_argument("--config", required=True, help="a simulation preset (configs/fleet/*.yaml)")
    s.add_argument("--out", default="runs/fleet", help="folder for the devices' data directories (empty or new)")
    s.add_argument("--json", action="store_true", help="print the report as JSON")
    s.set_defaults(fn=cmd_simulate)
