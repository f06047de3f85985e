"""How long ``edgerev daemon run`` takes to exit after SIGTERM in each phase, against the unit's TimeoutStopSec.

A daemon preset (``configs/daemon/cpu.yaml`` by default) serves a data directory whose first model (v0001,
trained from ``--images`` generated images) is in service, with a second job's images (a new class among
them) in its inbox. For each phase, a copy of that directory is served by ``tests/daemon/stop_child.py``,
which parks the daemon at the start of the phase's slowest piece (the third file of an ingest batch, a
training step, the first epoch's evaluation, the trainer's final evaluation, the candidate's scoring on the
held-out samples, the ONNX export's child process, the version's files written before its rename) and lets
it go on the instant SIGTERM arrives, so each figure is a stop landing at the worst moment of its phase.
The latency runs from the signal to the process's exit (wall), beside the CPU seconds the daemon itself
spent after the signal (what the stop costs, whatever else loads the machine; a child it kills is not
counted). ``plan`` is a first job's stage profile measured on an empty profile cache (the first job of a
device; the other runs use the user's cache); ``idle`` is the plain daemon between cycles;
``training_under_sighup_storm`` a training stop while another process sends SIGHUP without pause. With
``--busy N``, N processes that only spin run beside the daemon from 3 s before each signal to its exit (the
daemon already parked: its start runs at the machine's own load), a device whose cores something else keeps
busy: on 2 cores, 12 of them stand for a load of about 13.

    python benchmarks/stop_latency.py --out benchmarks/results/stop_latency.json
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
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
CHILD = ROOT / "tests" / "daemon" / "stop_child.py"
PHASES = ("ingest", "plan", "training", "epoch", "final", "evaluation", "export", "promotion")


class Daemon:
    """A daemon process with its log lines collected as they arrive."""

    def __init__(self, command: list[str], env: dict) -> None:
        self.proc = subprocess.Popen(command, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                                     errors="replace", env=env)
        self.lines: list[str | None] = []
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
                    raise SystemExit(f"the daemon exited before {text!r}:\n{''.join(filter(None, self.lines))[-4000:]}")
                self.cond.wait()

    def _own_cpu(self) -> float | None:
        """The process's own CPU seconds so far (its threads; not its children's), or None once it is gone."""
        try:
            fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        if fields[0] == "Z":  # exited, not yet reaped
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime and stime

    def stop(self) -> float:
        """SIGTERM; the seconds to the exit (wall). The CPU seconds the process itself spent after the signal
        go to ``self.cpu_seconds`` (read from /proc every 10 ms until it exits, so the last 10 ms may be
        missed): on a loaded machine the wall time is mostly waiting for a core, the CPU time is what the
        stop costs."""
        before = last = self._own_cpu()
        t0 = time.perf_counter()
        self.proc.send_signal(signal.SIGTERM)
        while self.proc.poll() is None:
            now = self._own_cpu()
            last = now if now is not None else last
            time.sleep(0.01)  # a benchmark: polling /proc is the measurement
        seconds = time.perf_counter() - t0
        code = self.proc.returncode
        self.cpu_seconds = round(last - before, 3)
        if code != 0:
            raise SystemExit(f"exit status {code}:\n{''.join(filter(None, self.lines))[-3000:]}")
        return seconds

    def log(self) -> str:
        with self.cond:
            return "".join(filter(None, self.lines))


def _env(cache: Path | None = None) -> dict:
    """The daemon's environment; ``cache``: a profile cache of its own (None: the user's)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cache is not None:
        env["EDGEREV_CACHE"] = str(cache)
    env.pop("JOURNAL_STREAM", None)
    return env


def _config(preset: Path, data_dir: Path, overrides: dict) -> Path:
    data = yaml.safe_load(preset.read_text())
    data["data_dir"] = str(data_dir)
    data["ingest"] = {**data.get("ingest", {}), "settle_seconds": 0.0}
    for key, value in overrides.items():
        data[key] = {**data.get(key, {}), **value} if isinstance(value, dict) else value
    path = data_dir.parent / f"{data_dir.name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def _drop(config: Path, n: int, classes: range, start: int) -> None:
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.demo import write_images

    c = load_config(config)
    write_images(c.inbox_path, n, classes, start=start, num_classes=5, size=c.image_size)


def _slowest_step(data_dir: Path) -> float | None:
    import json

    rows = []
    for path in (data_dir / "jobs").glob("job-*/metrics.jsonl"):
        rows += [json.loads(line) for line in path.read_text().splitlines()]
    steps = [r["step_seconds"] for r in rows if r.get("kind") == "train"]
    return max(steps) if steps else None


STORM = "import os, signal, sys\nwhile True: os.kill(int(sys.argv[1]), signal.SIGHUP)"
SPIN = "while True: pass"


def stop(d: Daemon, busy: int) -> float:
    """``d.stop()`` with ``busy`` spinning processes beside it, started 3 s before the signal."""
    spinning = [subprocess.Popen([sys.executable, "-c", SPIN]) for _ in range(busy)]
    try:
        if spinning:
            time.sleep(3.0)  # a benchmark: the spinners take their share of the cores before the signal
        return d.stop()
    finally:
        for proc in spinning:
            proc.kill()
            proc.wait()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=Path, default=ROOT / "configs" / "daemon" / "cpu.yaml")
    p.add_argument("--images", type=int, default=1000, help="images of the first job (default 1000); the "
                   "second job gets half as many")
    p.add_argument("--repeat", type=int, default=1, help="stops per phase (default 1)")
    p.add_argument("--busy", type=int, default=0, help="processes spinning beside each stop (default 0)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a preset key (YAML value), e.g. training.train.epochs=3")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    overrides: dict = {}
    for item in args.set:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = overrides
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    unit = (ROOT / "deploy" / "edgerev.service").read_text()
    timeout = re.search(r"^TimeoutStopSec=(\d+)s?$", unit, re.M)
    result: dict = {"preset": str(args.preset.resolve().relative_to(ROOT)), "overrides": overrides,
                    "images": args.images, "timeout_stop_seconds": int(timeout.group(1)) if timeout else None,
                    "busy": args.busy, "cpus": os.cpu_count(), "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                    "seconds": {}, "cpu_seconds_after_signal": {}, "load_average_at_start": os.getloadavg()}
    seconds, cpu = result["seconds"], result["cpu_seconds_after_signal"]
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        cache = None  # the user's profile cache: measured once (minutes), only the plan's stop needs it empty
        base = _config(args.preset, tmp / "base", overrides)
        _drop(base, args.images, range(4), start=0)
        done = subprocess.run([sys.executable, "-m", "edgerev", "daemon", "once", "--config", str(base)],
                              env=_env(cache), capture_output=True, text=True)
        if done.returncode != 0 or not (tmp / "base" / "current").is_symlink():
            raise SystemExit(f"the first model was not promoted:\n{done.stderr[-3000:]}")
        result["first_job_seconds"] = round(time.perf_counter() - started, 1)
        result["slowest_step_seconds"] = _slowest_step(tmp / "base")

        def copy(name: str, second_job: bool = True) -> Path:
            shutil.copytree(tmp / "base", tmp / name, symlinks=True)
            config = _config(args.preset, tmp / name, overrides)
            if second_job:
                _drop(config, args.images // 2, range(5), start=10**6)
            return config

        config = copy("idle", second_job=False)
        for _ in range(args.repeat):
            d = Daemon([sys.executable, "-m", "edgerev", "daemon", "run", "--config", str(config), "--poll", "0.5"],
                       _env(cache))
            d.wait_for("serving")
            seconds.setdefault("idle", []).append(round(stop(d, args.busy), 3))
            cpu.setdefault("idle", []).append(d.cpu_seconds)
        for phase in PHASES:
            for k in range(args.repeat):
                name = f"{phase}-{k}"
                if phase == "plan":  # the first job of a device: no model, no profile cached
                    config = _config(args.preset, tmp / name, overrides)
                    _drop(config, args.images, range(4), start=0)
                    env = _env(tmp / f"cache-{name}")
                else:
                    config, env = copy(name), _env(cache)
                d = Daemon([sys.executable, str(CHILD), str(config), phase], env)
                d.wait_for(f"parked in {phase}")
                seconds.setdefault(phase, []).append(round(stop(d, args.busy), 3))
                cpu.setdefault(phase, []).append(d.cpu_seconds)
                print(f"{phase}: {seconds[phase][-1]} s", file=sys.stderr, flush=True)
                shutil.rmtree(tmp / name)
        config = copy("storm")
        d = Daemon([sys.executable, str(CHILD), str(config), "training"], _env(cache))
        d.wait_for("parked in training")
        sender = subprocess.Popen([sys.executable, "-c", STORM, str(d.proc.pid)])
        try:
            seconds["training_under_sighup_storm"] = [round(stop(d, args.busy), 3)]
            cpu["training_under_sighup_storm"] = [d.cpu_seconds]
        finally:
            sender.kill()
            sender.wait()
    worst = max(s for values in seconds.values() for s in values)
    result["worst_seconds"] = worst
    result["worst_phase"] = next(k for k, values in seconds.items() if worst in values)
    if result["timeout_stop_seconds"]:
        result["worst_over_timeout"] = round(worst / result["timeout_stop_seconds"], 4)
    result["worst_cpu_seconds"] = max(s for values in cpu.values() for s in values)
    result["load_average_at_end"] = os.getloadavg()
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    write_json(result, args.out)


if __name__ == "__main__":
    main()
