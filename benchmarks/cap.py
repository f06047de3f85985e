"""What the CPU memory cap costs a training step, as ratios measured in one run, written as JSON.

Three ways to run the same step (revnext width 16, batch 64, 32x32 by default; the trainer's
``train_step``, SGD with Nesterov momentum), interleaved round by round so load on the machine
falls on all three alike:

* ``uncapped``: no cap;
* ``tracked``: the tracker on every step (a fresh ``CpuCap.over_alive`` each step: nothing is trusted, as
  the cap was before ``CpuCap``);
* ``capped``: the run's cap as the trainer uses it (``CpuCap``: the tracker verifies the first step
  of a (shapes, plan), the later steps are trusted).

The figure is the median step time of each, and ``capped / uncapped`` (target <= 1.05), on the wall
clock and in this process's CPU time (``time.process_time``: on a machine shared with other work,
the wall clock measures the neighbours as much as the step; CPU time with ``--threads 1`` does not).

    python benchmarks/cap.py --out results/cap.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
from _common import write_json

from edgerev.memory.measure.peak import fake_step_peak
from edgerev.models import create_model
from edgerev.train.cap import CpuCap, train_step


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", default="revnext")
    ap.add_argument("--width", type=int, default=16)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size", type=int, default=32)
    ap.add_argument("--steps", type=int, default=9, help="timed steps of each kind (after one warm-up each)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = create_model(args.arch, width=args.width)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, nesterov=True)
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, model.num_classes, (args.batch,))
    modes = tuple(str(m) for m in model.body.modes)
    # a budget the whole step fits in: its exact peak plus the optimizer's momentum, with room
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = 2 * (fake_step_peak(model, modes, args.batch, args.size) + params)
    baseline = sum(t.untyped_storage().nbytes() for t in [*model.parameters(), *model.buffers(), x, y]) + params
    cap = CpuCap(budget, baseline)

    def step(kind: str) -> tuple[float, float]:
        t0, c0 = time.perf_counter(), time.process_time()
        if kind == "uncapped":
            train_step(model, optimizer, x, y)
        elif kind == "tracked":
            train_step(model, optimizer, x, y, cap=CpuCap.over_alive(budget, model, optimizer, x, y))
        else:
            train_step(model, optimizer, x, y, cap=cap)
        return time.perf_counter() - t0, time.process_time() - c0

    kinds = ("uncapped", "tracked", "capped")
    times: dict[str, list[float]] = {k: [] for k in kinds}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    for k in kinds:
        step(k)  # warm-up; for ``capped`` this is the one verified step
    for _ in range(args.steps):
        for k in kinds:
            wall, used = step(k)
            times[k].append(wall)
            cpu[k].append(used)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    write_json({
        "arch": args.arch, "width": args.width, "batch": args.batch, "size": args.size, "steps": args.steps,
        "threads": torch.get_num_threads(), "budget_bytes": budget,
        "median_step_seconds": med, "step_seconds": times,
        "median_step_cpu_seconds": med_cpu, "step_cpu_seconds": cpu,
        "tracked_over_uncapped": med["tracked"] / med["uncapped"],
        "capped_over_uncapped": med["capped"] / med["uncapped"],
        "tracked_over_uncapped_cpu": med_cpu["tracked"] / med_cpu["uncapped"],
        "capped_over_uncapped_cpu": med_cpu["capped"] / med_cpu["uncapped"],
        "verified_steps": cap.verified_steps, "trusted_steps": cap.trusted_steps,
    }, args.out)


if __name__ == "__main__":
    main()
