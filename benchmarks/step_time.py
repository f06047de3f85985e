"""Training-step time of each engine mode relative to plain autograd: same weights, same run.

Every repeat times one step (forward, cross-entropy, backward) of each variant in turn, so drift in
machine load touches all variants alike; the figure per variant is the median over repeats.
Writes JSON (``--out``) and prints it.

    python benchmarks/step_time.py --arch revnext --batch 32 --size 32 --out results/step_time.json
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json

from edgerev import create_model, plain
from edgerev.layers import chunk_budget
from edgerev.memory.measure.peak import measure


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def time_steps(arch: str, batch: int, size: int, device: str, repeats: int, warmup: int,
               modes: list[str]) -> dict[str, list[float]]:
    torch.manual_seed(0)
    model = create_model(arch).to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    variants = ["plain", *modes]
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(warmup + repeats):
        for v in variants:
            model.zero_grad(set_to_none=True)
            if v != "plain":
                model.set_modes(v)
            _sync(device)
            t0 = time.perf_counter()
            with plain(model, v == "plain"):
                F.cross_entropy(model(x), y).backward()
            _sync(device)
            if r >= warmup:
                times[v].append(time.perf_counter() - t0)
    return times


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="revnext")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--chunk-bytes", type=int, default=1 << 20)
    p.add_argument("--modes", default="invert,floor,recompute,store")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    modes = [m for m in a.modes.split(",") if m]
    with chunk_budget(a.chunk_bytes):
        times = time_steps(a.arch, a.batch, a.size, a.device, a.repeats, a.warmup, modes)
        mem = {}
        for m in modes:
            # bytes per pixel of the same configuration (CPU tracker; CUDA allocator on a GPU)
            mem[m] = measure(a.arch, a.batch, a.size, device=a.device, modes=m)["bytes_per_pixel"]
    base = statistics.median(times["plain"])
    result = {
        "arch": a.arch, "batch": a.batch, "size": a.size, "device": a.device, "chunk_bytes": a.chunk_bytes,
        "repeats": a.repeats, "torch": torch.__version__, "threads": torch.get_num_threads(),
        "machine": platform.processor() or platform.machine(),
        "median_seconds": {v: statistics.median(t) for v, t in times.items()},
        "relative_to_plain": {v: statistics.median(t) / base for v, t in times.items()},
        "bytes_per_pixel": mem,
    }
    write_json(result, a.out)


if __name__ == "__main__":
    main()
