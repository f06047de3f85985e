"""The demo on embedded defaults: generated images into an inbox, one full cycle, a prediction.

``edgerev daemon demo`` (the README's first command) sets up a data directory, drops images of the
generated data set (:class:`edgerev.train.data.SyntheticImages`) into ``inbox/<label>/`` as PNG
files, runs one cycle (ingest, train, evaluate, promote, export), prints the status, the ONNX
model's path and a prediction made with it by ONNX Runtime.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

DEMO_CONFIG = {
    "image_size": 32,
    "heldout_fraction": 0.15,
    "ingest": {"settle_seconds": 0.0},
    "schedule": {"min_new_samples": 100, "max_interval_seconds": 3600.0},
    "training": {"model": {"arch": "revnext", "args": {"width": 16, "blocks": [1, 1, 1, 1, 1]}},
                 "train": {"epochs": 4, "batch": 64}, "optim": {"lr": 0.03},
                 "continual": {"replay": 1000, "distill": 1.0}},
    "promotion": {"forgetting_margin": 0.05, "keep_last": 3},
}


def write_images(inbox: str | Path, n: int, classes: range | list[int], seed: int = 0, start: int = 0,
                 num_classes: int = 10, size: int = 32, look: Callable | None = None,
                 prefix: str | None = None) -> list[Path]:
    """Write ``n`` generated images of ``classes`` as ``inbox/class<k>/<prefix>-<index>.png`` (``prefix``: the
    seed unless given); ``look``, when given, changes each ``uint8 [3, H, W]`` image before it is written."""
    from PIL import Image

    from edgerev.train.data import SyntheticImages

    ds = SyntheticImages(n, num_classes=num_classes, size=size, seed=seed, classes=list(classes), start=start)
    paths = []
    for i in range(n):
        img, label = ds[i]
        folder = Path(inbox) / f"class{label}"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{seed if prefix is None else prefix}-{start + i:07d}.png"
        tmp = path.with_name("." + path.name)  # hidden while written: ingest skips it
        if look is not None:
            img = look(img)
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(tmp, format="PNG")
        tmp.rename(path)
        paths.append(path)
    return paths


def run_demo(folder: Path, images: int = 600) -> int:
    """Set up ``folder`` as a data directory, drop generated images, run one cycle, show the result.

    The first run brings classes 0-4; each later run brings the next images of all ten classes, so
    running it again shows a fine-tuning job growing the model and the promotion gate at work.
    """
    import json

    import yaml

    from edgerev.export.predict import Predictor
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.status import format_status, status

    folder.mkdir(parents=True, exist_ok=True)
    config_path = folder / "daemon.yaml"
    if not config_path.exists():
        config_path.write_text("# written by edgerev daemon demo; data_dir is relative to this file\n"
                               + yaml.safe_dump({"data_dir": ".", **DEMO_CONFIG}, sort_keys=False))
    config = load_config(config_path)
    runs = folder / ".demo-runs"
    run = int(runs.read_text()) if runs.exists() else 0
    classes = range(5) if run == 0 else range(10)
    write_images(config.inbox_path, images, classes, start=run * 100_000)
    print(f"demo run {run + 1}: {images} generated images of classes {classes.start}-{classes.stop - 1} dropped "
          f"into {config.inbox_path}")
    with Daemon(config, config_path=config_path) as daemon:
        report = daemon.cycle()
    runs.write_text(str(run + 1))
    i = report.ingest
    print(f"ingest: {i['accepted']} stored, {i['duplicates']} duplicates, {len(i['quarantined'])} quarantined")
    print(f"job: {json.dumps(report.job)}" if report.job else f"no job due ({report.due or 'not enough new data'})")
    s = status(config, events=0)
    print(format_status(s))
    if s["current"] is None or not s["current"].get("onnx"):
        print("no model in service yet")
        return 0
    onnx = s["current"]["onnx"]
    import tempfile

    example = folder / "example.png"
    with tempfile.TemporaryDirectory(dir=folder) as tmp:
        write_images(tmp, 1, [7 if run else 3], start=9_000_000 + run)[0].replace(example)
    p = Predictor(onnx).predict([example], top=3)[0]
    print(f"ONNX model: {onnx}")
    print(f"prediction with ONNX Runtime for {example} (a generated class{7 if run else 3} image): {p.label} "
          f"(probability {p.probability:.3f}); top 3: " + ", ".join(f"{c} {q:.3f}" for c, q in p.top))
    return 0
