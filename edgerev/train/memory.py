"""A recipe's memory: its step as the accounting sees it, its plan under ``memory.budget``, its floor.

The trainer (:func:`plan_memory`) and the daemon's start check (:func:`floor`) both read the recipe
through :func:`step_shape`, and both ask :mod:`edgerev.memory.plan.autoplan`, which accounts every step
with :func:`edgerev.memory.measure.account.account_step`: one count of what a step holds, everywhere.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from edgerev.engine import engine_body
from edgerev.memory.measure.account import StepAccount, StepShape
from edgerev.memory.plan.autoplan import TrainingPlan, floor_plan, plan_training
from edgerev.memory.plan.device_fit import cuda_step_peak, fit_to_device
from edgerev.models.handle import ModelHandle
from edgerev.models.spec import model_spec
from edgerev.train.cap import CpuCap, apply_cuda_cap
from edgerev.train.config import RunConfig
from edgerev.train.continual import ContinualLoss
from edgerev.train.semi import SemiLoss


def _module(model: nn.Module | ModelHandle) -> nn.Module:
    """The module a handle holds (the planner's functions take either)."""
    return model.module if isinstance(model, ModelHandle) else model


def _bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def step_shape(cfg: RunConfig, model: nn.Module | ModelHandle, teacher: nn.Module | ModelHandle | None,
               batch: int | None, unlabeled: int = 0) -> StepShape:
    """What ``cfg`` adds to a step of ``model``: the batch of ``batch`` labelled samples (replay included;
    None: the planner's to choose, as ``edgerev plan`` without ``--batch``) and ``unlabeled`` strong views
    (FixMatch, :mod:`edgerev.train.semi`), SGD momentum, and the distillation ``teacher`` and its logits."""
    teacher = _module(teacher) if teacher is not None else None
    return StepShape(cfg.data.size, None if batch is None else batch + unlabeled, momentum=cfg.optim.momentum > 0,
                     teacher_bytes=_bytes(teacher) if teacher is not None else 0,
                     teacher_classes=model_spec(teacher).num_classes if teacher is not None else 0,
                     unlabeled=unlabeled)


def loss_of(cfg: RunConfig, unlabeled: int = 0) -> ContinualLoss | SemiLoss:
    """The step's loss: labels (and distillation); with ``unlabeled`` views, weighted per sample."""
    base = ContinualLoss(cfg.continual.distill, cfg.continual.temperature, cfg.optim.label_smoothing)
    return SemiLoss(base) if unlabeled else base


def floor(cfg: RunConfig, model: nn.Module | ModelHandle, teacher: nn.Module | ModelHandle | None,
          batch: int | None = None, unlabeled: int = 0, budget: int | None = None) -> StepAccount:
    """The least a step of ``cfg`` can hold (batch 1 in the least-memory plan): the smallest budget. With a
    ``budget``: a floor's account at most the budget where one fits (whether the budget trains, in a few accounts),
    else the least."""
    model = _module(model)
    shape = step_shape(cfg, model, teacher, batch or cfg.train.batch, unlabeled)
    return floor_plan(model, shape, loss_of(cfg, unlabeled), budget)[1]


def training_model(cfg: RunConfig, model: nn.Module | ModelHandle) -> nn.Module:
    """What the trainer's steps run for ``model``, with ``train.trainable`` and ``train.bn_stats`` applied.

    An edgerev model runs itself. Any other classifier runs as its chain (:mod:`edgerev.memory.graph`),
    which shares its weights: its frozen prefix keeps nothing and a plan under ``memory.budget`` can
    checkpoint its segments. ``auto`` is chosen under the budget by :func:`plan_memory`; until then every
    parameter trains.

    Raises:
        ConfigError: a trainable set or batch-norm choice the model cannot take (naming the key).
    """
    from edgerev.config import ConfigError
    from edgerev.memory.graph import GraphError, has_engine_body
    from edgerev.train.trainable import TrainableError, parse_trainable, set_trainable

    model = _module(model)
    t = parse_trainable(cfg.train.trainable)
    if t.kind == "auto" and cfg.memory.budget is None:
        raise ConfigError("train.trainable: auto chooses the set that fits memory.budget; set a budget or a set")
    try:
        if has_engine_body(model):
            if t.kind not in ("all", "auto") or cfg.train.bn_stats == "frozen":
                set_trainable(model, "all" if t.kind == "auto" else t, cfg.train.bn_stats)
            return model
        return set_trainable(model, "all" if t.kind == "auto" else t, cfg.train.bn_stats, size=cfg.data.size)
    except GraphError:
        if t.kind == "all" and cfg.train.bn_stats == "updated" and cfg.memory.budget is None:
            return model  # nothing to plan and nothing frozen: plain autograd on the model as it is
        raise
    except TrainableError as e:
        key = "train.bn_stats" if "frozen" in str(e) and cfg.train.bn_stats == "frozen" else "train.trainable"
        raise ConfigError(f"{key}: {e}") from None


@dataclass(frozen=True)
class MemoryPlan:
    """What :func:`plan_memory` set up for a run.

    Attributes:
        micro_batches: micro-batches per step.
        cap: the CPU cap the steps run under (None: none).
        summary: the plan as the run's summary records it.
        momentum: whether the optimizer keeps the recipe's momentum (False also where the recipe has none):
            ``train.trainable: auto`` drops it where that lets more parameters train (and :attr:`state_bytes` says
            whether it keeps it in bfloat16).
        state_bytes: bytes per element of the momentum buffer: 4 (float32), or 2 where ``train.trainable:
            auto`` keeps it in bfloat16 (:func:`edgerev.train.optim.keep_state_in`).
    """

    micro_batches: int
    cap: CpuCap | None
    summary: dict
    momentum: bool
    state_bytes: int = 4


def fit_trainable(cfg: RunConfig, model: nn.Module, shape: StepShape, budget: int,
                  loss_fn: Callable[..., Tensor]) -> tuple[dict, StepShape]:
    """With ``train.trainable: auto``, the most parameters whose step fits ``budget``, momentum kept where it fits,
    set on ``model`` (:func:`edgerev.train.trainable.choose_fit`): what the plan's summary says of it, and the step
    with its optimizer state (``momentum``, ``state_bytes``). Any other set is ``model``'s already
    (:func:`training_model`): nothing to say, the step as it is."""
    if cfg.train.trainable != "auto":
        return {}, shape
    from edgerev.train.trainable import choose_fit

    fit = choose_fit(model, shape, budget, cfg.train.bn_stats, loss_fn)
    return fit.summary(), fit.step(shape)


def plan_memory(cfg: RunConfig, model: nn.Module, teacher: nn.Module | None, batch: int,
                device: torch.device, unlabeled: int = 0) -> MemoryPlan:
    """The plan of ``cfg``'s step at ``batch`` labelled samples and ``unlabeled`` strong views per step (their
    weak views' forward counted too), applied to ``model``.

    With ``train.trainable: auto`` the summary says what trains (``trainable``) and whether the optimizer keeps
    its momentum (``optimizer_state``: ``kept``, ``bfloat16``, ``dropped`` or ``none``), which ``momentum`` and
    ``state_bytes`` carry.

    On CUDA the cap is set first and the plan is fitted to the allocator with real steps
    (:func:`~edgerev.memory.plan.device_fit.fit_to_device`): the summary's ``device_fit`` lists each plan measured.

    Raises:
        BudgetTooSmall: ``memory.budget`` is below the step's floor (named), before anything is profiled.
    """
    mem, momentum = cfg.memory, cfg.optim.momentum > 0
    if mem.mode == "plain":
        return MemoryPlan(1, None, {"mode": "plain"}, momentum)
    body = engine_body(model)
    if mem.budget is None and body is None:  # a model from outside: plain autograd, nothing to plan
        if mem.mode != "auto":
            from edgerev.config import ConfigError

            raise ConfigError(f"memory.mode: {mem.mode} is for edgerev's reversible models; this one trains "
                              "through plain autograd (leave mode at auto, or set memory.budget to plan it)")
        return MemoryPlan(1, None, {"mode": "plain"}, momentum)
    if mem.budget is None:
        if mem.mode != "auto":
            body.set_modes(mem.mode)
        return MemoryPlan(1, None, {"mode": mem.mode, "stages": [
            {"name": n, "type": type(s).__name__, "mode": m.value}
            for (n, s), m in zip(body.stages.named_children(), body.modes)]}, momentum)
    budget = int(mem.budget)
    shape, loss_fn = step_shape(cfg, model, teacher, batch, unlabeled), loss_of(cfg, unlabeled)
    batch = shape.batch  # the step's whole batch, the strong views with the labelled samples
    trainable, shape = fit_trainable(cfg, model, shape, budget, loss_fn)

    def plan_at(b: int) -> TrainingPlan:
        return plan_training(model, cfg.data.size, b, str(device.type), estimate=mem.profile == "estimate",
                             max_batch=batch, step=shape, loss_fn=loss_fn)

    fitted: dict = {}
    if device.type == "cuda":  # the allocator holds more than the accounting sees: measured under the cap
        apply_cuda_cap(budget, device)
        on_device = teacher is None or all(p.is_cuda for p in teacher.parameters())
        fit = fit_to_device(plan_at, lambda p: cuda_step_peak(model, p, shape, loss_fn, device, on_device), budget)
        tp, fitted = fit.plan, fit.summary()
    else:
        tp = plan_at(budget)
    tp.apply(model)
    micro = math.ceil(batch / tp.batch)
    summary = {"mode": "planned", "budget_bytes": budget, "micro_batch": tp.batch, "micro_batches": micro,
               **trainable, **tp.summary, **fitted}
    cap = CpuCap(budget, tp.account.baseline) if device.type == "cpu" and tp.account is not None else None
    return MemoryPlan(micro, cap, summary, shape.momentum, shape.state_bytes)
