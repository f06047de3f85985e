"""A daemon job's training step beside one CPU-bound neighbour, against the same step without it, as JSON.

The step is a daemon job's (the preset's model, batch, optimizer and threads, as
``edgerev_daemon.learning.jobs.recipe`` builds them; default: ``configs/daemon/cpu.yaml``, whose threads default
to one fewer than the cores) with the process's environment as ``edgerev`` sets it
(``OMP_WAIT_POLICY=PASSIVE``). Rounds alternate: steps with no neighbour, then steps while a second
process spins a CPU-bound Python loop; load on the machine falls on both alike. The figure is the
ratio of the medians (target: at most 1.3 on a 2-core machine).

    python benchmarks/neighbour.py --out results/neighbour.json
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as edgerev's command line sets it, before torch loads

import argparse  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
from _common import write_json  # noqa: E402

from edgerev.models import create_model  # noqa: E402
from edgerev.train.cap import train_step  # noqa: E402
from edgerev.train.memory import loss_of  # noqa: E402
from edgerev.train.trainer import training_threads  # noqa: E402
from edgerev_daemon.config import load_config  # noqa: E402
from edgerev_daemon.learning.jobs import recipe  # noqa: E402

SPIN = "while True: pass"


def steps(model, optimizer, loss_fn, n: int, batch: int, size: int, classes: int) -> list[float]:
    times = []
    for _ in range(n):
        x = torch.randn(batch, 3, size, size)
        y = torch.randint(0, classes, (batch,))
        t0 = time.perf_counter()
        train_step(model, optimizer, x, (y,), loss_fn=loss_fn)
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", type=Path, default=Path(__file__).parent.parent / "configs/daemon/cpu.yaml")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--steps", type=int, default=8, help="timed steps per round and condition")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    config = load_config(args.preset)
    cfg = recipe(config, None)
    classes = 10
    model = create_model(cfg.model.arch, **cfg.model.args, num_classes=classes)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.optim.lr, momentum=cfg.optim.momentum,
                                nesterov=cfg.optim.nesterov, weight_decay=cfg.optim.weight_decay)
    loss_fn = loss_of(cfg)
    batch, size = cfg.train.batch, config.image_size
    quiet, beside = [], []
    with training_threads(cfg.train.threads) as threads:
        steps(model, optimizer, loss_fn, 2, batch, size, classes)  # warm-up
        for _ in range(args.rounds):
            quiet += steps(model, optimizer, loss_fn, args.steps, batch, size, classes)
            neighbour = subprocess.Popen([sys.executable, "-c", SPIN])
            try:
                beside += steps(model, optimizer, loss_fn, args.steps, batch, size, classes)
            finally:
                neighbour.kill()
                neighbour.wait()
    q, b = statistics.median(quiet), statistics.median(beside)
    write_json({
        "preset": args.preset.name, "arch": cfg.model.arch, "args": cfg.model.args, "batch": batch, "size": size,
        "threads": threads, "cores": len(os.sched_getaffinity(0)), "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
        "load_average_at_end": os.getloadavg(),
        "quiet_step_seconds": round(q, 4), "beside_neighbour_step_seconds": round(b, 4),
        "ratio": round(b / q, 3), "target": 1.3,
        "quiet_all": [round(t, 4) for t in quiet], "beside_all": [round(t, 4) for t in beside],
    }, args.out)


if __name__ == "__main__":
    main()
