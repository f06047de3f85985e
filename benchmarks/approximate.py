"""Approximate activations (store8/store4, after Chakrabarti & Moseley): gradient error and accuracy, as JSON.

* ``gradients``: relative error of the parameter gradient (all parameters, Frobenius norm) against plain
  autograd on the same weights and batch, at initialization, per architecture and mode, for the per-layer
  copies the engine keeps (``new``) and for the former scheme that recomputed a whole stage from one copy
  of its input (``old``, reproduced here: sign and magnitude on ``2**(bits-1)`` levels per sign).
* ``digits``: training on real images, scikit-learn's bundled handwritten digits (1797 8x8 scans, 10
  classes) upscaled to 32x32, in the exact mode and in store8/store4, several seeds each: the same
  initialization, data order and split per seed; test accuracy at the end.

    pip install scikit-learn   # for the digits only; not a dependency of edgerev
    python benchmarks/approximate.py --out results/approximate.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json

from edgerev import create_model, plain
from edgerev.layers.base import replaying
from edgerev.layers.pooling import unpool_batch
from edgerev.quantize import channel_range

# ---- the former scheme: one sign-and-magnitude copy of each stage input, the stage recomputed from it ----------


def _old_copy(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Dequantized sign-and-magnitude copy (``2**(bits-1)`` levels per sign, the batch's range per channel)."""
    levels = 2 ** (bits - 1)
    hi, lo = (r.clamp_min(torch.finfo(x.dtype).eps).view(1, -1, *[1] * (x.dim() - 2)) for r in channel_range(x))
    pos = x > 0
    mag = torch.where(pos, x * levels / hi, -x * levels / lo).floor().clamp(0, levels - 1) + 0.5
    return torch.where(pos, mag * hi / levels, -mag * lo / levels)


class _WholeStage(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, stage, bits, *params):
        ctx.copy, ctx.stage, ctx.params = _old_copy(x.detach(), bits), stage, params
        with torch.no_grad():
            return stage(x)

    @staticmethod
    def backward(ctx, g):
        xin = ctx.copy.requires_grad_()
        with torch.enable_grad(), replaying(ctx.stage):
            out = ctx.stage(xin)
        grads = torch.autograd.grad(out, [xin, *ctx.params], g, allow_unused=True)
        return (grads[0], None, None, *grads[1:])


def _old_forward(model, x: torch.Tensor, bits: int) -> torch.Tensor:
    h = x
    for stage in model.stages:
        params = [p for p in stage.parameters() if p.requires_grad]
        h = _WholeStage.apply(h, stage, bits, *params)
    return model.head(unpool_batch(h, x.shape[0]).mean(dim=(1, 3, 4)))


def _grads(model, y: torch.Tensor, forward, *args) -> torch.Tensor:
    """The flattened parameter gradient of the cross-entropy of ``forward(*args)``."""
    model.zero_grad(set_to_none=True)
    F.cross_entropy(forward(*args), y).backward()
    return torch.cat([p.grad.flatten() for p in model.parameters()])


def gradient_errors(archs: list[str], batch: int, size: int, seeds: int) -> dict:
    rows = {}
    for arch in archs:
        rows[arch] = {}
        for seed in range(seeds):
            torch.manual_seed(seed)
            model = create_model(arch).train()
            x, y = torch.randn(batch, 3, size, size), torch.randint(0, 10, (batch,))

            with plain(model):
                ref = _grads(model, y, model, x)
            for bits in (8, 4):
                mode = f"store{bits}"
                model.set_modes(mode)
                new = _grads(model, y, model, x)
                with plain(model):
                    old = _grads(model, y, _old_forward, model, x, bits)
                row = rows[arch].setdefault(mode, {"new": [], "old": []})
                row["new"].append(float((new - ref).norm() / ref.norm()))
                row["old"].append(float((old - ref).norm() / ref.norm()))
    for arch in rows:
        for row in rows[arch].values():
            for k in ("new", "old"):
                row[k + "_mean"] = statistics.mean(row[k])
    return rows


# ---- real images: the digits ------------------------------------------------------------------------------------


def digits(size: int = 32, test_fraction: float = 0.25, seed: int = 0):
    """The 1797 digits as ``[N, 3, size, size]`` floats (grey repeated, standardized), split by a fixed seed."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1) / 16.0
    x = F.interpolate(x, size=(size, size), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1)
    x = (x - x.mean()) / x.std()
    y = torch.tensor(d.target, dtype=torch.long)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    n_test = int(len(y) * test_fraction)
    test, train = order[:n_test], order[n_test:]
    return (x[train], y[train]), (x[test], y[test])


def train_digits(arch: str, mode: str, seed: int, data, epochs: int, batch: int, lr: float, width: int) -> dict:
    (xtr, ytr), (xte, yte) = data
    torch.manual_seed(seed)
    model = create_model(arch, width=width).train()
    if mode != "plain":
        model.set_modes(mode)
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, nesterov=True, weight_decay=5e-4)
    steps = epochs * (len(ytr) // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=lr, total_steps=steps)
    g = torch.Generator().manual_seed(seed)
    losses, t0 = [], time.perf_counter()
    for _ in range(epochs):
        order = torch.randperm(len(ytr), generator=g)
        for k in range(len(ytr) // batch):
            idx = order[k * batch:(k + 1) * batch]
            opt.zero_grad(set_to_none=True)
            with plain(model, enabled=mode == "plain"):
                loss = F.cross_entropy(model(xtr[idx]), ytr[idx])
            loss.backward()
            opt.step()
            sched.step()
            losses.append(loss.item())
    seconds = time.perf_counter() - t0
    model.eval()
    with torch.no_grad():
        acc = float((model(xte).argmax(1) == yte).float().mean())
    return {"test_accuracy": acc, "final_loss": statistics.mean(losses[-10:]), "train_seconds": seconds}


def accuracy_table(archs: list[str], seeds: int, epochs: int, batch: int, lr: float, width: int) -> dict:
    data = digits()
    out = {"train_samples": len(data[0][1]), "test_samples": len(data[1][1]), "epochs": epochs, "batch": batch,
           "lr": lr, "width": width}
    for arch in archs:
        table = {}
        for mode in ("plain", "store8", "store4"):
            runs = [train_digits(arch, mode, s, data, epochs, batch, lr, width) for s in range(seeds)]
            accs = [r["test_accuracy"] for r in runs]
            table[mode] = {"accuracy": accs, "mean": statistics.mean(accs),
                           "std": statistics.stdev(accs) if len(accs) > 1 else 0.0,
                           "final_loss": [r["final_loss"] for r in runs],
                           "train_seconds": sum(r["train_seconds"] for r in runs)}
            print(arch, mode, table[mode]["mean"], flush=True)
        for mode in ("store8", "store4"):
            diffs = [a - b for a, b in zip(table[mode]["accuracy"], table["plain"]["accuracy"])]
            table[mode]["minus_exact_per_seed"] = diffs
            table[mode]["minus_exact_mean"] = statistics.mean(diffs)
        out[arch] = table
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--archs", nargs="+", default=["resnet18", "revnet"])
    p.add_argument("--batch", type=int, default=8, help="batch of the gradient-error table")
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--grad-seeds", type=int, default=3)
    p.add_argument("--seeds", type=int, default=3, help="training runs per mode on the digits")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--train-batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--width", type=int, default=16, help="stem width of the digits models")
    p.add_argument("--skip-digits", action="store_true")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result = {"torch": torch.__version__, "threads": torch.get_num_threads(),
              "gradients": {"batch": a.batch, "size": a.size, "widths": "default",
                            "by_arch": gradient_errors(a.archs, a.batch, a.size, a.grad_seeds)}}
    if not a.skip_digits:
        result["digits"] = accuracy_table(a.archs, a.seeds, a.epochs, a.train_batch, a.lr, a.width)
    write_json(result, a.out)


if __name__ == "__main__":
    main()
