"""Plan a training step under a budget: one loop for reversible and plain models alike.

:func:`plan_training` is what the trainer, ``edgerev plan`` and the daemon call. The loop:

1. the *floor*: batch 1 in the least-memory plan, its whole step accounted exactly on fake tensors
   (:func:`edgerev.memory.account.account_step`); a budget below it is refused at once, naming it,
   before anything is profiled;
2. *solve*: a solver proposes the fastest plan its fitted costs say fits (stage modes by the
   knapsack of :mod:`edgerev.memory.knapsack` for an invertible body, checkpoint segments by
   :mod:`edgerev.memory.segments` for a plain one);
3. *check*: the proposal's whole step is accounted exactly; if it passes the budget, the solver is
   asked again under a budget reduced by the overshoot (*shrink*), a few rounds, and the floor plan
   is the answer if nothing faster fits.

So the bytes a plan is reported with are those of the whole step, the figure an error names is a
budget that trains, and the two kinds of model differ only in their solver.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch import Tensor, nn

from edgerev.engine import supported_modes
from edgerev.layers.base import Invertible
from edgerev.memory import profile as profiles
from edgerev.memory.account import StepAccount, StepShape, account_step, beyond_model
from edgerev.memory.costs import BudgetTooSmall, Plan, Profile, Segment, SegmentPlan, StageStats
from edgerev.memory.graph import planned
from edgerev.memory.knapsack import default_batches, plan, smallest_budget
from edgerev.memory.measure import apply_plan, fake_step_peak, step_peak
from edgerev.memory.segments import plan_segments
from edgerev.models.spec import model_spec


@dataclass(frozen=True)
class Proposal:
    """What a solver proposes: a micro-batch and modes or segments, with the solver's own figures."""

    batch: int
    modes: tuple[str, ...] | None
    segments: tuple[Segment, ...] | None
    fitted_peak_bytes: int
    step_seconds: float

    def apply(self, model: nn.Module) -> None:
        apply_plan(model, self.modes, self.segments)


class _ModesSolver:
    """Stage modes for an invertible body (multiple-choice knapsack over a per-stage profile)."""

    kind = "stage modes"

    def __init__(self, model: nn.Module, size: int, device: str, profile: Profile | None, estimate: bool) -> None:
        self.model, self.size, self.device, self.estimate = model, size, device, estimate
        self.profile = profile

    def floors(self) -> list[Proposal]:
        """Batch 1 in the least-memory plans: per stage floor, else invert, else recompute, else a 4-bit copy;
        and the same without floor (whose batch slices of temporaries can outweigh the half-gradient copy it
        saves when a whole activation is smaller than a slice). The floor is the least of them, exactly."""
        out = []
        for order in (("floor", "invert", "recompute", "store4"), ("invert", "recompute", "store4")):
            modes = []
            for stage in self.model.body.stages:
                names = [m.value for m in supported_modes(stage)]
                modes.append(next(m for m in order if m in names))
            if not out or tuple(modes) != out[0].modes:
                out.append(Proposal(1, tuple(modes), None, 0, 0.0))
        return out

    def smallest(self) -> int:
        return smallest_budget(self.profile)

    def prepare(self) -> None:
        if self.profile is None:
            self.profile = profiles.load_or_measure(self.model, self.size, self.device, estimate=self.estimate)

    def solve(self, target: int, batches: list[int] | None) -> Proposal:
        p = plan(self.profile, target, batches=batches)
        return Proposal(p.batch, p.modes, None, p.predicted_peak_bytes, p.step_seconds)

    def floor_seconds(self, floor: Proposal) -> float:
        return sum(self.profile.stages[i][m].seconds.at(1) for i, m in enumerate(floor.modes))

    @property
    def source(self) -> str:
        return f"stage modes ({self.profile.source} profile)"


class _SegmentsSolver:
    """Checkpoint segments for a plain body (Re-forwarding's linear-graph dynamic program)."""

    kind = "checkpoint segments"
    source = "checkpoint segments"

    def __init__(self, model: nn.Module, size: int, device: str, stats: list[StageStats] | None = None) -> None:
        self.model, self.size, self.device, self.stats = model, size, device, stats
        self._floor: Proposal | None = None

    def candidates(self) -> list[tuple[Segment, ...]]:
        n = len(self.model.body.stages)
        return [tuple(Segment(i, i + 1, "store4") for i in range(n)), (Segment(0, n, "store4"),),
                tuple(Segment(i, i + 1, "checkpoint") for i in range(n))]

    def floors(self) -> list[Proposal]:
        """Batch 1 in each of the smallest segmentations (the floor is the least of them, exactly)."""
        return [Proposal(1, None, c, 0, 0.0) for c in self.candidates()]

    def smallest(self) -> int:
        try:
            plan_segments(self.stats, 1, profiles.fixed_bytes(self.model), batches=[1])
        except BudgetTooSmall as e:
            return e.smallest
        return 1

    def prepare(self) -> None:
        if self.stats is None:
            x = torch.randn(8, model_spec(self.model).in_channels, self.size, self.size, device=self.device)
            if hasattr(self.model, "body_input"):  # a captured graph: the body starts after its frozen prefix
                x = self.model.body_input(x)
            self.stats = profiles.stage_stats(self.model.body.stages, x)

    def solve(self, target: int, batches: list[int] | None) -> Proposal:
        fixed = profiles.fixed_bytes(self.model)
        p = plan_segments(self.stats, target, fixed, **({"batches": batches} if batches else {}))
        return Proposal(p.batch, None, p.segments, p.predicted_peak_bytes, p.step_seconds)

    def floor_seconds(self, floor: Proposal) -> float:
        return sum(s.forward_seconds.at(1) * 2 + s.backward_seconds.at(1) for s in self.stats)


def is_plain(model: nn.Module) -> bool:
    """True when no stage of the model's body is invertible: it is planned with checkpoint segments."""
    return not any(isinstance(s, Invertible) for s in model.body.stages)


@dataclass(frozen=True)
class TrainingPlan:
    """What a training run needs from the planner: a micro-batch, modes or checkpoint segments, and
    the accounting of its whole step (``account.total`` is the peak it was checked at)."""

    batch: int
    modes: tuple[str, ...] | None
    segments: tuple | None
    predicted_peak_bytes: int
    summary: dict  # for the CLI's and the trainer's reports (JSON-ready)
    account: StepAccount | None = None
    fitted_peak_bytes: int = 0
    solve_seconds: float = 0.0
    step_seconds: float = 0.0
    profile: Profile | None = None

    def apply(self, model: nn.Module) -> None:
        """Set the plan on ``model`` (a model without an engine body: on its chain, see ``planned``)."""
        apply_plan(planned(model), self.modes, self.segments)

    @property
    def samples_per_second(self) -> float:
        return self.batch / self.step_seconds if self.step_seconds > 0 else float("inf")

    def stages(self, model: nn.Module) -> list[dict]:
        modes = self.modes if self.modes is not None else SegmentPlan(1, self.segments, 0, 1.0).stage_modes()
        return [{"name": getattr(s, "name", n), "type": type(s).__name__, "mode": m}  # a chain's pieces are named
                for (n, s), m in zip(model.body.stages.named_children(), modes)]


def _batches(max_batch: int | None, batches: list[int] | None) -> list[int] | None:
    if max_batch is None:
        return batches
    return sorted({b for b in (batches or default_batches()) if b <= max_batch} | {max_batch})


def plan_training(model: nn.Module, size: int, budget: int, device: str = "cpu", estimate: bool = False,
                  max_batch: int | None = None, step: StepShape | None = None,
                  loss_fn: Callable[..., Tensor] | None = None, profile: Profile | None = None,
                  stats: list[StageStats] | None = None, check: bool | None = None, rounds: int = 4,
                  batches: list[int] | None = None, segments: bool | None = None) -> TrainingPlan:
    """The fastest plan for ``model`` at ``size`` whose whole step stays under ``budget`` bytes.

    ``model`` is an edgerev model or any classifier (``nn.Module``): one without an engine body is captured
    as a graph and planned as its chain (:func:`edgerev.memory.graph.planned`), which is what then trains:
    it shares the model's weights. Its trainable set (:mod:`edgerev.memory.trainable`) is part of the plan.

    Args:
        estimate: estimate the stage costs from FLOPs instead of measuring them (quick, less exact).
        max_batch: consider micro-batches up to this size only (a trainer's batch).
        step: what the recipe adds to a step (accumulation, momentum, a teacher; see
            :class:`~edgerev.memory.account.StepShape`); None: a bare step of the micro-batch.
        loss_fn: the trainer's loss (default: cross-entropy).
        profile, stats: the solver's per-stage costs, when the caller has them (else measured, cached).
        check: account each proposal exactly on fake tensors (default: on CPU, where that is exact).
        segments: plan checkpoint segments (True) or stage modes (False); default: segments for a
            model without an invertible stage.

    Raises:
        BudgetTooSmall: the budget is below the floor (named in the message), checked before anything
            is profiled.
    """
    model = planned(model, size)  # any nn.Module: a model without an engine body is captured as a chain
    step = step or StepShape(size)
    check = device == "cpu" if check is None else check
    segments = is_plain(model) if segments is None else segments
    solver = _SegmentsSolver(model, size, device, stats) if segments else \
        _ModesSolver(model, size, device, profile, estimate)
    batches = _batches(max_batch, batches)

    def exact(p: Proposal) -> StepAccount:
        return accounted(model, step, p, loss_fn)

    extra = beyond_model(model, step, 1)  # what the solvers' bare-step costs leave out
    floor, floor_account = None, None
    if check:  # before anything is profiled: a budget below the floor is refused in seconds
        floor, floor_account = _floor(solver, exact)
        if budget < floor_account.total:
            raise BudgetTooSmall(budget, floor_account.total)
    solver.prepare()
    target, solve = budget, 0.0
    for _ in range(rounds):
        t0 = time.perf_counter()
        try:
            if target - extra <= 0:
                raise BudgetTooSmall(target, 1)
            p = solver.solve(target - extra, batches)
        except BudgetTooSmall:
            if check:
                break
            raise BudgetTooSmall(budget, solver.smallest() + extra) from None
        solve = time.perf_counter() - t0
        if not check:
            return _result(solver, p, None, p.fitted_peak_bytes + beyond_model(model, step, p.batch), solve)
        account = exact(p)
        if account.total <= budget:
            return _result(solver, p, account, account.total, solve)
        target -= account.total - budget + max(1, budget // 200)  # the fit missed by a roughly constant amount
    floor = replace(floor, step_seconds=solver.floor_seconds(floor), fitted_peak_bytes=floor_account.total)
    return _result(solver, floor, floor_account, floor_account.total, solve)


def _floor(solver, exact: Callable[[Proposal], StepAccount]) -> tuple[Proposal, StepAccount]:
    accounts = [(f, exact(f)) for f in solver.floors()]
    return min(accounts, key=lambda a: a[1].total)


def floor_plan(model: nn.Module, step: StepShape,
               loss_fn: Callable[..., Tensor] | None = None) -> tuple[Proposal, StepAccount]:
    """The floor of :func:`plan_training` alone (exact, on fake tensors; nothing is profiled): batch 1
    in the least-memory plan, and its account, whose ``total`` is the smallest budget that trains."""
    model = planned(model, step.size)
    solver = _SegmentsSolver(model, step.size, "cpu") if is_plain(model) else \
        _ModesSolver(model, step.size, "cpu", None, False)
    return _floor(solver, lambda p: accounted(model, step, p, loss_fn))


def _loss_key(loss_fn) -> tuple | None:
    from edgerev.train.continual import ContinualLoss

    if loss_fn is None:
        return ("cross-entropy",)
    if type(loss_fn) is ContinualLoss:
        return ("continual", loss_fn.distill, loss_fn.temperature, loss_fn.label_smoothing)
    return None  # a loss this cannot describe: accounted every time


_ACCOUNTS: dict[tuple, StepAccount] = {}  # (model, step, plan, loss) -> its account, for this process


def accounted(model: nn.Module, step: StepShape, p: Proposal, loss_fn: Callable[..., Tensor] | None = None
              ) -> StepAccount:
    """:func:`~edgerev.memory.account.account_step` of proposal ``p``, remembered for this process.

    An account on fake tensors depends only on the model's structure, its weights' types and which are
    trained, the step's shape, the plan and the loss: a daemon plans each job of the same model again, and
    each account runs a whole step under the tracker (seconds on a small CPU).
    """
    loss = _loss_key(loss_fn)
    if loss is None:
        return account_step(model, step, p.batch, p.apply, loss_fn)
    key = (profiles.model_key(model, step.size, "cpu"),
           tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()),
           tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers()),
           tuple(str(m) for m in getattr(getattr(model, "body", None), "modes", None) or ()),  # a plan of None
           step, p.batch, p.modes, p.segments, loss)
    if key not in _ACCOUNTS:
        _ACCOUNTS[key] = account_step(model, step, p.batch, p.apply, loss_fn)
    return _ACCOUNTS[key]


def _result(solver, p: Proposal, account: StepAccount | None, peak: int, solve: float) -> TrainingPlan:
    summary = {"planner": solver.source, "batch": p.batch, "predicted_peak_bytes": peak,
               "fitted_peak_bytes": p.fitted_peak_bytes,
               "samples_per_second": p.batch / p.step_seconds if p.step_seconds > 0 else None,
               "solve_seconds": solve}
    if account is not None:
        summary["account"] = account.as_dict()
    if p.segments is not None:
        summary["segments"] = [{"start": s.start, "end": s.end, "mode": s.mode} for s in p.segments]
    tp = TrainingPlan(p.batch, p.modes, p.segments, peak, summary, account, p.fitted_peak_bytes, solve,
                      p.step_seconds, getattr(solver, "profile", None))
    summary["stages"] = tp.stages(solver.model)
    return tp


# ---- the solver-specific entry points (tests, benchmarks): the same loop ------------------------------------------


@dataclass(frozen=True)
class ModelPlan:
    plan: Plan
    profile: Profile
    fitted_peak_bytes: int  # the knapsack's own prediction
    solve_seconds: float

    def stages(self, model: nn.Module) -> list[dict]:
        return [{"name": n, "type": type(s).__name__, "mode": m}
                for (n, s), m in zip(model.body.stages.named_children(), self.plan.modes)]


@dataclass(frozen=True)
class PlainPlan:
    plan: SegmentPlan
    fitted_peak_bytes: int
    solve_seconds: float

    def stages(self, model: nn.Module) -> list[dict]:
        return [{"name": n, "type": type(s).__name__, "mode": m}
                for (n, s), m in zip(model.body.stages.named_children(), self.plan.stage_modes())]


def plan_model(model: nn.Module, size: int, budget: int, device: str = "cpu", profile: Profile | None = None,
               check: bool = True, rounds: int = 4, batches: list[int] | None = None) -> ModelPlan:
    """Stage modes for an invertible ``model``: :func:`plan_training` for a bare step."""
    tp = plan_training(model, size, budget, device, profile=profile, check=check, rounds=rounds, batches=batches,
                       segments=False)
    return ModelPlan(Plan(tp.batch, tp.modes, tp.predicted_peak_bytes, tp.step_seconds), tp.profile,
                     tp.fitted_peak_bytes, tp.solve_seconds)


def plan_plain(model: nn.Module, size: int, budget: int, device: str = "cpu", stats=None, check: bool = True,
               rounds: int = 4, batches: list[int] | None = None) -> PlainPlan:
    """Checkpoint segments for a plain ``model``: :func:`plan_training` for a bare step."""
    tp = plan_training(model, size, budget, device, stats=stats, check=check, rounds=rounds, batches=batches,
                       segments=True)
    return PlainPlan(SegmentPlan(tp.batch, tp.segments, tp.predicted_peak_bytes, tp.step_seconds),
                     tp.fitted_peak_bytes, tp.solve_seconds)


def minimal_modes(model: nn.Module, size: int) -> tuple[str, ...]:
    """The modes of least exact peak at batch 1 among the least-memory candidates (per stage floor or invert,
    else recompute, else a 4-bit copy)."""
    floors = _ModesSolver(model, size, "cpu", None, False).floors()
    return min(floors, key=lambda f: fake_step_peak(model, f.modes, 1, size)).modes


def minimal_segments(model: nn.Module, size: int) -> tuple[tuple, int]:
    """The segmentation of least exact peak at batch 1 among the smallest candidates, and that peak."""
    peaks = [(fake_step_peak(model, None, 1, size, segments=f.segments), f.segments)
             for f in _SegmentsSolver(model, size, "cpu").floors()]
    peak, segments = min(peaks, key=lambda p: p[0])
    return segments, peak


def verify(model: nn.Module, modes: tuple[str, ...] | None, batch: int, size: int, device: str = "cpu",
           steps: int = 2, segments: tuple | None = None) -> dict:
    """Run real training steps with the plan: measured peak bytes and seconds per step."""
    apply_plan(model, modes, segments)
    peak = step_peak(model, batch, size, device).peak_bytes
    spec = model_spec(model)
    x = torch.randn(batch, spec.in_channels, size, size, device=device)
    y = torch.randint(0, spec.num_classes, (batch,), device=device)
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

