"""Planner figures, written as JSON.

* budget sweep, revnext and resnet18: for budgets from the smallest feasible to "everything fits",
  the plan's predicted peak, the measured peak of real steps with it, and the solve time;
* speed of the plan against all-``invert`` (revnext) at a few budgets, measured in one run;
* ``store8``/``store4``: a short training run of a small model against exact training (final loss)
  and, per parameter, the gradient error against the batch-to-batch gradient spread.

    python benchmarks/planner.py --out results/planner.json
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
from edgerev.memory.measure.profile import load_or_measure, stage_stats
from edgerev.memory.plan.autoplan import is_plain, plan_model, plan_plain, verify
from edgerev.memory.solve.knapsack import smallest_budget


def sweep(arch: str, size: int, budgets_mb: list[float]) -> list[dict]:
    model = create_model(arch)
    rows = []
    if is_plain(model):
        stats = stage_stats(model.body.stages, torch.randn(8, 3, size, size))
        run = lambda b: plan_plain(model, size, b, stats=stats)  # noqa: E731
    else:
        profile = load_or_measure(model, size)
        rows.append({"smallest_budget_bytes": smallest_budget(profile)})
        run = lambda b: plan_model(model, size, b, profile=profile)  # noqa: E731
    for mb in budgets_mb:
        budget = int(mb * 2**20)
        try:
            p = run(budget)
        except Exception as e:  # budget below the smallest: recorded, not hidden
            rows.append({"budget_bytes": budget, "error": str(e)})
            continue
        plan_ = p.plan
        modes = None if is_plain(model) else plan_.modes
        segments = plan_.segments if is_plain(model) else None
        v = verify(model, modes, plan_.batch, size, segments=segments, slices=getattr(p, "slices", None))
        rows.append({
            "budget_bytes": budget, "batch": plan_.batch, "predicted_peak_bytes": plan_.predicted_peak_bytes,
            "fitted_peak_bytes": p.fitted_peak_bytes, "measured_peak_bytes": v["measured_peak_bytes"],
            "under_budget": v["measured_peak_bytes"] <= budget,
            "prediction_error": plan_.predicted_peak_bytes / v["measured_peak_bytes"] - 1,
            "solve_seconds": p.solve_seconds, "predicted_samples_per_second": plan_.samples_per_second,
            "measured_samples_per_second": v["measured_samples_per_second"],
            "modes": sorted(set(plan_.stage_modes() if is_plain(model) else plan_.modes)),
        })
    return rows


def step_seconds(model, x, y, repeats: int = 5) -> float:
    times = []
    for _ in range(repeats + 1):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        F.cross_entropy(model(x), y).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def plan_vs_invert(size: int, budgets_mb: list[float], batch: int | None = None) -> list[dict]:
    """Step time of the planner's plan, all-invert and all-store at the plan's batch, in one run.

    With ``batch`` fixed and a budget where everything fits, the plan should match all-store.
    """
    from edgerev.memory.solve.knapsack import plan as solve_plan

    model = create_model("revnext")
    profile = load_or_measure(model, size)
    rows = []
    for mb in budgets_mb:
        if batch is None:
            p = plan_model(model, size, int(mb * 2**20), profile=profile).plan
        else:
            p = solve_plan(profile, int(mb * 2**20), batches=[batch])
        x, y = torch.randn(p.batch, 3, size, size), torch.randint(0, 10, (p.batch,))
        model.set_modes(list(p.modes))
        t_plan = step_seconds(model, x, y)
        model.set_modes("invert")
        t_inv = step_seconds(model, x, y)
        model.set_modes("store")
        t_store = step_seconds(model, x, y)
        rows.append({"budget_bytes": int(mb * 2**20), "batch": p.batch, "plan_step_seconds": t_plan,
                     "invert_step_seconds": t_inv, "store_step_seconds": t_store,
                     "speedup_over_invert": t_inv / t_plan, "plan_over_store": t_plan / t_store,
                     "modes": {m: p.modes.count(m) for m in set(p.modes)}})
    return rows


def approximate(steps: int = 60, batch: int = 32, seed: int = 0) -> dict:
    """store8/store4 against exact training on a learnable synthetic task, same seed and data."""
    g = torch.Generator().manual_seed(seed)
    protos = torch.randn(10, 3, 16, 16, generator=g)
    def batch_of(n):
        y = torch.randint(0, 10, (n,), generator=g)
        return protos[y] + 0.8 * torch.randn(n, 3, 16, 16, generator=g), y
    data = [batch_of(batch) for _ in range(steps)]
    result = {}
    for mode in ("invert", "store8", "store4"):
        torch.manual_seed(seed)
        model = create_model("revnext", width=16, blocks=(1, 1, 1, 1, 1))
        model.set_modes(mode)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        losses = []
        for x, y in data:
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        result[mode] = {"final_loss": statistics.mean(losses[-10:])}
    # gradient error per parameter vs batch-to-batch spread, on one model state
    torch.manual_seed(seed)
    model = create_model("revnext", width=16, blocks=(1, 1, 1, 1, 1))
    def grads(x, y, mode):
        model.zero_grad(set_to_none=True)
        if mode == "plain":
            with plain(model):
                F.cross_entropy(model(x), y).backward()
        else:
            model.set_modes(mode)
            F.cross_entropy(model(x), y).backward()
        return {n: p.grad.clone() for n, p in model.named_parameters()}
    exact = [grads(x, y, "plain") for x, y in data[:8]]
    names = list(exact[0])
    mean = {n: torch.stack([e[n] for e in exact]).mean(0) for n in names}
    spread = {n: statistics.mean(float((e[n] - mean[n]).norm()) for e in exact) for n in names}
    for mode in ("store8", "store4"):
        approx = grads(*data[0], mode)
        ratios = [float((approx[n] - exact[0][n]).norm()) / spread[n] for n in names if spread[n] > 0]
        result[mode]["grad_error_over_batch_spread"] = {"median": statistics.median(ratios), "max": max(ratios)}
    for mode in ("store8", "store4"):
        result[mode]["loss_vs_exact"] = result[mode]["final_loss"] / result["invert"]["final_loss"] - 1
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    result = {
        "torch": torch.__version__, "threads": torch.get_num_threads(), "size": a.size,
        "sweep": {
            "revnext": sweep("revnext", a.size, [16, 20, 24, 32, 48, 64, 128, 256, 512]),
            "resnet18": sweep("resnet18", a.size, [24, 32, 48, 64, 128, 256, 512, 1024]),
        },
        "plan_vs_invert": plan_vs_invert(a.size, [24, 48, 64, 128, 256]),
        "everything_fits": plan_vs_invert(a.size, [4096], batch=32),
        "approximate": approximate(),
    }
    write_json(result, a.out)


if __name__ == "__main__":
    main()
