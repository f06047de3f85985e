"""What holds the fleet back under label skew: each device's batch-norm statistics. A plain torch loop, as JSON.

The preset's split (``configs/fleet/cpu-4x3.yaml``: classes (0,1,2), (3,4,5), (6,7,8), (9,0,4) of the 10
generated classes, 153 training images per device, RevNeXt width 8 at 16x16), without the daemon, Flower or
the trainer, so that many short rounds are cheap: each round, every device takes ``--steps`` SGD steps (batch
32, Nesterov momentum, cosine within the round) from the fleet's weights, and the fleet averages them (each
head row over the devices that have the class). Reported every ``--every`` rounds: each device's copy of the
fleet model on 400 test images of all ten classes and on 120 of its own classes. ``--stats``:

- ``local``: batch norm as a fleet without ``share-bn-stats`` runs it (FedBN): training normalizes with each
  batch's statistics, which on a device are those of its three classes, and each device evaluates with its
  own running ones;
- ``fleet``: the fleet's statistics: every device trains with batch norm frozen at the fleet's statistics
  (eval mode), and after each round the fleet averages the devices' per-channel moments of each batch
  norm's input, layer after layer (each layer's moments are taken with the layers before it already set).

``--tune-steps`` > 0: each device then fine-tunes its copy of the last fleet model on its own images with
distillation from it (``--tune-lr``), the candidate a device would put to its gate.

    python benchmarks/fleet_norm.py --stats local --rounds 30 --steps 3 --out results/fleet_norm_local.json
    python benchmarks/fleet_norm.py --stats fleet --rounds 30 --steps 3 --lr 0.02 --out results/fleet_norm.json
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

from _common import write_json

SPLIT = ((0, 1, 2), (3, 4, 5), (6, 7, 8), (9, 0, 4))
SIZE, CLASSES, BATCH = 16, 10, 32


def images(n: int, classes, start: int):
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    d = load_source(SourceConfig(samples=n, num_classes=CLASSES, classes=tuple(classes), start=start), SIZE)
    return (d.images.float() / 255.0 - 0.5) / 0.25, d.labels


def norms(model) -> list:
    """The batch norms of ``model`` in forward order: (name, module)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "running_mean")]


def train(model, x, y, steps: int, lr: float, g, frozen: bool, teacher=None) -> None:
    """``steps`` SGD steps on random batches of ``x`` (pad-crop by 1), batch norms frozen when ``frozen``;
    with ``teacher``, plus its distillation (temperature 2) on every class."""
    import torch
    import torch.nn.functional as F

    from edgerev.engine import plain

    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    model.train()
    for _, m in norms(model) if frozen else ():
        m.eval()
    with plain(model):
        for s in range(steps):
            for group in opt.param_groups:
                group["lr"] = lr * 0.5 * (1 + math.cos(math.pi * s / steps))
            idx = torch.randint(0, len(x), (BATCH,), generator=g)
            i, j = torch.randint(0, 3, (2,), generator=g).tolist()
            xb = F.pad(x[idx], (1, 1, 1, 1))[:, :, i:i + SIZE, j:j + SIZE]
            out = model(xb)
            loss = F.cross_entropy(out, y[idx])
            if teacher is not None:
                with torch.no_grad():
                    t = teacher(xb)
                loss = loss + 4.0 * F.kl_div(F.log_softmax(out / 2, 1), F.softmax(t / 2, 1), reduction="batchmean")
            opt.zero_grad()
            loss.backward()
            opt.step()


def moments(model, x) -> dict:
    """Per-channel mean and mean square of each batch norm's input over ``x`` (eval mode)."""
    import torch

    got = {}
    hooks = [m.register_forward_hook(lambda _m, inp, _out, n=n: got.__setitem__(
        n, (inp[0].mean((0, 2, 3)), (inp[0] ** 2).mean((0, 2, 3))))) for n, m in norms(model)]
    model.eval()
    with torch.no_grad():
        model(x)
    for h in hooks:
        h.remove()
    return got


def accuracy(model, data) -> float:
    import torch

    model.eval()
    with torch.no_grad():
        return round(float((model(data[0]).argmax(1) == data[1]).float().mean()), 4)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stats", choices=("local", "fleet"), default="local")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--steps", type=int, default=3, help="SGD steps per device per round")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--local-steps", type=int, default=30, help="the local-only model's steps")
    p.add_argument("--tune-steps", type=int, default=0)
    p.add_argument("--tune-lr", type=float, default=0.01)
    p.add_argument("--every", type=int, default=5)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    import torch

    from edgerev.models import create_model

    torch.set_num_threads(1)
    frozen = a.stats == "fleet"
    data = [images(153, c, 100_000 * (i + 2)) for i, c in enumerate(SPLIT)]
    own = [images(120, c, 9_500_000 + 10_000 * i) for i, c in enumerate(SPLIT)]
    test = images(400, range(CLASSES), 9_000_000)

    def fresh():
        torch.manual_seed(a.seed)
        return create_model("revnext", width=8, blocks=[1, 1, 1, 1, 1], num_classes=CLASSES)

    g = torch.Generator().manual_seed(a.seed)
    started = time.perf_counter()
    initial = fresh()
    params = [n for n, _ in initial.named_parameters()]
    local = []
    for x, y in data:
        m = copy.deepcopy(initial)
        train(m, x, y, a.local_steps, a.lr, g, False)
        local.append(m)
    result = {"args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(a).items()},
              "local": {"all": [accuracy(m, test) for m in local], "own": [accuracy(m, o) for m, o in zip(local, own)]},
              "rounds": []}
    fleet = {k: v.clone() for k, v in initial.state_dict().items() if k in params}
    kept = [m.state_dict() for m in local]  # what each device keeps: its batch-norm statistics
    counts = torch.zeros(len(SPLIT), CLASSES)
    for i, c in enumerate(SPLIT):
        counts[i, list(c)] = 1.0
    row_weights = (counts / counts.sum(0).clamp(min=1)).T  # classes x devices

    def device(i: int):
        m = fresh()
        m.load_state_dict({**kept[i], **fleet})
        return m

    def calibrate() -> None:
        """The fleet's statistics, layer after layer, from the devices' moments (equal counts: a plain mean)."""
        for name, _ in norms(initial):
            seen = [moments(device(i), x)[name] for i, (x, _) in enumerate(data)]
            mean = torch.stack([s[0] for s in seen]).mean(0)
            var = (torch.stack([s[1] for s in seen]).mean(0) - mean ** 2).clamp(min=1e-5)
            for k in kept:
                k[f"{name}.running_mean"], k[f"{name}.running_var"] = mean, var

    if frozen:
        calibrate()
    for r in range(1, a.rounds + 1):
        trained = []
        for i, (x, y) in enumerate(data):
            m = device(i)
            train(m, x, y, a.steps, a.lr, g, frozen)
            kept[i] = m.state_dict()
            trained.append(kept[i])
        for k in params:
            stack = torch.stack([t[k] for t in trained])
            if k.startswith("head."):
                fleet[k] = (row_weights.reshape(CLASSES, len(SPLIT), 1) * stack.transpose(0, 1)).sum(1)
            else:
                fleet[k] = stack.mean(0)
        if frozen:
            calibrate()
        if r % a.every == 0 or r == a.rounds:
            accs = [accuracy(device(i), test) for i in range(len(SPLIT))]
            result["rounds"].append({"round": r, "all": accs, "mean": round(sum(accs) / len(accs), 4),
                                     "own": [accuracy(device(i), own[i]) for i in range(len(SPLIT))]})
            print(result["rounds"][-1], flush=True)
    if a.tune_steps:
        tuned = []
        for i, (x, y) in enumerate(data):
            m, teacher = device(i), device(i).eval()
            train(m, x, y, a.tune_steps, a.tune_lr, g, frozen, teacher)
            tuned.append(m)
        result["tuned"] = {"all": [accuracy(m, test) for m in tuned],
                           "own": [accuracy(m, o) for m, o in zip(tuned, own)]}
    result["seconds"] = round(time.perf_counter() - started, 1)
    write_json(result, a.out)


if __name__ == "__main__":
    main()
