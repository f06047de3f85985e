"""A year on a device, compressed: ``edgerev daemon run`` fed a drifting stream for N simulated days.

The daemon (the CPU preset, narrowed with ``--set``, under ``storage.max_bytes`` = ``--budget``) runs in a
process of its own whose clock is a file this script moves a day at a time (the daemon's ``clock``
argument, the one tests inject; everything else is the real service loop, with its signal handling).
Each simulated day:

- ``--per-day`` generated images land in ``inbox/class<k>/``, spread over the classes active that day
  (classes come and go: see :data:`CLASSES`), their look drifting over the year (colour, darkness, blur:
  ``tests/daemon/drift.py``; the drift rises to ``--drift`` at mid-year and falls back);
- every ``--corrupt-every`` days, a batch of corrupt files beside them (random bytes, truncated PNGs);
- the clock moves to the day's end and the script waits until the daemon has taken the inbox in and no
  job is under way (the wall time this takes is the day's cycle time: ingest, and the job when one was due);
- with probability ``--kill-prob`` the daemon gets SIGKILL at a random moment within ``--kill-window``
  seconds of the day's files (ingest, a job, an export, a promotion...), and is started again at once as
  systemd would (``Restart=on-failure``, without the 15 s pause).

Per simulated month (30 days) the JSON has: the data directory's bytes against the budget (the daemon's
own measure at each day's end, the largest of the month, and a walk of the folder), the daemon's RSS
(at each day's end, once no job has been queued or running for ``--settle`` seconds: mean and largest;
the export's child process aside; ``job_days``: the days a job started, ran or ended), the days' cycle
time and the jobs' wall time, samples stored / removed by the retention policy / quarantined / lost
(written minus stored minus removed: must be 0), versions promoted and refused, and the accuracy of the model in
service on the month's own distribution (the active classes at the month's drift, images never shown to
the daemon); with ``--baseline``, beside it a model trained on that month's images alone with the same
recipe. The targets (issue 24): disk never above the budget, RSS within 10 % of the first month, cycle
time flat, 0 lost, accuracy within 5 points of the month-alone model.

    python benchmarks/soak.py --days 365 --out benchmarks/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
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
DAY = 86400.0
MONTH_DAYS = 30
#: class -> the simulated days it arrives on: [first, last) ranges (None: to the end)
CLASSES: dict[int, list[tuple[int, int | None]]] = {
    0: [(0, None)], 1: [(0, None)], 2: [(0, 150), (240, None)],  # 2 leaves for three months and comes back
    3: [(45, None)], 4: [(120, 300)], 5: [(200, None)],
}
NUM_CLASSES = len(CLASSES)
START = 1_700_000_000.0  # the simulated clock's first day (a fixed date: runs are comparable)


def active(day: int) -> list[int]:
    return [k for k, spans in CLASSES.items() if any(a <= day and (b is None or day < b) for a, b in spans)]


def drift_at(day: float, peak: float) -> float:
    """Rises from 0 to ``peak`` at mid-year and falls back (a season)."""
    import math

    return peak * math.sin(math.pi * (day % 365) / 365) ** 2


# the daemon's process -------------------------------------------------------------------------------

def child(config_path: str, clock_path: str, poll: float) -> int:
    """``edgerev daemon run`` as the CLI runs it, its clock read from ``clock_path``."""
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.cli import setup_logging
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.signals import Requests, handling

    def clock() -> float:
        return float(Path(clock_path).read_text())

    requests = Requests()
    try:
        with handling({signal.SIGTERM: requests.ask_stop, signal.SIGHUP: requests.ask_reload},
                      ignore_after=(signal.SIGHUP,), wakeup=requests.wakeup):
            config = load_config(config_path)
            setup_logging(config.log_level)
            with Daemon(config, config_path=config_path, clock=clock, requests=requests) as daemon:
                daemon.serve(poll_seconds=poll)
    finally:
        requests.close()
    return 0


class Running:
    """The daemon's process, its log lines timed as they arrive (for the jobs' wall time)."""

    def __init__(self, config: Path, clock: Path, poll: float, log: Path,
                 jobs: dict[int, list[float]] | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("JOURNAL_STREAM", None)
        self.proc = subprocess.Popen([sys.executable, __file__, "--child", str(config), str(clock), str(poll)],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, errors="replace",
                                     env=env)
        self.log = log
        # job id -> [first line, last line] (wall seconds), carried over a restart (a job resumed after a kill)
        self.jobs: dict[int, list[float]] = {} if jobs is None else jobs
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.log, "a") as out:
            for line in self.proc.stderr:
                out.write(line)
                out.flush()
                m = re.search(r"\bjob (\d+)\b", line)
                if m:
                    seen = self.jobs.setdefault(int(m.group(1)), [time.perf_counter()] * 2)
                    seen[1] = time.perf_counter()

    def rss(self) -> int | None:
        try:
            text = Path(f"/proc/{self.proc.pid}/status").read_text()
        except OSError:
            return None
        m = re.search(r"^VmRSS:\s+(\d+) kB", text, re.M)
        return int(m.group(1)) * 1024 if m else None

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait()


# the stream -----------------------------------------------------------------------------------------

def corrupt_files(inbox: Path, day: int, n: int, rng: random.Random) -> int:
    """``n`` files no image decoder accepts, under the active classes' folders."""
    from edgerev_daemon.service.demo import write_images

    classes = active(day)
    good = write_images(inbox.parent / ".soak-tmp", 1, [classes[0]], start=day, num_classes=NUM_CLASSES, size=32)
    png = good[0].read_bytes()
    shutil.rmtree(inbox.parent / ".soak-tmp")
    for i in range(n):
        folder = inbox / f"class{classes[i % len(classes)]}"
        folder.mkdir(parents=True, exist_ok=True)
        data = rng.randbytes(rng.randint(1, 4000)) if i % 2 else png[: rng.randint(20, len(png) - 20)]
        tmp = folder / f".corrupt-{day}-{i}.png.tmp"
        tmp.write_bytes(data)
        tmp.rename(folder / f"corrupt-{day}-{i}.png")
    return n


def _images(n: int, classes: list[int], start: int, seed: int, size: int, amount: float):
    """The generated images ``write_drifted`` writes for these arguments, in memory: ``(images, labels)``."""
    import torch

    from edgerev.train.data import SyntheticImages
    from tests.daemon.drift import drifted

    ds = SyntheticImages(n, num_classes=NUM_CLASSES, size=size, seed=seed, classes=list(classes), start=start)
    pairs = [ds[i] for i in range(n)]
    return torch.stack([drifted(x, amount) for x, _ in pairs]), [int(y) for _, y in pairs]


def _labeled(images, labels: list[int]):
    import torch

    from edgerev.train.labeled import LabeledImages

    return LabeledImages(images, torch.tensor(labels), tuple(f"class{k}" for k in range(NUM_CLASSES)))


EVAL_START = 5_000_000  # past every day's images (a day d writes from d * 10_000 on)


def month_eval(month: int, peak: float, seed: int, size: int, per_class: int):
    """The month's own distribution: the classes active at its middle, at its drift; images the daemon never
    saw (the stream's seed, which fixes the classes, at indices no day reaches)."""
    mid = month * MONTH_DAYS + MONTH_DAYS // 2
    classes = active(mid)
    images, labels = _images(per_class * len(classes), classes, EVAL_START + month * 10_000, seed, size,
                             drift_at(mid, peak))
    return _labeled(images, labels)


def accuracy(model_dir: Path, data) -> float:
    """The model's top class against each label (a class it does not know is always wrong)."""
    from edgerev.models.directory import load_model
    from edgerev.train.evaluate import predict_logits

    model, info, _ = load_model(model_dir)
    predicted = [info.classes[k] for k in predict_logits(model, data, info).argmax(1).tolist()]
    truth = [data.classes[k] for k in data.labels.tolist()]
    return sum(p == t for p, t in zip(predicted, truth, strict=True)) / len(truth)


def month_alone(config, month_data: list[tuple], seed: int, size: int, out: Path, limit: int) -> Path:
    """A model trained on (up to ``limit`` of) the month's images alone, with the daemon's first-model recipe."""
    import torch

    from edgerev.train.trainer import train
    from edgerev_daemon.learning.jobs import recipe

    parts = [_images(n, classes, start, seed, size, amount) for _, n, classes, start, amount in month_data]
    images = torch.cat([x for x, _ in parts])
    labels = [y for _, ys in parts for y in ys]
    order = list(range(len(labels)))
    random.Random(0).shuffle(order)
    order = order[:limit]
    data = _labeled(images[order], [labels[i] for i in order])
    train(recipe(config, None), out, data=(data.restrict(data.present()), None), progress=False)
    return out


# the run ----------------------------------------------------------------------------------------------

def measure_dir(root: Path) -> int:
    total = 0
    for folder, _, files in os.walk(root):
        for f in files:
            try:
                total += os.lstat(os.path.join(folder, f)).st_size
            except OSError:
                pass
    return total


def wait_drained(inbox: Path, running: Running, limit: float) -> bool:
    """Until no file is left in the inbox (taken in, or quarantined): polled, this is a benchmark."""
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if running.proc.poll() is not None:
            return False
        if not any(p.is_file() and not p.name.startswith(".") for p in inbox.rglob("*")):
            return True
        time.sleep(0.05)
    return False


def jobs_seen(database: Path) -> list[tuple[int, str]]:
    """The store's jobs and their states (read-only; the daemon holds the lock, not the file)."""
    import sqlite3

    try:
        with sqlite3.connect(f"file:{database}?mode=ro", uri=True, timeout=30) as db:
            return db.execute("SELECT id, state FROM jobs ORDER BY id").fetchall()
    except sqlite3.Error:  # no store yet (the daemon's first start)
        return []


def wait_idle(database: Path, running: Running, settle: float, limit: float) -> None:
    """After the inbox is taken in: until no job is queued or running for ``settle`` seconds (a job starts
    after the ingest of its cycle, and the cycle goes on for a moment after the job is done)."""
    end = time.monotonic() + limit
    while time.monotonic() < end and running.proc.poll() is None:
        time.sleep(settle)
        if not any(state in ("queued", "running") for _, state in jobs_seen(database)):
            return
        while any(state in ("queued", "running") for _, state in jobs_seen(database)) and \
                time.monotonic() < end and running.proc.poll() is None:
            time.sleep(0.05)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        sys.exit(child(sys.argv[2], sys.argv[3], float(sys.argv[4])))
    sys.path.insert(0, str(ROOT))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", type=Path, default=ROOT / "configs" / "daemon" / "cpu.yaml")
    p.add_argument("--days", type=int, default=365)
    p.add_argument("--per-day", type=int, default=150, help="images a day (default 150)")
    p.add_argument("--budget", default="48MiB", help="storage.max_bytes (default 48MiB)")
    p.add_argument("--drift", type=float, default=0.5, help="the drift at mid-year (default 0.5)")
    p.add_argument("--corrupt-every", type=int, default=23, help="a day of corrupt files every N days")
    p.add_argument("--kill-prob", type=float, default=0.06, help="chance of a kill -9 each day (default 0.06)")
    p.add_argument("--kill-window", type=float, default=6.0, help="seconds after the day's files it may land")
    p.add_argument("--eval-per-class", type=int, default=100)
    p.add_argument("--baseline", action="store_true", help="train a model on each month alone (slow)")
    p.add_argument("--baseline-samples", type=int, default=1500)
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override a preset key (YAML value); the defaults: a narrow model, 6 epochs, a job per "
                        "2000 samples or 14 days")
    p.add_argument("--poll", type=float, default=0.2)
    p.add_argument("--settle", type=float, default=1.0,
                   help="seconds with no job under way before a day's RSS is read (default 1)")
    p.add_argument("--day-limit", type=float, default=900.0, help="seconds a day may take before the run fails")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--keep", type=Path, help="keep the data directory and the daemon's log here")
    p.add_argument("--out", type=Path)
    args = p.parse_args()

    data = yaml.safe_load(args.preset.read_text())
    defaults = ["training.model.args={width: 8, blocks: [1, 1, 1, 1, 1]}", "training.train.epochs=6",
                "training.continual.replay=600", "schedule.min_new_samples=2000",
                "schedule.max_interval_seconds=1209600", "ingest.settle_seconds=0", "storage.min_free_space=0",
                "storage.max_quarantine_bytes=1MiB",
                "log_level=INFO"]
    for item in defaults + args.set:
        key, value = item.split("=", 1)
        *path, last = key.split(".")
        node = data
        for part in path:
            node = node.setdefault(part, {})
        node[last] = yaml.safe_load(value)
    data.setdefault("storage", {})["max_bytes"] = args.budget
    work = Path(tempfile.mkdtemp(prefix="edgerev-soak-")) if args.keep is None else args.keep
    work.mkdir(parents=True, exist_ok=True)
    data["data_dir"] = str(work / "data")
    config_path = work / "daemon.yaml"
    config_path.write_text(yaml.safe_dump(data))
    clock_path = work / "clock"
    log_path = work / "daemon.log"

    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.status import status
    from tests.daemon.drift import write_drifted

    config = load_config(config_path)
    size = config.image_size
    budget = config.storage.max_bytes
    rng = random.Random(args.seed)

    def set_clock(t: float) -> None:
        tmp = clock_path.with_suffix(".tmp")
        tmp.write_text(repr(t))
        tmp.replace(clock_path)

    set_clock(START)
    running = Running(config_path, clock_path, args.poll, log_path)
    result: dict = {"settings": {k: _shown(v) for k, v in vars(args).items()},
                    "config": {k: data[k] for k in ("image_size", "training", "schedule", "storage", "promotion")},
                    "budget_bytes": budget, "classes": {k: v for k, v in CLASSES.items()}, "months": []}
    written, corrupt, kills, months = 0, 0, 0, result["months"]
    month: dict = {}
    month_data: list[tuple] = []
    started = time.perf_counter()
    prev_versions: set[str] = set()
    try:
        for day in range(args.days):
            if day % MONTH_DAYS == 0:
                month = {"month": day // MONTH_DAYS + 1, "days": [], "cycle_seconds": [], "disk_bytes": [],
                         "disk_walk_bytes": [], "rss_bytes": [], "job_days": [], "kills": 0, "corrupt_files": 0,
                         "jobs_seen": set(running.jobs)}
                month_data = []
            classes = active(day)
            amount = drift_at(day + 0.5, args.drift)
            start = day * 10_000
            files = write_drifted(config.inbox_path, args.per_day, classes, amount, start=start, seed=args.seed,
                                  num_classes=NUM_CLASSES, size=size)
            month_data.append((day, args.per_day, classes, start, amount))
            written += len(files)
            if args.corrupt_every and day % args.corrupt_every == args.corrupt_every - 1:
                n = corrupt_files(config.inbox_path, day, 20, rng)
                corrupt += n
                month["corrupt_files"] += n
            jobs_before = jobs_seen(config.layout.database)
            set_clock(START + (day + 1) * DAY - 1.0)
            t0 = time.perf_counter()
            if rng.random() < args.kill_prob:
                deadline = time.monotonic() + rng.uniform(0, args.kill_window)
                while time.monotonic() < deadline and running.proc.poll() is None:
                    time.sleep(0.01)
                running.kill()
                kills += 1
                month["kills"] += 1
                running = Running(config_path, clock_path, args.poll, log_path, running.jobs)
            if not wait_drained(config.inbox_path, running, args.day_limit):
                raise SystemExit(f"day {day}: the inbox was not taken in (daemon exit status "
                                 f"{running.proc.poll()}); see {log_path}")
            wait_idle(config.layout.database, running, args.settle, args.day_limit)
            if jobs_seen(config.layout.database) != jobs_before:  # a job started, ran or ended today
                month["job_days"].append(day)
            month["cycle_seconds"].append(round(time.perf_counter() - t0, 3))
            st = status(config, events=0, clock=lambda: float(clock_path.read_text()))
            month["disk_bytes"].append(st["storage"]["usage"].get("total"))
            month["disk_walk_bytes"].append(measure_dir(work / "data"))
            month["rss_bytes"].append(running.rss())
            month["days"].append(day)
            if day % MONTH_DAYS == MONTH_DAYS - 1 or day == args.days - 1:
                months.append(_month(month, st, written, corrupt, running, prev_versions, config, args, size,
                                     month_data, work))
                prev_versions = {v["version"] for v in st["versions"]}
                print(json.dumps({k: v for k, v in months[-1].items() if k not in ("cycle_seconds", "rss_bytes")}),
                      file=sys.stderr, flush=True)
                if args.out:  # what ran so far, should the run be cut short
                    args.out.parent.mkdir(parents=True, exist_ok=True)
                    args.out.write_text(json.dumps(result | {"partial": True, "days_done": day + 1,
                                                             "kills": kills}, indent=2) + "\n")
    finally:
        code = running.stop() if running.proc.poll() is None else running.proc.returncode
        result["final_exit_status"] = code
    result["kills"] = kills
    result["images_written"] = written
    result["corrupt_files_written"] = corrupt
    result["wall_seconds"] = round(time.perf_counter() - started, 1)
    result["targets"] = _targets(months, budget)
    write_json(result, args.out)
    if args.keep is None:
        shutil.rmtree(work, ignore_errors=True)


def _month(month: dict, st: dict, written: int, corrupt: int, running: Running, prev_versions: set[str], config,
           args, size: int, month_data: list[tuple], work: Path) -> dict:
    stored = st["samples"]["total"]
    removed = sum((st["storage"].get("removed") or {}).values())
    versions = [v for v in st["versions"] if v["version"] not in prev_versions]
    jobs = {k: round(b - a, 1) for k, (a, b) in running.jobs.items() if k not in month["jobs_seen"]}
    current = st["current"]["version"] if st["current"] else None
    out = {
        "month": month["month"], "days": [month["days"][0], month["days"][-1]],
        "disk_max_bytes": max(b for b in month["disk_bytes"] if b is not None) if any(month["disk_bytes"]) else None,
        "disk_walk_max_bytes": max(month["disk_walk_bytes"]), "budget_bytes": config.storage.max_bytes,
        "rss_mean_bytes": _mean([r for r in month["rss_bytes"] if r]),
        "rss_max_bytes": max(r or 0 for r in month["rss_bytes"]),
        "cycle_seconds_median": _median(month["cycle_seconds"]), "cycle_seconds_max": max(month["cycle_seconds"]),
        "cycle_seconds": month["cycle_seconds"], "rss_bytes": month["rss_bytes"], "job_days": month["job_days"],
        "jobs_wall_seconds": jobs,
        "samples_stored": stored, "samples_removed_by_policy": removed,
        "removed_by_reason": st["storage"].get("removed"), "quarantined_files": st["quarantined_files"],
        "samples_lost": written - stored - removed,
        "versions_promoted": sum(1 for v in versions if v["promoted"]),
        "versions_refused": sum(1 for v in versions if not v["promoted"]), "current": current,
        "kills": month["kills"], "corrupt_files": month["corrupt_files"],
        "classes_active": active(month["days"][-1]),
    }
    if current is not None:
        evaluation = month_eval(month["month"] - 1, args.drift, args.seed, size, args.eval_per_class)
        out["accuracy_current_month"] = round(accuracy(Path(config.data_dir) / "versions" / current, evaluation), 4)
        if args.baseline:
            alone = month_alone(config, month_data, args.seed, size, work / f"alone-{month['month']}",
                                args.baseline_samples)
            out["accuracy_month_alone"] = round(accuracy(alone, evaluation), 4)
            shutil.rmtree(alone, ignore_errors=True)
    return out


def _shown(value):
    """A setting as the JSON keeps it: a path inside the project relative to it, one outside by its name only
    (a result names no machine's folders)."""
    if not isinstance(value, Path):
        return value
    path = value.resolve()
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else path.name


def _mean(xs: list) -> float | None:
    return round(sum(xs) / len(xs)) if xs else None


def _median(xs: list) -> float | None:
    return sorted(xs)[len(xs) // 2] if xs else None


def _targets(months: list[dict], budget: int | None) -> dict:
    """The issue's targets against what was measured."""
    if not months:
        return {}
    first_rss = months[0]["rss_mean_bytes"]
    t = {
        "disk_never_above_budget": all((m["disk_max_bytes"] or 0) <= budget for m in months) if budget else None,
        "disk_max_over_budget": max((m["disk_max_bytes"] or 0) for m in months) / budget if budget else None,
        "rss_within_10_percent": all(m["rss_mean_bytes"] is None or m["rss_mean_bytes"] <= 1.1 * first_rss
                                     for m in months) if first_rss else None,
        "rss_last_over_first": round(months[-1]["rss_mean_bytes"] / first_rss, 3) if first_rss else None,
        "cycle_median_first_last": [months[0]["cycle_seconds_median"], months[-1]["cycle_seconds_median"]],
        "lost": sum(max(0, m["samples_lost"]) for m in months[-1:]),
    }
    pairs = [(m["accuracy_current_month"], m.get("accuracy_month_alone")) for m in months
             if "accuracy_current_month" in m]
    if any(b is not None for _, b in pairs):
        t["accuracy_within_5_points"] = all(b is None or a >= b - 0.05 for a, b in pairs)
    return t


if __name__ == "__main__":
    main()
