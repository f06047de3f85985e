"""Evaluating with the running average of batch-norm statistics against statistics measured before each evaluation.

The running statistics a batch norm keeps (momentum 0.1) trail weights that change fast: early in a run from
scratch a model evaluated with them can sit at chance while the same weights are right most of the time with
statistics of the current weights. ``train.bn_measure`` measures them anew on that many training images
before every evaluation (:func:`edgerev.train.norms.measure_running_statistics`). This runs the trainer on
scikit-learn's digits (real 8x8 scans upscaled to 32x32; 800 to train, 300 held out) with the CPU preset's
model and learning rate, with ``bn_measure: 0`` and with the default, ``--repeats`` times each, every run in a
process of its own (the same seed: the runs differ only in float rounding, which the unstable early epochs
amplify), and writes each epoch's held-out accuracy and loss, the final accuracy and the run's seconds.

    pip install scikit-learn   # for the digits only; not a dependency of edgerev
    python benchmarks/bn_measure.py --out benchmarks/results/bn_measure.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json


def digits():
    from sklearn.datasets import load_digits

    from edgerev.train.labeled import LabeledImages

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32)[:, None] / 16.0
    x = (F.interpolate(x, size=32, mode="bilinear").repeat(1, 3, 1, 1) * 255).round().clamp(0, 255).to(torch.uint8)
    y = torch.tensor(d.target)
    perm = torch.randperm(len(y), generator=torch.Generator().manual_seed(0))
    x, y = x[perm], y[perm]
    classes = tuple(str(i) for i in range(10))
    return LabeledImages(x[300:1100], y[300:1100], classes), LabeledImages(x[:300], y[:300], classes)


def one(n: int, epochs: int, threads: int) -> dict:
    """One run with ``train.bn_measure: n``: each epoch's held-out accuracy and loss, the final one, seconds."""
    import edgerev

    torch.set_num_threads(threads)
    train, val = digits()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "run"
        edgerev.fit("revnext", (train, val), out=str(out), size=32, epochs=epochs, batch=64, lr=0.03,
                    args={"width": 16, "blocks": [1, 1, 1, 1, 2]},
                    config={"train": {"bn_measure": n, "threads": threads}})
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((out / "summary.json").read_text())
    return {"epochs": [{"epoch": r["epoch"], "acc": r["acc"], "loss": r["loss"]} for r in rows if r["kind"] == "eval"],
            "final_acc": summary["final"]["acc"], "seconds": summary["seconds_this_session"]}


def main() -> None:
    from edgerev.train.config import TrainConfig

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=2, help="runs of each setting, each in a process of its own")
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # the child: one run with this bn_measure
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    if args.one is not None:
        print(json.dumps(one(args.one, args.epochs, args.threads)))
        return
    runs: dict[str, list[dict]] = {}
    for _ in range(args.repeats):  # a process each: a run's float rounding may depend on what ran before it
        for n in (0, TrainConfig().bn_measure):
            child = subprocess.run([sys.executable, __file__, "--one", str(n), "--epochs", str(args.epochs),
                                    "--threads", str(args.threads)], capture_output=True, text=True, check=True)
            runs.setdefault(str(n), []).append(json.loads(child.stdout.strip().splitlines()[-1]))
    write_json({"model": "revnext width 16 blocks [1,1,1,1,2] (configs/daemon/cpu.yaml)", "lr": 0.03, "batch": 64,
                "train": 800, "val": 300, "runs": runs}, args.out)


if __name__ == "__main__":
    main()
