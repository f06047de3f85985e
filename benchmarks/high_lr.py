"""The paper's recipe on the CPU demo's model and data: peak lr 0.4, no gradient clipping, batch 256.

Trains ``configs/cpu-demo.yaml``'s model on its data with the RevNeXt authors' schedule (linear
warm-up from 0 to 0.4 over the first tenth of the steps, then linear decay; SGD with Nesterov
momentum 0.9, weight decay 5e-4; no clipping) for seeds 0, 1 and 2, and writes each seed's training
loss at every step and its final validation loss and accuracy.

    python benchmarks/high_lr.py --out results/high_lr.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import tempfile
import time
from pathlib import Path

from _common import write_json

from edgerev.train.config import load_config
from edgerev.train.trainer import RunError, train

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file to write")
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.4)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    args = ap.parse_args()
    demo = load_config(CONFIGS / "cpu-demo.yaml")
    optim = dataclasses.replace(demo.optim, lr=args.lr, schedule="linear", warmup=0.1, clip_grad_norm=None)
    result: dict = {"recipe": {"config": "configs/cpu-demo.yaml", "batch": args.batch, "epochs": args.epochs,
                               "optim": dataclasses.asdict(optim)}, "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            train_cfg = dataclasses.replace(demo.train, epochs=args.epochs, batch=args.batch, seed=seed, log_every=1,
                                            checkpoint_every=10**6)
            cfg = dataclasses.replace(demo, optim=optim, train=train_cfg)
            out = Path(tmp) / f"seed{seed}"
            t0 = time.perf_counter()
            try:
                r = train(cfg, out, progress=False)
                final, error = r.summary["final"], None
            except RunError as e:
                final, error = None, str(e)
            rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
            result["runs"][str(seed)] = {
                "seconds": round(time.perf_counter() - t0, 1),
                "diverged": error,
                "loss": [round(row["loss"], 5) for row in rows if row["kind"] == "train"],
                "final_val": None if final is None else {"loss": final["loss"], "acc": final["acc"]},
            }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
