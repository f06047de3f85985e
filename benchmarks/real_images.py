"""The daemon's training preset on a real image set against a long run of the same model, as JSON.

Each run is what a daemon's first job trains (``edgerev_daemon.learning.jobs.recipe`` on the preset file: its
model, optimizer, epochs, early stopping, augmentation and threads), on the same training images, with
10 % of them held out for the run's own validation and early stopping. A fixed fifth of the images (by
index) is never trained on: every run's accuracy is measured there.

* ``preset``: the preset as it is (with ``train.patience`` it stops on a held-out plateau);
* ``preset_fixed``: the preset with a fixed epoch count (``--fixed-epochs``, no early stopping: how the
  presets ran before);
* ``long``: the same model for ``--long-epochs`` epochs (the data's ceiling for this model).

Real images are read from a folder of class sub-folders (``--folder``). ``--make-digits DIR`` writes
scikit-learn's bundled handwritten digits there first (1797 real 8x8 greyscale scans of ten digits; needs
``pip install scikit-learn``; nothing is downloaded)::

    python benchmarks/real_images.py --make-digits data/digits --out results/real_images.json
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import write_json

from edgerev.models.directory import load_model
from edgerev.train.config import SourceConfig
from edgerev.train.evaluate import evaluate
from edgerev.train.labeled import LabeledImages, load_source
from edgerev.train.trainer import train
from edgerev_daemon.config import load_config
from edgerev_daemon.learning.jobs import recipe


def make_digits(folder: Path) -> Path:
    """scikit-learn's digits as 32x32 PNGs in ``folder/<digit>/`` (upscaled, 16 grey levels to 256)."""
    import numpy as np
    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    for i, (img, label) in enumerate(zip(digits.images, digits.target, strict=True)):
        out = folder / f"digit{label}"
        out.mkdir(parents=True, exist_ok=True)
        pixels = (np.asarray(img) * (255 / 16)).clip(0, 255).astype("uint8")
        Image.fromarray(pixels, mode="L").resize((32, 32), Image.BILINEAR).save(out / f"{i:04d}.png")
    return folder


def split(data: LabeledImages) -> tuple[LabeledImages, LabeledImages]:
    """(training images, test images): every fifth image by index is a test image."""
    import torch

    test = torch.arange(len(data)) % 5 == 0
    return (LabeledImages(data.images[~test], data.labels[~test], data.classes),
            LabeledImages(data.images[test], data.labels[test], data.classes))


def run(name: str, cfg, data: LabeledImages, test: LabeledImages, root: Path) -> dict:
    started = time.perf_counter()
    result = train(cfg, root / name, progress=False, data=(data, None))
    model, info, _ = load_model(result.out)
    acc = evaluate(model, test, info)["acc"]
    summary = result.summary
    rows = [json.loads(line) for line in (result.out / "metrics.jsonl").read_text().splitlines()]
    epochs = max(r["epoch"] for r in rows if r["kind"] == "eval")
    return {"test_accuracy": round(acc, 4), "val_accuracy": round(summary["final"]["acc"], 4),
            "epochs_run": epochs, "epochs_max": cfg.train.epochs, "patience": cfg.train.patience,
            "steps": result.step, "stopped_early": summary["stopped_early"],
            "seconds": round(time.perf_counter() - started, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", type=Path, help="a folder of class sub-folders of images")
    ap.add_argument("--make-digits", type=Path, help="write scikit-learn's digits here first and use them")
    ap.add_argument("--preset", type=Path, default=Path(__file__).parent.parent / "configs/daemon/cpu.yaml")
    ap.add_argument("--fixed-epochs", type=int, default=4)
    ap.add_argument("--long-epochs", type=int, default=40)
    ap.add_argument("--runs", default="preset,preset_fixed,long")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    folder = make_digits(args.make_digits) if args.make_digits else args.folder
    if folder is None:
        ap.error("give --folder DIR or --make-digits DIR")
    config = load_config(args.preset)
    base = recipe(config, None)
    data, test = split(load_source(SourceConfig(kind="folder", path=str(folder)), config.image_size))
    cfgs = {
        "preset": base,
        "preset_fixed": replace(base, train=replace(base.train, epochs=args.fixed_epochs, patience=None)),
        "long": replace(base, train=replace(base.train, epochs=args.long_epochs, patience=None)),
    }
    results = {"folder": folder.name, "images": len(data) + len(test), "classes": len(data.classes),
               "train_images": len(data), "test_images": len(test), "image_size": config.image_size,
               "preset": args.preset.name, "model": {"arch": base.model.arch, "args": base.model.args},
               "runs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs.split(","):
            results["runs"][name] = run(name, cfgs[name], data, test, Path(tmp))
            print(name, results["runs"][name], flush=True)
    write_json(results, args.out)


if __name__ == "__main__":
    main()
