"""Where a CUDA step's memory goes beyond its plan: cuDNN's workspaces, with and without the cap (GPU only).

    PYTHONPATH=. python benchmarks/cuda_workspace.py --out results/cuda_workspace.json

The GTX 750 recipe's model (RevNeXt width 32, 32x32, steps of 256) planned at several budgets with the
estimated profile; for each plan one step without a cap, with cuDNN on and off (allocated and reserved
peaks against the prediction), then 30 steps with momentum under the 400 MiB cap, cuDNN on and off, counting
out-of-memory errors (the first messages kept) as the trainer's halving would meet them. Rows are written as
they finish. Measured on an H100: docs/concepts/measurements.md.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import replace
from pathlib import Path

import torch
from _common import write_json

ROOT = Path(__file__).resolve().parent.parent
MiB = 2**20


def main() -> None:
    from edgerev.memory.measure.microbatch import accumulate, split_batch
    from edgerev.memory.plan.autoplan import plan_training
    from edgerev.models import create_model
    from edgerev.train.cap import apply_cuda_cap
    from edgerev.train.config import load_config
    from edgerev.train.memory import loss_of, step_shape

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=ROOT / "results" / "cuda_workspace.json")
    p.add_argument("--budgets", default="400,320,250", help="planning budgets in MiB (default 400,320,250)")
    p.add_argument("--cap", type=int, default=400, help="the cap in MiB for the capped steps (default 400)")
    p.add_argument("--steps", type=int, default=30, help="capped steps per plan (default 30)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA device")
    cfg = load_config(ROOT / "configs" / "gtx750.yaml")
    cfg = replace(cfg, memory=replace(cfg.memory, profile="estimate"))
    dev, loss, batch = torch.device("cuda"), loss_of(cfg), 256
    budgets = [int(b) for b in args.budgets.split(",")]
    rows: list[dict] = []
    x = torch.randn(batch, 3, cfg.data.size, cfg.data.size, device=dev)
    y = torch.randint(0, 10, (batch,), device=dev)

    def planned(budget_mib: int):
        torch.manual_seed(0)
        model = create_model(cfg.model.arch, **cfg.model.args, num_classes=10).to(dev)
        tp = plan_training(model, cfg.data.size, budget_mib * MiB, "cuda", estimate=True, max_batch=batch,
                           step=step_shape(cfg, model, None, batch), loss_fn=loss)
        tp.apply(model)
        return model, tp

    def row(**kw) -> None:
        rows.append(kw)
        print(kw, flush=True)
        write_json({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "cudnn": torch.backends.cudnn.version(), "rows": rows}, args.out)

    for cudnn in (True, False):  # one step of each plan, no cap
        torch.backends.cudnn.enabled = cudnn
        for b in budgets:
            model, tp = planned(b)
            parts = split_batch(batch, math.ceil(batch / tp.batch))
            accumulate(model, x, (y,), parts, loss)  # warm-up: one-time allocations (cuBLAS's workspace)
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            accumulate(model, x, (y,), parts, loss)
            torch.cuda.synchronize()
            row(cap_mib=None, cudnn=cudnn, plan_mib=b, micro_batch=tp.batch,
                predicted_mib=tp.predicted_peak_bytes / MiB, allocated_mib=torch.cuda.max_memory_allocated() / MiB,
                reserved_mib=torch.cuda.max_memory_reserved() / MiB, step_seconds=time.perf_counter() - t0)
            del model
    apply_cuda_cap(args.cap * MiB, dev)
    for cudnn in (True, False):  # steps with momentum under the cap
        torch.backends.cudnn.enabled = cudnn
        for b in budgets:
            model, tp = planned(b)
            opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            micro, ooms, messages, t0 = math.ceil(batch / tp.batch), [], [], time.perf_counter()
            for step in range(args.steps):
                while True:
                    opt.zero_grad(set_to_none=True)
                    try:
                        accumulate(model, x, (y,), split_batch(batch, micro), loss)
                        break
                    except torch.cuda.OutOfMemoryError as e:
                        ooms.append(step)
                        messages.append(str(e).splitlines()[0][:300])
                        opt.zero_grad(set_to_none=True)
                        torch.cuda.empty_cache()
                        micro *= 2
                opt.step()
            torch.cuda.synchronize()
            row(cap_mib=args.cap, cudnn=cudnn, plan_mib=b, micro_batch=tp.batch,
                predicted_mib=tp.predicted_peak_bytes / MiB, oom_steps=ooms, oom_messages=messages[:2],
                micro_batches_at_end=micro, allocated_mib=torch.cuda.max_memory_allocated() / MiB,
                reserved_mib=torch.cuda.max_memory_reserved() / MiB,
                step_seconds=(time.perf_counter() - t0) / args.steps)
            del model, opt


if __name__ == "__main__":
    main()
