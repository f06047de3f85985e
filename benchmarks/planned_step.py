"""A training step as the planner sets it up under a cap, timed against plain autograd on the same device, with
its kernel launches (counted on the meta device) and its peak against the prediction; and the engine's gradients
against plain autograd's on that device.

    PYTHONPATH=. python benchmarks/planned_step.py --device cuda --out results/planned_step.json

Each case plans ``--arch`` at one size under one budget the way the trainer does (stage modes, micro-batch and
per-stage batch slices; ``--batches`` fixes the micro-batch, the paper's step is batch 32), applies the plan and
times ``--repeats`` steps of it and of plain autograd in turn (the median of each; plain autograd's peak is read
too). The gradient check runs every engine mode on a small batch and compares each parameter's gradient with plain
autograd's (largest relative difference and the cosine over all parameters): kernels that differ between the CPU
and a GPU (fused batch-norm reductions, in-place leaky ReLU gradients, multi-tensor ops) are checked where they run.
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
from edgerev.engine import supported_modes
from edgerev.memory.measure.profile import FlopCounter
from edgerev.memory.measure.tracker import CudaPeak
from edgerev.memory.plan.autoplan import plan_training
from edgerev.sizes import parse_bytes


def _sync(device: str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def _step(model, x, y) -> None:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x), y).backward()


def kernel_ops(arch: str, batch: int, size: int, plan=None) -> dict:
    """Kernel launches of one step on the meta device: plain autograd's (``plan`` None) or the plan's."""
    torch.manual_seed(0)
    model = create_model(arch).to("meta").train()
    if plan is not None:
        plan.apply(model)
    x = torch.randn(batch, 3, size, size, device="meta")
    y = torch.randint(0, 10, (batch,), device="meta")
    counter = FlopCounter()
    with plain(model, plan is None), counter:
        F.cross_entropy(model(x), y).backward()
    return {"kernels": counter.kernels, "flops": counter.total, "syncs": counter.syncs}


def planned_case(arch: str, size: int, budget: int, batches: list[int] | None, device: str, repeats: int) -> dict:
    torch.manual_seed(0)
    model = create_model(arch).to(device).train()
    t0, c0 = time.perf_counter(), time.process_time()
    tp = plan_training(model, size, budget, device, estimate=True, max_batch=max(batches or [32]), check=True,
                       batches=batches)
    row = {"size": size, "budget_bytes": budget, "micro_batch": tp.batch, "modes": list(tp.modes or ()),
           "slices": list(tp.slices or ()), "predicted_peak_bytes": tp.predicted_peak_bytes,
           "plan_wall_seconds": round(time.perf_counter() - t0, 1),
           "plan_cpu_seconds": round(time.process_time() - c0, 1)}
    tp.apply(model)
    x = torch.randn(tp.batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (tp.batch,), device=device)
    times: dict[str, list[float]] = {"plan": [], "plain": []}
    for r in range(repeats + 1):
        for v in times:
            _sync(device)
            t = time.perf_counter()
            with plain(model, v == "plain"):
                _step(model, x, y)
            _sync(device)
            if r:
                times[v].append(time.perf_counter() - t)
    row["step_seconds"] = {v: statistics.median(t) for v, t in times.items()}
    row["relative_to_plain"] = round(row["step_seconds"]["plan"] / row["step_seconds"]["plain"], 3)
    if torch.device(device).type == "cuda":
        for v in times:
            with plain(model, v == "plain"), CudaPeak(device) as peak:
                _step(model, x, y)
            row[f"{v}_allocated_peak_bytes"] = peak.peak
            row[f"{v}_reserved_peak_bytes"] = peak.reserved
        row["allocated_over_predicted"] = round(row["plan_allocated_peak_bytes"] / tp.predicted_peak_bytes, 4)
    ops = kernel_ops(arch, tp.batch, size, tp)
    base = kernel_ops(arch, tp.batch, size)
    row.update(kernels=ops["kernels"], plain_kernels=base["kernels"],
               kernels_relative_to_plain=round(ops["kernels"] / base["kernels"], 3), syncs=ops["syncs"])
    return row


def gradient_check(arch: str, batch: int, size: int, device: str) -> list[dict]:
    """Every engine mode's parameter gradients against plain autograd's, same weights and batch, on ``device``."""
    torch.manual_seed(0)
    model = create_model(arch).to(device).train()
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with plain(model):
        _step(model, x, y)
    ref = {n: p.grad.clone() for n, p in model.named_parameters()}
    modes = sorted({m.value for s in model.body.stages for m in supported_modes(s)})
    rows = []
    for mode in modes:
        model.load_state_dict(state)  # the same batch statistics as plain's step
        model.set_modes(mode)
        _step(model, x, y)
        worst, dot, n1, n2 = 0.0, 0.0, 0.0, 0.0
        for name, p in model.named_parameters():
            g, r = p.grad.double(), ref[name].double()
            worst = max(worst, float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)))
            dot, n1, n2 = dot + float((g * r).sum()), n1 + float((g * g).sum()), n2 + float((r * r).sum())
        rows.append({"mode": mode, "max_relative_difference": worst, "cosine": dot / (n1 * n2) ** 0.5})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="revnext")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--cases", default="240:711MB,240:610MB,32:47.4MB",
                   help="comma-separated SIZE:BUDGET (default: the paper's shape under 1.10x the lean invert and floor "
                        "peaks, and 32x32 under 1.10x the lean invert peak)")
    p.add_argument("--batches", default="32", help="micro-batches the planner may choose (default 32: the paper's "
                   "step; empty: any up to 32)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--check-batch", type=int, default=8)
    p.add_argument("--check-size", type=int, default=32)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    batches = [int(b) for b in a.batches.split(",") if b] or None
    result: dict = {"arch": a.arch, "device": a.device, "torch": torch.__version__, "cases": []}
    if a.device == "cuda":
        result["gpu"] = torch.cuda.get_device_name()
    result["gradients"] = gradient_check(a.arch, a.check_batch, a.check_size, a.device)
    write_json(result, a.out)
    for case in a.cases.split(","):
        size, budget = case.split(":")
        try:
            result["cases"].append(planned_case(a.arch, int(size), parse_bytes(budget), batches, a.device, a.repeats))
        except Exception as e:  # noqa: BLE001 (one case's failure is recorded; the next one runs)
            result["cases"].append({"case": case, "error": f"{type(e).__name__}: {e}"[:500]})
        if a.device == "cuda":
            torch.cuda.empty_cache()
        write_json(result, a.out)


if __name__ == "__main__":
    main()
