"""Daemon figures, written as JSON: the time of one ``once`` cycle on the demo data, and its parts.

Two cycles on the embedded demo defaults (``edgerev daemon demo``): 600 generated images of classes
0-4 (ingest, first model, promotion, ONNX export), then 600 of all ten classes (a fine-tuning job with
head growth, replay and distillation, the promotion gate). Each cycle's wall time, ingest time and
images per second, and the job's outcome.

    python benchmarks/daemon.py --out results/daemon.json
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import write_json

from edgerev_daemon.config import config_from_dict
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.demo import DEMO_CONFIG, write_images
from edgerev_daemon.service.status import status


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--images", type=int, default=600)
    args = ap.parse_args()
    cycles = []
    with tempfile.TemporaryDirectory() as tmp:
        config = config_from_dict({**DEMO_CONFIG, "data_dir": str(Path(tmp) / "data")})
        for k, classes in enumerate((range(5), range(10))):
            write_images(config.inbox_path, args.images, classes, start=k * 100_000)
            t0 = time.perf_counter()
            with Daemon(config) as daemon:
                report = daemon.cycle()
            seconds = time.perf_counter() - t0
            cycles.append({"images": args.images, "classes": f"{classes.start}-{classes.stop - 1}",
                           "cycle_seconds": round(seconds, 2), "ingest_seconds": report.ingest["seconds"],
                           "ingest_images_per_second": round(report.ingest["accepted"] / report.ingest["seconds"], 1),
                           "job": report.job})
        s = status(config, events=0)
    write_json({"demo_config": DEMO_CONFIG, "cycles": cycles, "current": s["current"]["version"],
                "versions": s["versions"]}, args.out)


if __name__ == "__main__":
    main()
