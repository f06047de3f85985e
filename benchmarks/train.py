"""Training figures, written as JSON: the CPU demo, memory-saving against plain training, and forgetting.

* ``configs/cpu-demo.yaml`` run as it is: final validation accuracy and wall time;
* the same recipe with ``memory.mode`` ``invert`` (the engine) and ``plain`` (plain autograd), same
  seed: both runs' validation curves and end points;
* continual learning: ``configs/cpu-demo-old.yaml`` (classes 0-4), then ``configs/finetune-demo.yaml``
  (classes 5-9) with replay and distillation, and the same without either: old-class accuracy.

    python benchmarks/train.py --out results/train.json
"""

from __future__ import annotations

import argparse
import dataclasses
import tempfile
import time
from pathlib import Path

from _common import write_json

from edgerev.train.config import load_config
from edgerev.train.trainer import train

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


def _run(cfg, out: Path) -> dict:
    t0 = time.perf_counter()
    r = train(cfg, out, progress=False)
    rows = [line for line in (out / "metrics.jsonl").read_text().splitlines() if '"eval"' in line]
    import json

    curve = [{"epoch": e["epoch"], "acc": e["acc"], "loss": e["loss"]} for e in map(json.loads, rows)]
    s = r.summary
    return {"seconds": round(time.perf_counter() - t0, 2), "steps": r.step, "final": s["final"] | {"per_class": None},
            "val_curve": curve, "forgetting": s.get("forgetting"), "start_old_acc": s.get("start_old_acc")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, help="JSON file to write")
    args = ap.parse_args()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        demo = load_config(CONFIGS / "cpu-demo.yaml")
        result["cpu_demo"] = _run(demo, tmp / "demo")
        for mode in ("invert", "plain"):
            cfg = dataclasses.replace(demo, memory=dataclasses.replace(demo.memory, mode=mode))
            result[f"demo_{mode}"] = _run(cfg, tmp / mode)
        old = load_config(CONFIGS / "cpu-demo-old.yaml")
        result["continual_base"] = _run(old, tmp / "old")
        new = load_config(CONFIGS / "finetune-demo.yaml")
        new = dataclasses.replace(new, model=dataclasses.replace(new.model, init=str(tmp / "old")))
        result["continual_replay_distill"] = _run(new, tmp / "kept")
        naive = dataclasses.replace(new, continual=dataclasses.replace(new.continual, replay=0, distill=0.0))
        result["continual_naive"] = _run(naive, tmp / "naive")
    write_json(result, args.out)


if __name__ == "__main__":
    main()
