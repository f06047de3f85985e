"""Plan a model's training under a budget: profile (cached), solve, then check the plan's exact bytes.

:func:`plan_model` is what the CLI and the trainer call. The knapsack works on fitted per-stage
costs; the plan it returns is then run once on fake tensors (exact bytes, nothing allocated) and,
if it would pass the budget, solved again under a budget reduced by the overshoot, so the bytes a
plan is reported with are those of the whole step, not of the fit.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
from torch import nn

from edgerev.memory.planner import Plan, plan
from edgerev.memory.profile import Profile, fixed_bytes, load_or_measure


@dataclass(frozen=True)
class ModelPlan:
    plan: Plan
    profile: Profile
    fitted_peak_bytes: int  # the knapsack's own prediction
    solve_seconds: float

    def stages(self, model: nn.Module) -> list[dict]:
        return [{"name": n, "type": type(s).__name__, "mode": m}
                for (n, s), m in zip(model.body.stages.named_children(), self.plan.modes)]


def fake_step_peak(model: nn.Module, modes: tuple[str, ...] | None, batch: int, size: int,
                   segments: tuple | None = None) -> int:
    """Exact peak bytes of one training step with ``modes`` (or checkpoint ``segments``), on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from edgerev.memory.measure import step_peak
    from edgerev.memory.profile import _fake_copy

    with FakeTensorMode() as mode:
        fake = _fake_copy(model, mode)
        if modes is not None:
            fake.body.set_modes(list(modes))
        fake.body.segments = list(segments) if segments is not None else None
        return step_peak(fake, batch, size).peak_bytes


def is_plain(model: nn.Module) -> bool:
    """True when no stage of the model's body is invertible: it is planned with checkpoint segments."""
    return not any(hasattr(s, "forward_") for s in model.body.stages)


@dataclass(frozen=True)
class PlainPlan:
    plan: object  # reforward.SegmentPlan
    fitted_peak_bytes: int
    solve_seconds: float

    def stages(self, model: nn.Module) -> list[dict]:
        modes = self.plan.stage_modes()
        return [{"name": n, "type": type(s).__name__, "mode": m}
                for (n, s), m in zip(model.body.stages.named_children(), modes)]


def minimal_segments(model: nn.Module, size: int) -> tuple[tuple, int]:
    """The segmentation of least exact peak at batch 1 among the smallest candidates, and that peak."""
    from edgerev.memory.reforward import Segment

    n = len(model.body.stages)
    candidates = [tuple(Segment(i, i + 1, "store4") for i in range(n)), (Segment(0, n, "store4"),),
                  tuple(Segment(i, i + 1, "checkpoint") for i in range(n))]
    peaks = [fake_step_peak(model, None, 1, size, segments=c) for c in candidates]
    k = min(range(len(candidates)), key=peaks.__getitem__)
    return candidates[k], peaks[k]


def plan_plain(model: nn.Module, size: int, budget: int, device: str = "cpu", stats=None, check: bool = True,
               rounds: int = 4, batches: list[int] | None = None) -> PlainPlan:
    """Checkpoint segments for a plain model (see :mod:`edgerev.memory.reforward`), checked like :func:`plan_model`."""
    from dataclasses import replace as dc_replace

    from edgerev.memory.planner import BudgetTooSmall
    from edgerev.memory.reforward import SegmentPlan, plan_segments, stage_stats

    if budget <= 0:
        raise BudgetTooSmall(budget, 0)
    floor_segments, floor = minimal_segments(model, size) if check else ((), 0)
    if budget < floor:
        raise BudgetTooSmall(budget, floor)
    if stats is None:
        x = torch.randn(8, model.in_channels, size, size, device=device)
        stats = stage_stats(model.body.stages, x)
    fixed = fixed_bytes(model)
    target, solve = budget, 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        try:
            p = plan_segments(stats, target, fixed, **({"batches": batches} if batches else {}))
        except BudgetTooSmall:
            break
        solve = time.perf_counter() - t0
        if not check:
            return PlainPlan(p, p.predicted_peak_bytes, solve)
        exact = fake_step_peak(model, None, p.batch, size, segments=p.segments)
        if exact <= budget:
            return PlainPlan(dc_replace(p, predicted_peak_bytes=exact), p.predicted_peak_bytes, solve)
        target -= exact - budget + max(1, budget // 200)  # the fit missed by a roughly constant amount
    if not check:
        raise BudgetTooSmall(budget, floor)
    step = sum(s.forward_seconds.at(1) * 2 + s.backward_seconds.at(1) for s in stats)
    return PlainPlan(SegmentPlan(1, floor_segments, floor, step), floor, solve)


def minimal_modes(model: nn.Module) -> tuple[str, ...]:
    """Per stage, the mode that keeps least: invert, else recompute, else a 4-bit copy."""
    from edgerev.engine import supported_modes

    out = []
    for stage in model.body.stages:
        names = [m.value for m in supported_modes(stage)]
        out.append(next(m for m in ("invert", "recompute", "store4") if m in names))
    return tuple(out)


def plan_model(model: nn.Module, size: int, budget: int, device: str = "cpu", profile: Profile | None = None,
               check: bool = True, rounds: int = 4, batches: list[int] | None = None) -> ModelPlan:
    """The fastest plan for ``model`` at ``size`` under ``budget`` bytes (see the module docstring).

    Before anything is profiled, batch 1 in :func:`minimal_modes` is run on fake tensors: a budget
    below its exact peak is refused at once, and that peak is the smallest budget the error names.
    Any budget at or above it gets a plan (that one, if nothing faster fits).

    Args:
        batches: the batch sizes to consider (default: the planner's sweep up to 4096).
    """
    from edgerev.memory.planner import BudgetTooSmall

    if budget <= 0:
        raise BudgetTooSmall(budget, 0)
    floor_modes = minimal_modes(model)
    floor = fake_step_peak(model, floor_modes, 1, size) if check else 0
    if budget < floor:
        raise BudgetTooSmall(budget, floor)
    profile = profile or load_or_measure(model, size, device)
    target = budget
    solve = 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        try:
            p = plan(profile, target, batches=batches)
        except BudgetTooSmall:
            break
        solve = time.perf_counter() - t0
        if not check:
            return ModelPlan(p, profile, p.predicted_peak_bytes, solve)
        exact = fake_step_peak(model, p.modes, p.batch, size)
        if exact <= budget:
            return ModelPlan(replace(p, predicted_peak_bytes=exact), profile, p.predicted_peak_bytes, solve)
        target -= exact - budget + max(1, budget // 200)  # the fit missed by a roughly constant amount
    if not check:
        raise BudgetTooSmall(budget, floor)
    seconds = sum(profile.stages[i][m].seconds.at(1) for i, m in enumerate(floor_modes))
    return ModelPlan(Plan(1, floor_modes, floor, seconds), profile, floor, solve)


def verify(model: nn.Module, modes: tuple[str, ...] | None, batch: int, size: int, device: str = "cpu",
           steps: int = 2, segments: tuple | None = None) -> dict:
    """Run real training steps with the plan: measured peak bytes and seconds per step."""
    from edgerev.memory.measure import step_peak

    if modes is not None:
        model.body.set_modes(list(modes))
    model.body.segments = list(segments) if segments is not None else None
    peak = step_peak(model, batch, size, device).peak_bytes
    x = torch.randn(batch, model.in_channels, size, size, device=device)
    y = torch.randint(0, model.num_classes, (batch,), device=device)
    times = []
    for _ in range(steps + 1):
        model.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    step = min(times[1:])
    return {"measured_peak_bytes": peak, "measured_step_seconds": step, "measured_samples_per_second": batch / step}


@dataclass(frozen=True)
class TrainingPlan:
    """What a training run needs from the planner: a micro-batch, and modes or checkpoint segments."""

    batch: int
    modes: tuple[str, ...] | None
    segments: tuple | None
    predicted_peak_bytes: int
    summary: dict  # for the CLI's and the trainer's reports (JSON-ready)

    def apply(self, model: nn.Module) -> None:
        if self.modes is not None:
            model.body.set_modes(list(self.modes))
        model.body.segments = list(self.segments) if self.segments is not None else None


def plan_training(model: nn.Module, size: int, budget: int, device: str = "cpu", estimate: bool = False,
                  max_batch: int | None = None) -> TrainingPlan:
    """Plan ``model`` under ``budget``: stage modes for an invertible body, checkpoint segments for a
    plain one; the plan's bytes are checked exactly on fake tensors (on CPU, where they are exact).

    Args:
        estimate: estimate the stage costs from FLOPs instead of measuring them (quick, less exact).
        max_batch: consider micro-batches up to this size only (a trainer's batch).
    """
    from edgerev.memory.planner import _default_batches
    from edgerev.memory.profile import load_or_measure

    check = device == "cpu"
    batches = None
    if max_batch is not None:
        batches = sorted({b for b in _default_batches() if b <= max_batch} | {max_batch})
    if is_plain(model):
        pp = plan_plain(model, size, budget, device, check=check, batches=batches)
        segments = pp.plan.segments
        summary = {"planner": "checkpoint segments", "batch": pp.plan.batch,
                   "predicted_peak_bytes": pp.plan.predicted_peak_bytes, "fitted_peak_bytes": pp.fitted_peak_bytes,
                   "samples_per_second": pp.plan.samples_per_second, "solve_seconds": pp.solve_seconds,
                   "segments": [{"start": s.start, "end": s.end, "mode": s.mode} for s in segments],
                   "stages": pp.stages(model)}
        return TrainingPlan(pp.plan.batch, None, segments, pp.plan.predicted_peak_bytes, summary)
    profile = load_or_measure(model, size, device, estimate=estimate)
    mp = plan_model(model, size, budget, device, profile=profile, check=check, batches=batches)
    summary = {"planner": f"stage modes ({profile.source} profile)", "batch": mp.plan.batch,
               "predicted_peak_bytes": mp.plan.predicted_peak_bytes, "fitted_peak_bytes": mp.fitted_peak_bytes,
               "samples_per_second": mp.plan.samples_per_second, "solve_seconds": mp.solve_seconds,
               "stages": mp.stages(model)}
    return TrainingPlan(mp.plan.batch, mp.plan.modes, None, mp.plan.predicted_peak_bytes, summary)
