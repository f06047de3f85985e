"""A training step replayed as a CUDA graph against the same step launched op by op (GPU only), for plain
autograd and each engine mode, with the kernels each launches and the gradients each gives.

    PYTHONPATH=. python benchmarks/cuda_graph.py --out results/cuda_graph.json

Each case is ``SIZE:VARIANT``: ``plain`` (autograd, every activation kept), an engine mode (``invert``,
``floor``, ``recompute``, ``store``, ``store8``, ``store4``) at ``--chunk-bytes`` (default 0: whole-batch
slices), or ``plan@BUDGET`` (the step ``plan_training`` sets up under BUDGET, its slices as planned). The step
is the trainer's micro-batch loop (``accumulate``) at ``--batch``: its forward, loss and backward, not the
optimizer's update. For each case: the median eager step, the median replay of the same step captured once as a
CUDA graph the way the trainer does it (``edgerev.train.graphs.StepGraphs``), CUDA's allocated peak of each, the
CUDA kernels one eager step launches (``torch.profiler``), and the largest difference between the gradients an
eager step and a replay give from the same weights and statistics. A case that cannot be captured is recorded
with its error and the next one runs.
"""

from __future__ import annotations

import argparse
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from _common import write_json

from edgerev import create_model, plain
from edgerev.layers import chunk_budget
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.sizes import parse_bytes
from edgerev.train.graphs import StepGraphs


def _model(arch: str, size: int, batch: int, variant: str, device: str):
    torch.manual_seed(0)
    model = create_model(arch).to(device).train()
    row: dict = {}
    if variant.startswith("plan@"):
        from edgerev.memory.plan.autoplan import plan_training

        budget = parse_bytes(variant[5:])
        tp = plan_training(model, size, budget, device, estimate=True, max_batch=batch, check=True, batches=[batch])
        tp.apply(model)
        row.update(modes=list(tp.modes or ()), slices=list(tp.slices or ()), micro_batch=tp.batch,
                   predicted_peak_bytes=tp.predicted_peak_bytes)
        parts = split_batch(batch, batch // tp.batch)
    else:
        if variant != "plain":
            model.set_modes(variant)
        parts = split_batch(batch, 1)
    return model, parts, row


def _grads(model) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]


def _cuda_kernels(step) -> int:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def case(arch: str, size: int, batch: int, variant: str, repeats: int, device: str = "cuda") -> dict:
    model, parts, row = _model(arch, size, batch, variant, device)
    row.update(size=size, batch=batch, variant=variant)
    x = torch.randn(batch, 3, size, size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    weights = {k: v.clone() for k, v in model.state_dict().items()}

    def step():
        with plain(model, variant == "plain"):
            return accumulate(model, x, (y,), parts, F.cross_entropy)

    def eager():
        model.zero_grad(set_to_none=True)
        return step()

    eager().read()  # warm-up: cuDNN's algorithms, the quantizer's compilation
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eager().read()
        times.append(time.perf_counter() - t)
    row["eager_seconds"] = statistics.median(times)
    row["cuda_kernels"] = _cuda_kernels(lambda: eager().read())
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    eager().read()
    row["eager_allocated_peak_bytes"] = torch.cuda.max_memory_allocated() - base
    model.load_state_dict(weights)
    loss = eager().read()
    reference = _grads(model)
    row["eager_loss"] = loss

    graphs = StepGraphs()  # the trainer's own: its key, capture stream and mode, its release

    def replayed():
        with plain(model, variant == "plain"):
            loss = graphs.step(model, x, (y,), len(parts), F.cross_entropy, parts)
        if loss is None:
            raise RuntimeError(f"not replayed: {graphs.report()['refused'] or 'the key did not repeat'}")
        return loss

    try:
        with plain(model, variant == "plain"):  # the eager steps above were this key's warm-up
            graphs.ran_eagerly(model, x, (y,), len(parts), F.cross_entropy)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        replayed().read()  # the capture and its first replay
        row["graph_allocated_peak_bytes"] = torch.cuda.max_memory_allocated() - base
        times = []
        for _ in range(repeats):
            torch.cuda.synchronize()
            t = time.perf_counter()
            replayed().read()
            times.append(time.perf_counter() - t)
        row["graph_seconds"] = statistics.median(times)
        row["graph_speedup"] = round(row["eager_seconds"] / row["graph_seconds"], 3)
        model.load_state_dict(weights)
        row["graph_loss"] = replayed().read()
        got = _grads(model)
        row["graph_max_relative_difference"] = max(
            float((g - r).abs().max() / r.abs().max().clamp_min(1e-30)) for g, r in zip(got, reference, strict=True))
        graphs.release()
    except Exception as e:  # noqa: BLE001 (recorded; the next case runs)
        row["graph_error"] = f"{type(e).__name__}: {e}"[:600]
        row["graph_traceback"] = traceback.format_exc()[-2000:]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--arch", default="revnext")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--cases", default="32:plain,32:invert,32:floor,32:recompute,32:store,32:store8,32:store4,"
                   "240:plain,240:plan@711MB,240:plan@610MB",
                   help="comma-separated SIZE:VARIANT (variant: plain, an engine mode, or plan@BUDGET)")
    p.add_argument("--chunk-bytes", type=int, default=0, help="slice budget of the mode cases (default 0: whole batch)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result: dict = {"arch": a.arch, "batch": a.batch, "chunk_bytes": a.chunk_bytes, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name(), "cases": []}
    with chunk_budget(a.chunk_bytes):
        for c in a.cases.split(","):
            size, variant = c.split(":", 1)
            try:
                result["cases"].append(case(a.arch, int(size), a.batch, variant, a.repeats))
            except Exception as e:  # noqa: BLE001
                result["cases"].append({"case": c, "error": f"{type(e).__name__}: {e}"[:600],
                                        "traceback": traceback.format_exc()[-2000:]})
            torch.cuda.empty_cache()
            write_json(result, a.out)


if __name__ == "__main__":
    main()
