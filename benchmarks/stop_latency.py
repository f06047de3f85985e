"""How long ``edgerev daemon run`` takes to exit after SIGTERM, against the unit's TimeoutStopSec.

A daemon preset (``configs/daemon/cpu.yaml`` by default) runs in a fresh data directory with generated
images, and gets SIGTERM at four kinds of moment: idle between cycles; during ingest; during training
(at a few checkpoints of the job: each start resumes it); right after the promotion decision (the ONNX
export and its verification, which no stop check interrupts). Each latency is measured from the signal
to the exit of the process; the slowest training step of the job (from its metrics) is reported beside
them, since a stop during training waits for the step under way. A storm run does the same during
training with another process sending SIGHUP without pause.

    python benchmarks/stop_latency.py --out results/stop_latency.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import yaml
from _common import write_json

ROOT = Path(__file__).resolve().parents[1]


class Daemon:
    """``edgerev daemon run`` with its log lines timed as they arrive."""

    def __init__(self, config: Path) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("JOURNAL_STREAM", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "edgerev", "daemon", "run", "--config", str(config),
                                      "--poll", "0.5"], stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     text=True, env=env)
        self.lines: list[str] = []
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self.cond:
                self.lines.append(line)
                self.cond.notify_all()
        with self.cond:
            self.lines.append(None)
            self.cond.notify_all()

    def wait_for(self, text: str) -> None:
        with self.cond:
            while not any(line is not None and text in line for line in self.lines):
                if None in self.lines:
                    raise SystemExit(f"the daemon exited before {text!r}:\n{''.join(filter(None, self.lines))}")
                self.cond.wait()

    def stop(self) -> float:
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait()
        seconds = time.perf_counter() - t0
        if code != 0:
            raise SystemExit(f"exit status {code}:\n{''.join(filter(None, self.lines))[-3000:]}")
        return seconds


def _config(preset: Path, data_dir: Path) -> Path:
    data = yaml.safe_load(preset.read_text())
    data["data_dir"] = str(data_dir)
    data["ingest"] = {**data.get("ingest", {}), "settle_seconds": 0.0}
    path = data_dir.parent / f"{data_dir.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drop(config: Path, n: int, start: int) -> None:
    from edgerev_daemon.config import load_config
    from edgerev_daemon.demo import write_images

    c = load_config(config)
    write_images(c.inbox_path, n, range(4), start=start, num_classes=4, size=c.image_size)


STORM = "import os, signal, sys\nwhile True: os.kill(int(sys.argv[1]), signal.SIGHUP)"


def _training_stops(config: Path, stops: int, storm: bool) -> list[float]:
    latencies = []
    for _ in range(stops):
        d = Daemon(config)
        d.wait_for("job 1: ")  # training (or its resume) is under way
        sender = subprocess.Popen([sys.executable, "-c", STORM, str(d.proc.pid)]) if storm else None
        latest = config.parent / config.stem / "jobs" / "job-00001" / "checkpoints" / "latest.json"
        before = json.loads(latest.read_text())["step"] if latest.exists() else 0
        while not latest.exists() or json.loads(latest.read_text())["step"] <= before:  # a checkpoint more
            time.sleep(0.05)  # a benchmark, not a test: polling the checkpoint file is fine here
        latencies.append(d.stop())
        if sender is not None:
            sender.kill()
            sender.wait()
    return latencies


def _slowest_step(data_dir: Path) -> float | None:
    rows = []
    for path in (data_dir / "jobs").glob("job-*/metrics.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step_seconds"] for r in rows if r.get("kind") == "train"]
    return max(steps) if steps else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=Path, default=ROOT / "configs" / "daemon" / "cpu.yaml")
    p.add_argument("--images", type=int, default=1000, help="images of the training job (default 1000)")
    p.add_argument("--stops", type=int, default=3, help="SIGTERMs during training (default 3)")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    unit = (ROOT / "deploy" / "edgerev.service").read_text()
    timeout = re.search(r"^TimeoutStopSec=(\d+)s?$", unit, re.M)
    result: dict = {"preset": str(args.preset.relative_to(ROOT)), "images": args.images,
                    "timeout_stop_seconds": int(timeout.group(1)) if timeout else None, "cpus": os.cpu_count()}
    with tempfile.TemporaryDirectory() as tmp:
        config = _config(args.preset, Path(tmp) / "data")
        d = Daemon(config)
        d.wait_for("serving")
        result["idle_seconds"] = round(d.stop(), 3)

        _drop(config, 5 * args.images, start=10**6)  # a long ingest: stopped between two batches
        d = Daemon(config)
        d.wait_for("serving")
        result["ingest_seconds"] = round(d.stop(), 3)

        _drop(config, args.images, start=0)
        result["training_seconds"] = [round(s, 3) for s in _training_stops(config, args.stops, storm=False)]
        result["training_under_sighup_storm_seconds"] = [round(s, 3) for s in _training_stops(config, 1, True)]
        result["slowest_step_seconds"] = _slowest_step(Path(tmp) / "data")

        d = Daemon(config)
        d.wait_for("candidate v0001")  # decided: the ONNX export and the switch come next, without a stop check
        result["promotion_seconds"] = round(d.stop(), 3)
    worst = max([result["idle_seconds"], result["ingest_seconds"], result["promotion_seconds"],
                 *result["training_seconds"], *result["training_under_sighup_storm_seconds"]])
    result["worst_seconds"] = worst
    if result["timeout_stop_seconds"]:
        result["worst_over_timeout"] = round(worst / result["timeout_stop_seconds"], 4)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
