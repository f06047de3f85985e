"""Where a planned CUDA step's allocated peak goes beyond its prediction (GPU only): the blocks live at the peak,
grouped by the project's line that asked for them.

    PYTHONPATH=. python benchmarks/cuda_peak.py --out results/cuda_peak.json

Plans ``--arch`` at ``--size`` under each of ``--budgets`` as the trainer does (batch 32), runs one warm step, then
one more with the allocator's history recorded (``torch.cuda.memory._record_memory_history``, Python frames),
replays the history to the moment the most bytes were allocated, and writes what was live then: every block's
size and the innermost frame of edgerev (file, line, function) and of torch that allocated it, summed by that
line. The same step is measured with cuDNN off too (no workspaces, slower convolutions), so that what cuDNN
adds at the peak is read apart from what the step itself holds; with ``--capped``, under the budget as the
allocator's cap (as the trainer runs it), where cuDNN falls back to algorithms whose workspace fits. Each case
records the plan's prediction (cuBLAS's workspaces and each convolution's own counted, as a plan made on the
device counts them: ``libraries``), the allocator's whole peak over it (``allocated_over_predicted``), and with
``--tracker`` the step's live tensors counted on the device; ``--time N`` times N planned steps against plain
autograd's.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json

from edgerev import create_model
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.memory.plan.autoplan import plan_training
from edgerev.sizes import parse_bytes

MB = 1e6


def _frame(frames: list[dict], part: str) -> str:
    for f in frames:
        name = f.get("filename", "")
        if part in name and "benchmarks" not in name:
            return f"{name.split(part, 1)[1]}:{f.get('line')} {f.get('name')}"
    return "?"


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replay an allocator trace: the most bytes allocated at once, and the blocks live at that moment."""
    live: dict[int, dict] = {}
    total = best = 0
    best_live: list[dict] = []
    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = e
            total += e["size"]
            if total > best:
                best, best_live = total, list(live.values())
        elif e["action"] in ("free_requested",) and e["addr"] in live:
            total -= live.pop(e["addr"])["size"]
    return best, best_live


def _timed(step, n: int, reset_peaks: bool = False) -> float:
    """Seconds per step over ``n`` steps after a warm one (the allocator's peaks reset after it, if asked)."""
    step()
    torch.cuda.synchronize()
    if reset_peaks:
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(n):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def case(arch: str, size: int, budget: int, batch: int, top: int, capped: bool, tracker: bool = False,
         timed: int = 0, trace: bool = True) -> dict:
    torch.manual_seed(0)
    model = create_model(arch).cuda().train()
    t0 = time.perf_counter()
    tp = plan_training(model, size, budget, "cuda", estimate=True, max_batch=batch, check=True, batches=[batch])
    plan_seconds = time.perf_counter() - t0
    tp.apply(model)
    parts = split_batch(batch, batch // tp.batch)
    x = torch.randn(batch, 3, size, size, device="cuda")
    y = torch.randint(0, model.num_classes, (batch,), device="cuda")

    def step():
        model.zero_grad(set_to_none=True)
        accumulate(model, x, (y,), parts, F.cross_entropy).read()

    row = {"size": size, "budget_bytes": budget, "predicted_peak_bytes": tp.predicted_peak_bytes,
           "modes": list(tp.modes or ()), "slices": list(tp.slices or ()),
           "account": tp.account.as_dict() if tp.account is not None else None,
           "libraries": tp.summary.get("libraries"), "plan_seconds": round(plan_seconds, 2)}
    if timed:  # the planned step against plain autograd's whole batch, same weights and data
        from edgerev import plain

        row["step_seconds"] = _timed(step, timed)
        with plain(model):
            row["plain_step_seconds"] = _timed(step, timed)
        row["relative_to_plain"] = row["step_seconds"] / row["plain_step_seconds"]
        torch.cuda.empty_cache()
    for cudnn in (True, False):
        with torch.backends.cudnn.flags(enabled=cudnn):
            step()
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            row[f"allocated_peak_bytes_cudnn_{'on' if cudnn else 'off'}"] = torch.cuda.max_memory_allocated() - base
            row[f"allocated_peak_raw_bytes_cudnn_{'on' if cudnn else 'off'}"] = torch.cuda.max_memory_allocated()
            row[f"reserved_peak_bytes_cudnn_{'on' if cudnn else 'off'}"] = torch.cuda.max_memory_reserved()
    # the allocator's whole peak (weights, batch and cuBLAS's workspaces included, as the prediction counts them)
    row["allocated_over_predicted"] = round(row["allocated_peak_raw_bytes_cudnn_on"] / tp.predicted_peak_bytes, 4)
    row["baseline_bytes"] = base
    if tracker:  # the live tensors of the same step on the device: what the allocator holds beyond them
        from edgerev.memory.measure.tracker import MemoryTracker

        step()
        with MemoryTracker() as t:
            step()
        row["tracker_peak_bytes"] = t.peak
        row["tracker_peak_op"] = str(t.peak_op)
    if capped:  # as the trainer runs it: the allocator may reserve at most the budget, workspaces included
        from edgerev.train.cap import apply_cuda_cap

        times = {}
        for cap in (False, True):
            if cap:
                torch.cuda.empty_cache()
                apply_cuda_cap(budget)
            try:
                times[cap] = _timed(step, 3, reset_peaks=True)
                if cap:
                    row["capped_allocated_peak_bytes"] = torch.cuda.max_memory_allocated()
                    row["capped_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()
            except torch.cuda.OutOfMemoryError as e:
                row["capped_error"] = str(e).splitlines()[0][:300]
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
        row["step_seconds_uncapped_capped"] = [times.get(False), times.get(True)]
    if not trace:
        return row
    step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(stacks="python", max_entries=2_000_000)
    step()
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    peak, blocks = live_at_peak(trace)
    row["traced_peak_bytes"] = peak
    groups: dict[str, list[int]] = defaultdict(list)
    for b in blocks:
        frames = b.get("frames", [])
        groups[f"{_frame(frames, 'edgerev/')} <- {_frame(frames, 'torch/')}"].append(b["size"])
    row["live_at_peak"] = [{"where": k, "blocks": len(v), "mb": round(sum(v) / MB, 2),
                            "sizes_mb": sorted((round(s / MB, 3) for s in v), reverse=True)[:8]}
                           for k, v in sorted(groups.items(), key=lambda kv: -sum(kv[1]))[:top]]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="revnext")
    p.add_argument("--size", type=int, default=240)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--budgets", default="711MB,610MB")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--capped", action="store_true", help="also run the step under the budget as the allocator's cap "
                   "(absolute: the process's weights and batch included), timed against the uncapped step")
    p.add_argument("--tracker", action="store_true", help="count the step's live tensors on the device too")
    p.add_argument("--time", type=int, default=0, help="time this many planned steps and plain autograd's")
    p.add_argument("--no-trace", dest="trace", action="store_false", help="skip the allocator's history")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result = {"arch": a.arch, "torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "cases": []}
    for b in a.budgets.split(","):
        try:
            result["cases"].append(case(a.arch, a.size, parse_bytes(b), a.batch, a.top, a.capped, a.tracker, a.time,
                                        a.trace))
        except Exception as e:  # noqa: BLE001 (a budget the plan refuses, an error of one case: recorded, next one)
            result["cases"].append({"budget": b, "error": f"{type(e).__name__}: {e}"[:500]})
        torch.cuda.empty_cache()
        write_json(result, a.out)


if __name__ == "__main__":
    main()
