"""The ``floor`` mode against ``invert`` and plain autograd: bytes per pixel, step time, gradient error, as JSON.

* ``bytes_per_pixel``: RevNeXt (stem width 32) at 240x240, the slope of the step's peak between batch B
  and 2B per input pixel, image included, for B in ``--batches``: predicted with fake tensors (the CPU
  tracker counts the same bytes for real, ``--real`` checks it), as ``edgerev memory --fake`` does.
* ``step_time``: one training step of plain autograd, ``invert`` and ``floor`` in turn, repeated; the
  ratio of medians to plain, all from the same run (drift in the machine's load touches all alike).
* ``float64``: the largest relative error (Frobenius norm) of a parameter gradient against plain
  autograd on the same weights and batch; ``float32``: the smallest per-parameter cosine.

    python benchmarks/floor.py --out results/floor.json
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json
from step_time import time_steps

from edgerev import create_model, plain
from edgerev.layers import chunk_budget
from edgerev.memory.measure.peak import measure, step_peak


def plain_bytes_per_pixel(batch: int, size: int) -> float:
    """The slope for plain autograd (everything stored), on fake tensors."""
    from edgerev._torchapi import fake_mode

    with fake_mode():
        model = create_model("revnext")
        with plain(model):
            first = step_peak(model, batch, size).peak_bytes
            second = step_peak(model, 2 * batch, size).peak_bytes
    return (second - first) / (batch * size * size)


def memory(batches: list[int], size: int, real: bool) -> dict:
    out: dict = {}
    for b in batches:
        row = {m: measure("revnext", b, size, fake=True, modes=m)["bytes_per_pixel"] for m in ("floor", "invert")}
        row["plain"] = plain_bytes_per_pixel(b, size)
        if real:
            row["floor_measured_for_real"] = measure("revnext", b, size, modes="floor")["bytes_per_pixel"]
        out[str(b)] = row
    return out


def step_times(batch: int, size: int, repeats: int, warmup: int) -> dict:
    times = time_steps("revnext", batch, size, "cpu", repeats, warmup, ["invert", "floor"])
    base = statistics.median(times["plain"])
    return {"batch": batch, "size": size, "repeats": repeats, "threads": torch.get_num_threads(),
            "seconds": times, "median_seconds": {v: statistics.median(t) for v, t in times.items()},
            "relative_to_plain": {v: statistics.median(t) / base for v, t in times.items()}}


def _grads(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, reference: bool) -> list[torch.Tensor]:
    state = {k: v.clone() for k, v in model.state_dict().items()}  # both runs start from the same statistics
    model.zero_grad(set_to_none=True)
    with plain(model, reference):
        F.cross_entropy(model(x), y).backward()
    model.load_state_dict(state)
    return [p.grad.clone() for p in model.parameters()]


def gradient_error(batch: int, size: int, seeds: int) -> dict:
    rel64, cos32 = [], []
    for seed in range(seeds):
        for dtype in (torch.float64, torch.float32):
            torch.manual_seed(seed)
            model = create_model("revnext").to(dtype).train()
            model.set_modes("floor")
            x = torch.randn(batch, 3, size, size, dtype=dtype)
            y = torch.randint(0, model.num_classes, (batch,))
            ref, got = _grads(model, x, y, True), _grads(model, x, y, False)
            if dtype == torch.float64:
                rel64.append(max(((a - b).norm() / b.norm().clamp_min(1e-300)).item() for a, b in zip(got, ref)))
            else:
                cos32.append(min(F.cosine_similarity(a.flatten(), b.flatten(), dim=0).item() for a, b in zip(got, ref)))
    return {"batch": batch, "size": size, "seeds": seeds, "float64_max_relative_error": max(rel64),
            "float32_min_cosine": min(cos32)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="8,16", help="batch sizes B of the memory slopes (B to 2B)")
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--real", action="store_true", help="also measure floor's slope on real tensors (slow)")
    p.add_argument("--time-batch", type=int, default=8)
    p.add_argument("--time-size", type=int, default=240)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--skip", default="", help="comma-separated parts to leave out: memory, time, gradients")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    skip = set(a.skip.split(","))
    result: dict = {"torch": torch.__version__, "chunk_bytes": a.chunk_bytes}
    with chunk_budget(a.chunk_bytes):
        if "gradients" not in skip:
            result["gradients"] = gradient_error(4, 32, 2)
        if "memory" not in skip:
            result["bytes_per_pixel"] = memory([int(b) for b in a.batches.split(",")], a.size, a.real)
        if "time" not in skip:
            result["step_time"] = step_times(a.time_batch, a.time_size, a.repeats, a.warmup)
    write_json(result, a.out)


if __name__ == "__main__":
    main()
