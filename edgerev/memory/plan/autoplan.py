"""Plan a training step under a budget: one loop for reversible and plain models alike.

:func:`plan_training` is what the trainer, ``edgerev plan`` and the daemon call. The loop:

1. the *floor*: batch 1 in the least-memory plan, its whole step accounted exactly on fake tensors
   (:func:`edgerev.memory.measure.account.account_step`); a budget below it is refused at once, naming it,
   before anything is profiled;
2. *solve*: a solver proposes the fastest plan its fitted costs say fits (stage modes by the
   knapsack of :mod:`edgerev.memory.solve.knapsack` for an invertible body, checkpoint segments by
   :mod:`edgerev.memory.solve.segments` for a plain one);
3. *check*: the proposal's whole step is accounted exactly; if it passes the budget, the solver is
   asked again under a budget reduced by the overshoot (*shrink*), a few rounds, and the floor plan
   is the answer if nothing faster fits;
4. *widen*: the engine computes per-sample temporaries in batch slices, and every slice is a round of
   kernel launches. The stage modes are solved and checked at the lean slices (1 MiB); then each stage
   gets the largest slice budget under which the step still fits: the whole step is accounted at
   uniform budgets from the whole batch down (:data:`SLICE_LADDER`), each account attributing its peak
   to the stage that was running (``stage_peaks``), and each stage takes the largest budget whose peak
   stayed under the budget; one more account tries every sliced stage at 1.5 times its budget, between
   its rung and the one that did not fit. The mixed plan is accounted once more. Under a generous cap the step runs
   whole-batch; under a tight one only the stages at the peak slice.

So the bytes a plan is reported with are those of the whole step, the figure an error names is a
budget that trains, and the two kinds of model differ only in their solver.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from torch import Tensor, nn
from torch.utils._python_dispatch import TorchDispatchMode

from edgerev._torchapi import left_as_it_was, shadowed
from edgerev.engine import Mode, engine_body, floor_restores, supported_modes
from edgerev.errors import UnsupportedModel
from edgerev.layers.base import Invertible
from edgerev.memory.graph import planned
from edgerev.memory.measure import profile as profiles
from edgerev.memory.measure.account import StepAccount, StepShape, account_step, beyond_model
from edgerev.memory.measure.peak import apply_plan, fake_step_peak, step_peak
from edgerev.memory.measure.workspaces import active_key, counting, for_device, not_counted
from edgerev.memory.plan.progress import SILENT, Progress
from edgerev.memory.solve.costs import BudgetTooSmall, Plan, Profile, Segment, SegmentPlan, StageStats
from edgerev.memory.solve.knapsack import APPROXIMATE, default_batches, exact_only, plan, smallest_budget
from edgerev.memory.solve.segments import EXACT_SEGMENT_MODES, plan_segments
from edgerev.models.spec import model_spec


@dataclass(frozen=True)
class Proposal:
    """What a solver proposes: a micro-batch and modes or segments, with the solver's own figures."""

    batch: int
    modes: tuple[str, ...] | None
    segments: tuple[Segment, ...] | None
    fitted_peak_bytes: int
    step_seconds: float
    slices: tuple[int, ...] | None = None
    floor_restore: bool | None = None  # how floor stages run on the device planned for (Execution.floor_restore)

    def apply(self, model: nn.Module) -> None:
        apply_plan(model, self.modes, self.segments, self.slices, self.floor_restore)


#: torch's refusal of a batch norm that would train over one value per channel
ONE_VALUE_PER_CHANNEL = "Expected more than 1 value per channel when training"
_LEAST: dict[str, int] = {}  # model key -> its least micro-batch, this process


def least_micro_batch(model: nn.Module, size: int) -> int:
    """The least micro-batch ``model`` trains at: 1, or 2 where a batch norm in training mode normalizes over one
    value per channel of a sample (one after a global pool: RexNet's squeeze-excitation, RepViT's classifier), which
    torch refuses at a batch of 1. Found by a forward on the meta device, once per model structure and size.

    Raises:
        UnsupportedModel: a batch of 2 does not train it either."""
    key = profiles.model_key(model, size, "cpu")
    if key not in _LEAST:
        channels = model_spec(model).in_channels

        def probe(copy: nn.Module) -> int:
            copy.train()
            for b in (1, 2):
                try:
                    with torch.no_grad():
                        copy(torch.randn(b, channels, size, size))
                    return b
                except ValueError as e:
                    if not str(e).startswith(ONE_VALUE_PER_CHANNEL):
                        raise
                    message = str(e)
            raise UnsupportedModel(f"{type(model).__name__} cannot train at {size}x{size}: a batch norm of it "
                                   f"normalizes over one value per channel at a batch of 2 ({message})")

        _LEAST[key] = shadowed(model, probe)
    return _LEAST[key]


#: ATen's batch norms, each with the position of its ``training`` argument (None: always training)
_BATCH_NORMS = {"native_batch_norm": 5, "_native_batch_norm_legit": 5, "_native_batch_norm_legit_functional": 5,
                "cudnn_batch_norm": 5, "miopen_batch_norm": 5, "_batch_norm_with_update": None,
                "_batch_norm_with_update_functional": None}


class _BatchNormSeen(TorchDispatchMode):
    """Notes whether an op normalizes by the batch: a batch norm in training mode."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._overloadpacket.__name__
        if name in _BATCH_NORMS:
            at = _BATCH_NORMS[name]
            training = True if at is None else (args[at] if len(args) > at else kwargs.get("training", False))
            if func._overloadname == "no_stats":  # _native_batch_norm_legit without running statistics
                training = args[3] if len(args) > 3 else kwargs.get("training", False)
            self.seen = self.seen or bool(training)
        return func(*args, **(kwargs or {}))


def batch_statistics(model: nn.Module, size: int) -> bool:
    """Does a training step of ``model`` as it is set (its modules' modes) normalize by its batch? A batch norm in
    training mode does, a module or a function call (timm's ``BatchNormAct2d`` traced into a chain); one frozen by the
    trainable set (``bn_stats: frozen``) does not. Found by a forward at batch 2 on the meta device."""
    channels = model_spec(model).in_channels

    def probe(copy: nn.Module) -> bool:
        with _BatchNormSeen() as seen, torch.no_grad():
            copy(torch.randn(2, channels, size, size))
        return seen.seen

    return shadowed(model, probe)


def trains_at(batch: int | None, micro_batch: int, least: int) -> bool:
    """Does a step of ``batch`` in micro-batches of ``micro_batch`` (split as the trainer splits it,
    :func:`~edgerev.memory.measure.microbatch.split_batch`) give every micro-batch ``least`` samples at least?"""
    if micro_batch < least:
        return False
    if batch is None or micro_batch >= batch:
        return batch is None or batch >= least
    return batch // math.ceil(batch / micro_batch) >= least


def _trainable(f: Proposal, batch: int | None) -> Proposal:
    """Floor ``f`` at the least micro-batch from its own up that splits a step of ``batch`` into micro-batches of
    ``f.batch`` samples at least (:func:`trains_at`; a batch of 5 in micro-batches of 2 would leave one of 1)."""
    if f.batch == 1 or batch is None:
        return f
    return replace(f, batch=next(b for b in range(f.batch, batch + 1) if trains_at(batch, b, f.batch)))


class _ModesSolver:
    """Stage modes for an invertible body (multiple-choice knapsack over a per-stage profile)."""

    kind = "stage modes"

    def __init__(self, model: nn.Module, size: int, device: str, profile: Profile | None, estimate: bool,
                 progress: Progress = SILENT, batch: int | None = None) -> None:
        self.model, self.size, self.device, self.estimate = model, size, device, estimate
        self.batch = batch  # the largest micro-batch planned: a measured profile is timed up to it
        self.least = least_micro_batch(model, size)
        self.profile = profile
        self._full = profile if profile is not None and profile.every_mode else None  # with the approximate modes
        self.progress = progress

    def _load(self, exact: bool, what: str) -> Profile:
        verb = "estimating" if self.estimate else "measuring"
        self.progress.phase(f"{verb} {what}")
        return profiles.load_or_measure(self.model, self.size, self.device, estimate=self.estimate, exact=exact,
                                        progress=lambda i, n: self.progress.step(f"{verb} stage", i, n),
                                        batch=self.batch)

    def full(self) -> Profile:
        """The profile with every mode (measured or estimated when first needed: only where no exact plan fits)."""
        if self._full is None:
            self._full = self._load(False, "the approximate modes' costs")
        return self._full

    def floors(self) -> list[Proposal]:
        """The least micro-batch (1, or 2: :func:`least_micro_batch`) in the least-memory plans: per stage floor, else
        invert, else recompute, else a 4-bit copy; the same without floor (whose batch slices of temporaries can
        outweigh the half-gradient copy it saves when a whole activation is smaller than a slice); and every stage
        stored (plain autograd's step: where weights, gradients and optimizer state are most of a step, it can hold the
        least). The floor is the least of them, exactly, so never above plain autograd's."""
        return self._least((("floor", "invert", "recompute", "store4"), ("invert", "recompute", "store4"), ("store",)))

    def exact_floors(self) -> list[Proposal]:
        """:meth:`floors` with ``store`` where they take a 4-bit copy: the least memory in exact modes. The one
        without floor first: a budget above it needs no other account (:func:`_floor`), and floor's step, accounted
        at the lean slices, runs several times the kernels."""
        return self._least((("invert", "recompute", "store"), ("floor", "invert", "recompute", "store"), ("store",)))

    def _least(self, orders: tuple[tuple[str, ...], ...]) -> list[Proposal]:
        out: list[Proposal] = []
        for order in orders:
            modes = []
            for stage in self.model.body.stages:
                names = [m.value for m in supported_modes(stage)]
                modes.append(next(m for m in order if m in names))
            if all(tuple(modes) != p.modes for p in out):
                out.append(Proposal(self.least, tuple(modes), None, 0, 0.0, floor_restore=floor_restores(self.device)))
        return out

    def smallest(self) -> int:
        return smallest_budget(self.full())

    def prepare(self) -> None:
        if self.profile is None:
            self.profile = self._load(True, "stage costs")
            self._full = self.profile if self.profile.every_mode else None

    def accumulation_bytes(self) -> int:
        """What a micro-batch after a step's first holds besides a bare step: the engine's one backward hands back
        the gradients of every parameter of the body at once, beside the ones accumulated so far, until autograd
        adds them in."""
        return sum(p.numel() * p.element_size() for p in self.model.body.parameters() if p.requires_grad)

    def solve(self, target: int, batches: list[int] | None, step_batch: int | None = None) -> Proposal:
        """The fastest plan in exact modes; approximate ones (``store8``, ``store4``) only where no exact plan fits. A
        micro-batch below ``step_batch`` also pays for :meth:`accumulation_bytes` (the profile prices a bare step)."""
        accumulation = (step_batch, self.accumulation_bytes()) if step_batch else None
        try:
            p = plan(exact_only(self.profile), target, batches=batches, accumulation=accumulation)
        except BudgetTooSmall:
            p = plan(self.full(), target, batches=batches, accumulation=accumulation)
        return Proposal(p.batch, p.modes, None, p.predicted_peak_bytes, p.step_seconds,
                        floor_restore=floor_restores(self.device))

    def floor_seconds(self, floor: Proposal) -> float:
        """Seconds of the floor's step at batch 1. A mode the profile lacks (an estimate of the exact modes only) is
        estimated for its stage alone: the figure is only reported, and the whole profile's approximate modes
        would cost as much again as the exact ones."""
        if self._full is not None or all(m in self.profile.stages[i] for i, m in enumerate(floor.modes)):
            prof = self._full or self.profile
            return sum(prof.stages[i][m].seconds.at(1) for i, m in enumerate(floor.modes))
        stages = self.model.body.stages
        missing = [i for i, m in enumerate(floor.modes) if m not in self.profile.stages[i]]
        shapes = profiles.stage_inputs(self.model, self.size, next(self.model.parameters()).device) if missing else []
        return sum(self.profile.stages[i][m].seconds.at(1) if i not in missing else
                   profiles.estimated_seconds(stages[i], Mode(m), shapes[i], i == 0, self.device).at(1)
                   for i, m in enumerate(floor.modes))

    @property
    def source(self) -> str:
        return f"stage modes ({self.profile.source} profile)"


class _SegmentsSolver:
    """Checkpoint segments for a plain body (Re-forwarding's linear-graph dynamic program)."""

    kind = "checkpoint segments"
    source = "checkpoint segments"

    def __init__(self, model: nn.Module, size: int, device: str, stats: list[StageStats] | None = None,
                 progress: Progress = SILENT, estimate: bool = False) -> None:
        self.model, self.size, self.device, self.stats, self.estimate = model, size, device, stats, estimate
        self.least = least_micro_batch(model, size)
        self._floor: Proposal | None = None
        self.progress = progress
        self._batch_statistics: bool | None = None

    def batch_statistics(self) -> bool:
        """:func:`batch_statistics` of the model, found once."""
        if self._batch_statistics is None:
            self._batch_statistics = batch_statistics(self.model, self.size)
        return self._batch_statistics

    def candidates(self) -> list[tuple[Segment, ...]]:
        n = len(self.model.body.stages)
        return [tuple(Segment(i, i + 1, "store4") for i in range(n)), (Segment(0, n, "store4"),),
                tuple(Segment(i, i + 1, "checkpoint") for i in range(n)), (Segment(0, n, "store"),)]

    def floors(self) -> list[Proposal]:
        """The least micro-batch (1, or 2: :func:`least_micro_batch`) in each of the smallest segmentations, and in none
        (plain autograd: where weights, gradients and optimizer state are most of a step, a segment's recomputation or
        its copies can cost more than the activations it frees). The floor is the least of them, exactly, so never above
        plain autograd's."""
        return [Proposal(self.least, None, c, 0, 0.0) for c in self.candidates()]

    def exact_floors(self) -> list[Proposal]:
        """The smallest segmentation without 4-bit copies: every piece checkpointed."""
        return [f for f in self.floors() if not _approximate(f)]

    def smallest(self) -> int:
        try:
            plan_segments(self.stats, 1, profiles.fixed_bytes(self.model), batches=[self.least])
        except BudgetTooSmall as e:
            return e.smallest
        return 1

    def prepare(self) -> None:
        if self.stats is None:
            x = torch.randn(8, model_spec(self.model).in_channels, self.size, self.size, device=self.device)
            if hasattr(self.model, "body_input"):  # a captured graph: the body starts after its frozen prefix
                x = self.model.body_input(x)
            verb = "estimating" if self.estimate else "measuring"
            self.progress.phase(f"{verb} the chain's pieces")
            stats = functools.partial(profiles.estimate_stage_stats, device=self.device) if self.estimate \
                else profiles.stage_stats
            self.stats = stats(self.model.body.stages, x,
                               progress=lambda i, n: self.progress.step(f"{verb} piece", i, n))

    def solve(self, target: int, batches: list[int] | None, step_batch: int | None = None) -> Proposal:
        """The fastest segments in exact modes (stored or checkpointed); 8- or 4-bit copies only where no exact
        segmentation fits at any micro-batch: their costs price a copy at memory speed, cheaper than any re-run, so
        they would otherwise win wherever they fit. A model whose batch norms normalize by the batch
        (:func:`batch_statistics`) trains at the largest micro-batch the step's batch ``step_batch`` splits into evenly
        (:func:`~edgerev.memory.measure.microbatch.split_batch`) at which an exact segmentation fits, however fast
        smaller ones would be: a micro-batch is the batch its batch norms see, and the fewer its samples the noisier
        their statistics (MobileOne-S0 at 64x64, batch 8 on eight images: whole, its loss fell from 2.37 to 1.77 in
        six steps; in micro-batches of 4 it stayed at 2.2-2.3). Autograd adds each parameter's gradient in as it
        comes: accumulating micro-batches hold nothing beyond a bare step, whatever ``step_batch``."""
        fixed = profiles.fixed_bytes(self.model)
        sweep = {"batches": batches} if batches else {}
        if self.batch_statistics():  # the largest micro-batch an exact segmentation fits at
            for b in sorted(batches or default_batches(), reverse=True):
                if step_batch is not None and (b > step_batch or step_batch // math.ceil(step_batch / b) != b):
                    continue  # the trainer splits a step into even micro-batches: 8 in 6s runs as two of 4
                try:
                    p = plan_segments(self.stats, target, fixed, modes=EXACT_SEGMENT_MODES, batches=[b])
                except BudgetTooSmall:
                    continue
                return Proposal(p.batch, None, p.segments, p.predicted_peak_bytes, p.step_seconds)
        try:
            p = plan_segments(self.stats, target, fixed, modes=EXACT_SEGMENT_MODES, **sweep)
        except BudgetTooSmall:
            p = plan_segments(self.stats, target, fixed, **sweep)
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
    slices: tuple[int, ...] | None = None  # per stage, the batch-slice budget (0: the whole batch); None: default
    floor_restore: bool | None = None  # how floor stages run on the device planned for (Execution.floor_restore)

    def apply(self, model: nn.Module) -> None:
        """Set the plan on ``model`` (a model without an engine body: on its chain, see ``planned``)."""
        apply_plan(planned(model), self.modes, self.segments, self.slices, self.floor_restore)

    @property
    def samples_per_second(self) -> float:
        return self.batch / self.step_seconds if self.step_seconds > 0 else float("inf")

    def stages(self, model: nn.Module) -> list[dict]:
        modes = self.modes if self.modes is not None else SegmentPlan(1, self.segments, 0, 1.0).stage_modes()
        slices = self.slices or (None,) * len(modes)
        return [{"name": getattr(s, "name", n), "type": type(s).__name__, "mode": m,  # a chain's pieces are named
                 **({"slice_bytes": b} if b is not None else {})}
                for (n, s), m, b in zip(model.body.stages.named_children(), modes, slices)]


def _batches(max_batch: int | None, batches: list[int] | None) -> list[int] | None:
    if max_batch is None:
        return batches
    return sorted({b for b in (batches or default_batches()) if b <= max_batch} | {max_batch})


def plan_training(model: nn.Module, size: int, budget: int, device: str = "cpu", estimate: bool = False,
                  max_batch: int | None = None, step: StepShape | None = None,
                  loss_fn: Callable[..., Tensor] | None = None, profile: Profile | None = None,
                  stats: list[StageStats] | None = None, check: bool | None = None, rounds: int = 4,
                  batches: list[int] | None = None, segments: bool | None = None, widen: bool = True,
                  progress: Progress = SILENT) -> TrainingPlan:
    """The fastest plan for ``model`` at ``size`` whose whole step stays under ``budget`` bytes.

    ``model`` is an edgerev model or any classifier (``nn.Module``): one without an engine body is captured
    as a graph and planned as its chain (:func:`edgerev.memory.graph.planned`), which is what then trains:
    it shares the model's weights. Its trainable set (:mod:`edgerev.train.trainable`) is part of the plan.

    Args:
        estimate: estimate the stage costs from FLOPs instead of measuring them (quick, less exact).
        max_batch: consider micro-batches up to this size only (a trainer's batch).
        step: what the recipe adds to a step (accumulation, momentum, a teacher; see
            :class:`~edgerev.memory.measure.account.StepShape`); None: a bare step of the micro-batch.
        loss_fn: the trainer's loss (default: cross-entropy).
        profile, stats: the solver's per-stage costs, when the caller has them (else measured, cached).
        check: account each proposal exactly on fake tensors (default: on CPU, where that is exact).
        segments: plan checkpoint segments (True) or stage modes (False); default: segments for a
            model without an invertible stage.
        widen: give each stage the largest batch slices the budget allows (:func:`widen_slices`, accounted on
            fake tensors); False: the default slices (the lean setting the stage costs are profiled at).
        progress: told each phase as it begins (:class:`~edgerev.memory.plan.progress.Progress`: reported once
            planning has taken a few seconds).

    On CUDA, where this process has the device, every account also counts what the math libraries take there
    (:mod:`edgerev.memory.measure.workspaces`: cuBLAS's workspaces, each convolution's own, measured on the
    device); the summary's ``libraries`` says what was counted.

    Raises:
        BudgetTooSmall: the budget is below the floor (named in the message), checked before anything
            is profiled.
    """
    lib = for_device(device)
    with counting(lib):
        tp = _plan_training(model, size, budget, device, estimate, max_batch, step, loss_fn, profile, stats, check,
                            rounds, batches, segments, widen, progress)
    if lib is not None:
        tp.summary["libraries"] = lib.summary()
    elif torch.device(device).type == "cuda":
        tp.summary["libraries"] = not_counted(device)
    return tp


def _plan_training(model: nn.Module, size: int, budget: int, device: str, estimate: bool, max_batch: int | None,
                   step: StepShape | None, loss_fn: Callable[..., Tensor] | None, profile: Profile | None,
                   stats: list[StageStats] | None, check: bool | None, rounds: int, batches: list[int] | None,
                   segments: bool | None, widen: bool, progress: Progress) -> TrainingPlan:
    progress.phase("capturing the model's graph")
    name = type(model).__name__
    model = planned(model, size)  # any nn.Module: a model without an engine body is captured as a chain
    step = step or StepShape(size)
    check = device == "cpu" if check is None else check
    segments = is_plain(model) if segments is None else segments
    batches = _batches(max_batch, batches)
    solver = _SegmentsSolver(model, size, device, stats, progress, estimate) if segments else \
        _ModesSolver(model, size, device, profile, estimate, progress, max(batches) if batches else None)
    if solver.least > 1:  # a batch norm over one value per channel: micro-batches that split into too few, refused
        if step.batch is not None and step.batch < solver.least:
            raise UnsupportedModel(f"{name} trains at micro-batches of {solver.least} samples at least "
                                   f"(a batch norm of it normalizes over one value per channel of a sample): a step "
                                   f"of batch {step.batch} cannot train it; use a batch of {solver.least} or more")
        batches = [b for b in (batches or default_batches()) if trains_at(step.batch, b, solver.least)]

    def exact(p: Proposal) -> StepAccount:
        return accounted(model, step, p, loss_fn)

    extra = beyond_model(model, step, 1)  # what the solvers' bare-step costs leave out
    floor, floor_account = None, None
    if check:  # before anything is profiled: a budget below the floor is refused in seconds
        progress.phase("accounting the smallest step")
        floor, floor_account = _floor(solver, exact, step.batch, budget)
        if budget < floor_account.total:
            raise BudgetTooSmall(budget, floor_account.total)
    solver.prepare()
    target, solve = budget, 0.0
    for r in range(rounds):
        progress.phase(f"solving for the fastest plan (round {r + 1})")
        t0 = time.perf_counter()
        try:
            if target - extra <= 0:
                raise BudgetTooSmall(target, 1)
            p = solver.solve(target - extra, batches, step.batch)
        except BudgetTooSmall:
            if check:
                break
            raise BudgetTooSmall(budget, solver.smallest() + extra) from None
        solve = time.perf_counter() - t0
        if widen and p.modes is not None:  # checked at the widest slices that fit (the lean ones last)
            wide, account = widen_slices(model, step, p, budget, loss_fn)
            if account.total <= budget:
                return _result(solver, wide, account, account.total, solve)
            if not check:  # unchecked (CUDA): the solver's word at the lean slices, fitted on the device after
                return _result(solver, p, None, p.fitted_peak_bytes + beyond_model(model, step, p.batch), solve)
        elif not check:
            return _result(solver, p, None, p.fitted_peak_bytes + beyond_model(model, step, p.batch), solve)
        else:
            account = exact(p)
            if account.total <= budget:
                return _result(solver, p, account, account.total, solve)
        target -= account.total - budget + max(1, budget // 200)  # the fit missed by a roughly constant amount
    progress.phase("nothing faster fits: the least-memory modes at the largest micro-batch")
    floor, floor_account = _largest_floor(solver, exact, floor, floor_account, budget, batches or default_batches())
    floor = replace(floor, step_seconds=solver.floor_seconds(floor), fitted_peak_bytes=floor_account.total)
    if widen and floor.modes is not None:
        wide, account = widen_slices(model, step, floor, budget, loss_fn)
        if account.total <= budget:
            floor, floor_account = wide, account
    return _result(solver, floor, floor_account, floor_account.total, solve)


#: the batch-slice budgets :func:`widen_slices` tries, largest first: the whole batch (0), then halving from
#: 256 MiB to the lean 1 MiB at which stage costs are profiled and plans are checked
SLICE_LADDER: tuple[int, ...] = (0, *(1 << k for k in range(28, 19, -1)))


def widen_slices(model: nn.Module, step: StepShape, p: Proposal, budget: int,
                 loss_fn: Callable[..., Tensor] | None = None) -> tuple[Proposal, StepAccount]:
    """``p`` with each stage's largest batch-slice budget under which the whole step fits ``budget``: fewer slices,
    fewer kernel launches, the same arithmetic; and its account (over ``budget`` when nothing fits, not even the
    lean slices: the check of ``p`` failed).

    The step is accounted at uniform budgets, largest first, each account attributing its peak to the stage
    that ran (a stage's temporaries are freed before the next stage runs, so its peak depends on its own slices
    alone); a stage keeps the first budget under which its peak fitted, or 1.5 times it where one more account
    of every sliced stage there says it fits. The plan of those budgets is accounted once more; were it over (an
    effect between stages, or a peak outside the stages), the plan of the rungs alone, then the largest uniform
    budget that fitted whole.

    The ladder starts at the whole batch and goes on at the budgets that slice something, and only as far down as
    some stage needs: an account costs time in proportion to the kernels
    its step dispatches, which double with every halving of the slices, so the lean step (at 240x240 most of a
    plan's accounting) is accounted only when a stage fits nowhere above it. A proposal that fits at no budget is
    refused at the end of the ladder, in about twice the time of its lean account alone.
    """
    n = len(model.body.stages)
    chosen: list[int | None] = [None] * n
    uniform: tuple[Proposal, StepAccount] | None = None
    last: tuple[Proposal, StepAccount] | None = None
    widest = _whole_slice(model, step.size, p.batch)
    for b in (b for b in SLICE_LADDER if b < widest):  # the budgets that slice something, and 0
        peaks: dict[int, int] = {}
        q = replace(p, slices=(b,) * n)
        last = (q, accounted(model, step, q, loss_fn, peaks))
        if last[1].total <= budget and uniform is None:
            uniform = last
            if all(c is None for c in chosen):
                return uniform  # every stage at this budget, none could take a larger one
        for i in range(n):
            if chosen[i] is None and peaks.get(i, 0) <= budget:
                chosen[i] = b
        if all(c is not None for c in chosen):
            break
    if any(c is None for c in chosen):
        return uniform or last
    # between the rung that fitted and the one twice as large that did not: one more account tries every sliced stage
    # at 1.5 times its budget (a third fewer slices where the batch divides so)
    between = tuple(c * 3 // 2 if c else c for c in chosen)
    if between != tuple(chosen):
        peaks = {}
        accounted(model, step, replace(p, slices=between), loss_fn, peaks)
        finer = tuple(m if peaks.get(i, 0) <= budget else c for i, (c, m) in enumerate(zip(chosen, between)))
        if finer != tuple(chosen):
            q = replace(p, slices=finer)
            acc = accounted(model, step, q, loss_fn)
            if acc.total <= budget:
                return q, acc
    q = replace(p, slices=tuple(chosen))
    acc = accounted(model, step, q, loss_fn)
    return (q, acc) if acc.total <= budget else (uniform or last)


def _whole_slice(model: nn.Module, size: int, batch: int) -> int:
    """A slice budget at or above which no stage slices anything at micro-batch ``batch``: twice the largest stage
    input (the layers' temporaries are at most twice the tensor they slice). Budgets above it account the same step
    as the whole batch (0)."""
    shapes = profiles.stage_inputs(model, size)
    element = max([4, *(p.element_size() for p in model.parameters())])
    return 2 * batch * max(math.prod(s) for s in shapes) * element


def _floor(solver, exact: Callable[[Proposal], StepAccount], batch: int | None = None,
           budget: int | None = None) -> tuple[Proposal, StepAccount]:
    """The least of the solver's floors at micro-batch 1 and, for a step of a larger ``batch``, of the same modes at
    that batch in one micro-batch: accumulating micro-batches holds the gradients twice, which can cost more than the
    other samples' activations (a small model). Where it may is told by accounts (:func:`_whole`), not guessed: a
    bound from the micro-batch-1 account alone (its bytes beyond the gradients taken as one sample's) missed a whole
    batch that held less.

    With a ``budget``, the first floor that fits under it, exact ones first, each at micro-batch 1 and then at the
    whole batch (:func:`_whole` under the budget) before the next is accounted (where the gradients are most of a
    step, the first floor's whole batch fits where none fits at micro-batch 1, and the others' accounts, floor's the
    dearest, are not needed): the budget is above the floor either way,
    and the other floors (a 4-bit stem for RevNeXt, every 4-bit segmentation of a chain) need no account. Where none
    fits, the least, as without a budget."""
    if budget is not None:
        for group in (solver.exact_floors(), solver.floors()):
            for f in (_trainable(f, batch) for f in group):
                account = exact(f)
                if account.total <= budget:
                    return f, account
                whole = _whole(f, exact, batch, budget)  # its micro-batch-1 account bounds it: no account where over
                if whole is not None and whole[1].total <= budget:
                    return whole
    floors = [_trainable(f, batch) for f in solver.floors()]
    best = min(((f, exact(f)) for f in floors), key=lambda a: a[1].total)
    for f in floors:
        whole = _whole(f, exact, batch, best[1].total)
        if whole is not None and whole[1].total < best[1].total:
            best = whole
    return best


#: a step batch up to which the whole batch's floor is accounted at once: its account costs about as much as the
#: first accounts of a walk of doubling micro-batches, which pays off where the whole batch is large
WHOLE_AT_ONCE = 32


def _whole(f: Proposal, exact: Callable[[Proposal], StepAccount], batch: int | None,
           bound: int) -> tuple[Proposal, StepAccount] | None:
    """``f`` at the step's whole ``batch`` in one micro-batch and its account, or None where that account is sure to
    be above ``bound`` (or the step has no larger batch). A micro-batch ``b`` below the batch holds the gradients
    twice and fewer samples, so its account less one copy of the gradients is at most the whole batch's: micro-batch 1,
    then, for a batch above :data:`WHOLE_AT_ONCE`, micro-batches doubling from 2 (cheap accounts) stop the search as
    soon as that passes ``bound``."""
    if not batch or batch <= f.batch:
        return None
    one = exact(f)
    if one.total - one.gradients > bound:  # micro-batch 1 bounds it already: no account
        return None
    b = 2 if batch > WHOLE_AT_ONCE else batch  # a small batch's own account costs about what the walk's first ones do
    while b < batch:
        if trains_at(batch, b, f.batch):  # else a micro-batch below the model's least (least_micro_batch)
            account = exact(replace(f, batch=b))
            if account.total - account.gradients > bound:
                return None
        b *= 2
    whole = replace(f, batch=batch)
    return whole, exact(whole)


def _approximate(p: Proposal) -> bool:
    """Does ``p`` keep an 8- or 4-bit copy anywhere (approximate gradients)?"""
    modes = p.modes or tuple(s.mode for s in p.segments or ())
    return any(m in APPROXIMATE for m in modes)


def _largest_floor(solver, exact: Callable[[Proposal], StepAccount], floor: Proposal, account: StepAccount,
                   budget: int, batches: list[int]) -> tuple[Proposal, StepAccount]:
    """The least-memory modes at the largest micro-batch of ``batches`` under ``budget`` (fewest micro-batches, fewest
    launches per sample), exact modes first: ``store8``/``store4`` only where no exact floor fits at any micro-batch.
    ``floor`` (micro-batch 1, or the whole batch) where nothing larger fits. Of the least-memory candidates (with
    ``floor`` and without) that fit at a micro-batch, the fastest by the solver's costs.

    A step's peak grows with its micro-batch, so the largest that fits is searched by doubling then halving: few
    accounts, the dearest (the largest micro-batches) only where smaller ones fitted."""
    sizes = sorted({b for b in batches if b >= floor.batch} | {floor.batch})

    def least(group: list[Proposal], b: int) -> tuple[Proposal, StepAccount]:
        accounts = [(f, exact(f)) for f in (replace(g, batch=b) for g in group)]
        fits = [fa for fa in accounts if fa[1].total <= budget]
        if fits:
            return min(fits, key=lambda fa: (solver.floor_seconds(fa[0]), fa[1].total))
        return min(accounts, key=lambda fa: fa[1].total)

    for group in (solver.exact_floors(), solver.floors()):
        best, lo, hi, k = None, 0, len(sizes), 0  # sizes[:lo] fit, sizes[hi:] do not
        while k < hi:  # doubling: 0, 1, 3, 7, ...
            fa = least(group, sizes[k])
            if fa[1].total > budget:
                hi = k
                break
            best, lo, k = fa, k + 1, 2 * k + 1
        while lo < hi:  # halving between the last that fitted and the first that did not
            mid = (lo + hi) // 2
            fa = least(group, sizes[mid])
            if fa[1].total <= budget:
                best, lo = fa, mid + 1
            else:
                hi = mid
        if best is not None:
            return best
    return floor, account


def floor_plan(model: nn.Module, step: StepShape, loss_fn: Callable[..., Tensor] | None = None,
               budget: int | None = None) -> tuple[Proposal, StepAccount]:
    """The floor of :func:`plan_training` alone (exact, on fake tensors; nothing is profiled): batch 1
    in the least-memory plan, and its account, whose ``total`` is the smallest budget that trains. With a ``budget``,
    a floor under it if there is one (its total at most the budget: the budget trains; a few accounts), else the
    least."""
    model = planned(model, step.size)
    solver = _SegmentsSolver(model, step.size, "cpu") if is_plain(model) else \
        _ModesSolver(model, step.size, "cpu", None, False)
    return _floor(solver, lambda p: accounted(model, step, p, loss_fn), step.batch, budget)


class DescribedLoss(Protocol):
    """A loss that says what a step's memory depends on: ``memory_key``, the same tuple for every loss whose step
    holds the same tensors (the trainer's :class:`~edgerev.train.continual.ContinualLoss` has one)."""

    memory_key: tuple


def _loss_key(loss_fn: Callable[..., Tensor] | DescribedLoss | None) -> tuple | None:
    if loss_fn is None:
        return ("cross-entropy",)
    return getattr(loss_fn, "memory_key", None)  # None: a loss this cannot describe, accounted every time


_ACCOUNTS: dict[tuple, StepAccount] = {}  # (model, step, plan, loss, libraries) -> its account, for this process
_STAGE_PEAKS: dict[tuple, dict[int, int]] = {}  # the same key -> the account's peak per stage


def accounted(model: nn.Module, step: StepShape, p: Proposal, loss_fn: Callable[..., Tensor] | None = None,
              stage_peaks: dict[int, int] | None = None) -> StepAccount:
    """:func:`~edgerev.memory.measure.account.account_step` of proposal ``p``, remembered for this process.

    An account on fake tensors depends only on the model's structure, its weights' types and which are
    trained, the step's shape, the plan, the loss and the libraries' memory it counts (a CUDA device's, or none):
    a daemon plans each job of the same model again, and each account runs a whole step under the tracker
    (seconds on a small CPU).

    ``model`` is any classifier: one without an engine body is accounted as its chain (:func:`planned`), the model
    the plan applies to and the trainer runs.
    """
    model = planned(model, step.size)
    loss = _loss_key(loss_fn)
    if loss is None:
        return account_step(model, step, p.batch, p.apply, loss_fn, stage_peaks=stage_peaks)
    key = (profiles.model_key(model, step.size, "cpu"),
           tuple((n, tuple(t.shape), t.dtype, t.requires_grad) for n, t in model.named_parameters()),
           tuple((n, tuple(t.shape), t.dtype) for n, t in model.named_buffers()),
           tuple(str(m) for m in getattr(engine_body(model), "modes", ())),  # () for a model without an engine
           step, p.batch, p.modes, p.segments, p.slices, p.floor_restore, loss, active_key())
    if key not in _ACCOUNTS or (stage_peaks is not None and key not in _STAGE_PEAKS):
        peaks: dict[int, int] = {}
        _ACCOUNTS[key] = account_step(model, step, p.batch, p.apply, loss_fn, stage_peaks=peaks)
        _STAGE_PEAKS[key] = peaks
    if stage_peaks is not None:
        stage_peaks.update(_STAGE_PEAKS[key])
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
                      p.step_seconds, getattr(solver, "profile", None), p.slices, p.floor_restore)
    summary["stages"] = tp.stages(solver.model)
    return tp


# ---- the solver-specific entry points (tests, benchmarks): the same loop ------------------------------------------


@dataclass(frozen=True)
class ModelPlan:
    plan: Plan
    profile: Profile
    fitted_peak_bytes: int  # the knapsack's own prediction
    solve_seconds: float
    slices: tuple[int, ...] | None = None  # per stage, the batch-slice budget the peak was accounted at

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
                     tp.fitted_peak_bytes, tp.solve_seconds, tp.slices)


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
           steps: int = 2, segments: tuple | None = None, slices: tuple[int, ...] | None = None) -> dict:
    """Run real training steps with the plan: measured peak bytes and seconds per step. The plan stays set on
    ``model``; its batch norms' statistics, gradients and modes are left as they were (steps on random images moved
    the statistics off their defaults, and a trainer then took a random network for a pretrained one)."""
    apply_plan(model, modes, segments, slices)
    with left_as_it_was(model):
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

