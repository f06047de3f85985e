"""Fleet accuracy under label skew, through edgerev's trainer and the fleet's averaging, without the daemon
or Flower, as JSON: where the preset's fleet figures come from, and what they are measured against.

The preset's split (``configs/fleet/cpu-4x3.yaml``): four devices with classes (0,1,2), (3,4,5), (6,7,8),
(9,0,4) of the 10 generated classes, 60 training images per class, RevNeXt width 8 at 16x16. A round: each
device trains ``--epochs`` epochs from the fleet's weights with its own batch-norm statistics (FedBN), then
``edgerev.fleet.aggregate`` averages the weights (each head row over the devices that have the class, by
count). Reported per round: each device's fleet model (the fleet's weights, its own statistics) on 400
images of all 10 classes. Settings:

- ``skew``: the preset's split, no distillation from the received model (the preset's ``continual``);
- ``skew-distill``: the same with ``continual.distill: 1.0`` (the default a device's recipe has);
- ``iid``: each device sees all 10 classes, as many images as under ``skew``;
- ``central``: one model on every device's images, ``rounds x epochs`` epochs (one figure, at the end).

    python benchmarks/fleet_drift.py --out results/fleet_drift.json [--settings skew,iid] [--rounds 3]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

from _common import write_json

SPLIT = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 0, 4))
CLASSES = tuple(f"class{c}" for c in range(10))
SIZE = 16
SETTINGS = ("skew", "skew-distill", "iid", "central")


def images(n: int, classes, start: int):
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    return load_source(SourceConfig(samples=n, num_classes=len(CLASSES), classes=tuple(classes), start=start), SIZE)


def recipe(a, init: str | None, epochs: int, distill: float):
    from edgerev.config import from_dict
    from edgerev.train.config import RunConfig

    return from_dict(RunConfig, {
        "model": {"arch": "revnext", "args": model_args(a), "init": init},
        "data": {"size": SIZE, "val_fraction": 0.15},
        "augment": {"pad": 1, "flip": 0.0, "cutout": 0},
        "optim": {"lr": a.lr, "clip_grad_norm": 2.0, "schedule": "onecycle"},
        "train": {"epochs": epochs, "batch": 32, "checkpoint_every": 1000, "log_every": 1000, "threads": 1},
        "continual": {"replay": 0, "distill": distill}, "memory": {"budget": None}})


def model_args(a) -> dict:
    return {"width": a.width, "blocks": [1, 1, 1, 1, 1]}


def accuracy(model, info, data) -> float:
    from edgerev.train.evaluate import evaluate

    return round(evaluate(model, data, info)["acc"], 4)


def central(a, data, test, tmp: Path) -> dict:
    from edgerev.models.directory import load_model
    from edgerev.train.labeled import LabeledImages
    from edgerev.train.trainer import train

    train(recipe(a, None, a.rounds * a.epochs, 0.0), tmp / "central", progress=False,
          data=(LabeledImages.concat(data), None))
    model, info, _ = load_model(tmp / "central")
    return {"accuracy": accuracy(model, info, test)}


def federated(a, data, test, tmp: Path, distill: float) -> dict:
    """Rounds of FedAvg over the devices' images; each device's fleet-model accuracy per round."""
    import torch

    from edgerev.fleet.aggregate import Contribution, aggregate
    from edgerev.models import create_model
    from edgerev.models.directory import ModelInfo, load_model, save_model
    from edgerev.train.trainer import train

    torch.manual_seed(a.seed)
    initial = create_model("revnext", **model_args(a), num_classes=len(CLASSES))
    fleet = initial.state_dict()
    shared = [n for n, _ in initial.named_parameters()]  # batch-norm statistics stay on each device
    info = ModelInfo("revnext", CLASSES, SIZE, model_args=model_args(a))
    own: list[dict | None] = [None] * len(data)

    def device_model(i: int):
        state = {**fleet, **{k: v for k, v in (own[i] or {}).items() if k not in shared}}
        model = create_model("revnext", **model_args(a), num_classes=len(CLASSES))
        model.load_state_dict(state)
        return model

    rounds = []
    for r in range(1, a.rounds + 1):
        contributions = []
        for i, d in enumerate(data):
            start, out = tmp / f"r{r}d{i}-start", tmp / f"r{r}d{i}"
            save_model(start, device_model(i), info, {})
            train(recipe(a, str(start), a.epochs, distill), out, progress=False, data=(d, None))
            model, trained, _ = load_model(out)
            rows = [trained.classes.index(c) for c in CLASSES]  # the trainer orders the head its own way
            state = model.state_dict()
            own[i] = {k: v.clone() for k, v in state.items()}
            counts = [int((d.labels == k).sum()) for k in range(len(CLASSES))]
            contributions.append(Contribution(
                {k: (state[k][rows] if k.startswith("head.") else state[k]).numpy() for k in shared},
                sum(counts), counts))
        averaged = aggregate(contributions, {k: fleet[k].numpy() for k in shared})
        fleet = {**fleet, **{k: torch.from_numpy(v) for k, v in averaged.items()}}
        accs = [accuracy(device_model(i), info, test) for i in range(len(data))]
        rounds.append({"round": r, "accuracy": accs, "mean": round(sum(accs) / len(accs), 4)})
        print(f"round {r}: {accs}", flush=True)
    return {"rounds": rounds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=2, help="epochs per round")
    p.add_argument("--per-class", type=int, default=60)
    p.add_argument("--width", type=int, default=8)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    settings = a.settings.split(",")
    if unknown := set(settings) - set(SETTINGS):
        p.error(f"unknown settings {sorted(unknown)}; choose from {', '.join(SETTINGS)}")
    import torch

    torch.set_num_threads(1)
    test = images(400, range(len(CLASSES)), 9_000_000)
    result = {"rounds": a.rounds, "epochs": a.epochs, "per_class": a.per_class, "width": a.width, "lr": a.lr,
              "split": [list(c) for c in SPLIT], "settings": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for s in settings:
            split = [tuple(range(len(CLASSES)))] * len(SPLIT) if s == "iid" else SPLIT
            per_device = a.per_class * len(SPLIT[0])  # iid: as many images, spread over every class
            data = [images(per_device, c, 100_000 * (i + 2)) for i, c in enumerate(split)]
            t0 = time.perf_counter()
            if s == "central":
                out = central(a, data, test, Path(tmp) / s)
            else:
                out = federated(a, data, test, Path(tmp) / s, 1.0 if s == "skew-distill" else 0.0)
            result["settings"][s] = {**out, "seconds": round(time.perf_counter() - t0, 1)}
    write_json(result, a.out)


if __name__ == "__main__":
    main()
