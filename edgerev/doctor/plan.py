"""The doctor's verified plan: the configured model planned under the configured cap, then a few real steps.

The recipe is the daemon's job recipe with distillation on (every job after the first has a teacher), run as the
trainer runs it (:func:`edgerev.train.memory.training_model`: a model from outside as its chain, the recipe's
trainable set and batch-norm statistics; ``train.trainable: auto``'s set and optimizer state chosen under the cap;
the rate and clipping of how the job starts), and with FixMatch on (``semi``, every daemon preset) a step of a job
with unlabelled images in its inbox: ``semi.ratio`` strong views per labelled sample join the batch, after their
weak views' forward. Planning:

- with the stage profile the daemon's planner uses (cached after its first job, or measured now with
  ``profile="measure"``): :func:`edgerev.memory.plan.autoplan.plan_training`, the daemon's own plan;
- without one (measuring it takes minutes on a small CPU, too long for a first look): the least-memory modes
  (the planner's floor) at the largest micro-batch whose whole step, accounted exactly on fake tensors, fits
  the cap. That plan trains under the cap, and the daemon's will be at least as fast.

Then ``steps`` real training steps of the plan, through the trainer's own :func:`edgerev.train.cap.train_step`
on random images: on CPU under the run's :class:`~edgerev.train.cap.CpuCap` (its first step tracked and
enforced, as in the trainer), on CUDA under the allocator's cap; the measured peak is set against the cap.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import asdict, dataclass, replace

from edgerev.train.config import RunConfig


@dataclass(frozen=True)
class PlanFacts:
    arch: str
    size: int
    device: str
    batch: int  # samples per optimizer step (train.batch)
    budget_bytes: int | None
    planner: str = ""  # how the plan was made
    micro_batch: int | None = None
    micro_batches: int | None = None
    modes: tuple[str, ...] | None = None
    predicted_peak_bytes: int | None = None
    smallest_bytes: int | None = None  # the least budget that trains this step (batch 1, least-memory modes)
    measured_peak_bytes: int | None = None
    steps: int = 0
    step_seconds: float | None = None
    retries: int = 0  # the batch split again after running out of memory
    plan_seconds: float | None = None
    error: str | None = None
    advice: str = ""
    unlabeled: int = 0  # FixMatch's strong views the step adds to the batch (semi.ratio per sample; 0: FixMatch off)

    def to_json(self) -> dict:
        return {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(self).items()}


def _largest_fitting(model, shape, floor, floor_account, budget: int, loss_fn):
    """The least-memory modes at the largest micro-batch whose exact account fits ``budget``."""
    from edgerev.memory.plan.autoplan import Proposal, accounted

    batch = shape.batch

    def at(b: int):
        p = Proposal(b, floor.modes, floor.segments, 0, 0.0, floor_restore=floor.floor_restore)
        return p, accounted(model, shape, p, loss_fn)

    best = (floor, floor_account)
    if batch == 1:
        return best
    full = at(batch)
    if full[1].total <= budget:
        return full
    # bytes grow linearly with the micro-batch: aim at the line through 1 and the whole batch, then step down
    slope = (full[1].total - floor_account.total) / (batch - 1)
    b = max(1, min(batch - 1, 1 + int((budget - floor_account.total) / slope))) if slope > 0 else 1
    while b > 1:
        p = at(b)
        if p[1].total <= budget:
            return p
        b = max(1, b - max(1, math.ceil((p[1].total - budget) / slope)))
    return best


def verified_plan(cfg: RunConfig, device: str, classes: int = 10, steps: int = 2, profile: str = "cached",
                  seed: int = 0) -> PlanFacts:
    """Plan ``cfg``'s model under ``cfg.memory.budget`` and run ``steps`` real steps of the plan.

    Args:
        cfg: the job's recipe (model, size, batch, optimizer, distillation, memory).
        device: ``cpu`` or ``cuda`` (the config's device, resolved).
        classes: classes of the model's head.
        steps: real training steps of the plan; 0: only set the cap against the step's floor (seconds).
        profile: ``cached``: the daemon's plan if its stage profile is cached, else the least-memory modes;
            ``measure``: measure the profile if missing (minutes on a small CPU; cached for the daemon).

    Never raises for what it finds: a budget below the floor, a step that does not fit, a CUDA error are
    the fact's ``error``.
    """
    import torch

    from edgerev._torchapi import storage_bytes
    from edgerev.errors import EdgerevError, described
    from edgerev.memory.measure import profile as profiles
    from edgerev.memory.measure.tracker import MemoryTracker
    from edgerev.memory.plan.autoplan import floor_plan, plan_training
    from edgerev.models.resolve import resolve_model
    from edgerev.models.spec import check_size
    from edgerev.train.cap import CpuCap, apply_cuda_cap, train_step
    from edgerev.train.memory import fit_trainable, loss_of, step_shape, training_model
    from edgerev.train.optim import sgd
    from edgerev.train.semi import pseudo_label, step_targets, weak_probs
    from edgerev.train.trainer import pretrained_source, run_start

    t = cfg.train
    budget = None if cfg.memory.budget is None else int(cfg.memory.budget)
    u = cfg.semi.ratio * t.batch if cfg.semi.enabled else 0  # a job with unlabelled images: its costliest step
    facts = PlanFacts(cfg.model.arch, cfg.data.size, device, t.batch, budget, unlabeled=u)
    t0 = time.perf_counter()
    try:
        torch.manual_seed(seed)
        handle = resolve_model(cfg.model.arch, weights=cfg.model.weights, args=cfg.model.args, num_classes=classes,
                               trust_factories=cfg.model.factories)
        check_size(handle, cfg.data.size)
        teacher = None
        if cfg.continual.distill > 0:  # jobs after the first distill from the model in service
            teacher = copy.deepcopy(handle.module).eval().requires_grad_(False)
        # what the trainer's steps run: the model itself or, for a model from outside, its chain; the recipe's
        # trainable set and batch-norm statistics applied
        model = training_model(cfg, handle)
        shape = step_shape(cfg, model, teacher, t.batch, u)
        loss_fn = loss_of(cfg, u)
        whole = shape.batch  # the labelled samples and the strong views
        trained = {}
        if budget is not None:  # train.trainable: auto chooses its set under the cap, as the trainer's plan does
            trained, shape = fit_trainable(cfg, model, shape, budget, loss_fn)
        floor, floor_account = floor_plan(model, shape, loss_fn)  # exact, nothing profiled
        facts = replace(facts, smallest_bytes=floor_account.total)
        if budget is not None and budget < floor_account.total:
            return replace(facts, error=f"the cap {budget:,} bytes is below the least this step needs, "
                           f"{floor_account.total:,} bytes (batch 1 in the least-memory modes)",
                           advice=f"raise training.memory.budget to at least {floor_account.total:,} bytes, or "
                                  "lower training.train.batch or the model's width")
        if steps == 0:  # the cap against the floor only: nothing runs, so no micro-batch is searched
            return replace(facts, planner="the floor only (no steps)", plan_seconds=time.perf_counter() - t0)
        estimate = cfg.memory.profile == "estimate"
        prof = None
        if budget is not None:
            prof = profiles.cached_profile(model, cfg.data.size, device, estimate=estimate, exact=True)
            if prof is None and profile == "measure":
                prof = profiles.load_or_measure(model, cfg.data.size, device, estimate=estimate, exact=True)
        if budget is None:
            planner, micro, modes, predicted = "the model's default modes (no cap)", whole, None, None
        elif prof is not None:
            tp = plan_training(model, cfg.data.size, budget, device, estimate=estimate, max_batch=whole,
                               step=shape, loss_fn=loss_fn, profile=prof)
            tp.apply(model)
            planner, micro, modes, predicted = f"the daemon's plan, {tp.summary['planner']}", tp.batch, tp.modes, \
                tp.predicted_peak_bytes
            baseline = tp.account.baseline if tp.account is not None else floor_account.baseline
        else:
            p, account = _largest_fitting(model, shape, floor, floor_account, budget, loss_fn)
            p.apply(model)
            planner = ("least-memory modes; the daemon plans faster ones from its stage profile, measured at its "
                       "first job (or now: --profile measure)")
            micro, modes, predicted, baseline = p.batch, p.modes, account.total, account.baseline
        if trained:
            planner += f" (trains {trained['trainable']}, optimizer state {trained['optimizer_state']})"
        facts = replace(facts, planner=planner, micro_batch=micro, micro_batches=math.ceil(whole / micro),
                        modes=modes, predicted_peak_bytes=predicted, plan_seconds=time.perf_counter() - t0)

        dev = torch.device(device)
        model.to(dev).train()
        if teacher is not None:
            teacher.to(dev)
        params = [p for p in model.parameters() if p.requires_grad]
        # the job's recipe: a job after the first (one that distils) starts from the model in service, trained
        optim = cfg.optim.resolved(run_start(handle, teacher is not None or pretrained_source(cfg, handle) is not None),
                                   t.batch)
        momentum = optim.momentum if shape.momentum else 0.0  # auto may drop it (or keep it in bfloat16)
        optimizer = sgd(params, lr=optim.lr, momentum=momentum, nesterov=optim.nesterov and momentum > 0,
                        weight_decay=optim.weight_decay, state_bytes=shape.state_bytes)
        g = torch.Generator().manual_seed(seed)
        x = torch.randn(t.batch, handle.in_channels, cfg.data.size, cfg.data.size, generator=g).to(dev)
        y = torch.randint(0, classes, (t.batch,), generator=g).to(dev)
        views = torch.randn(2, u, handle.in_channels, cfg.data.size, cfg.data.size, generator=g).to(dev) if u else None
        cap = None
        if dev.type == "cuda":
            if budget is not None:
                apply_cuda_cap(budget, dev)
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
        elif budget is not None:
            cap = CpuCap(budget, baseline)
        n, retries, times, peak = math.ceil(whole / micro), 0, [], 0
        for _ in range(steps):
            batch, target = x, (y,)
            if u:  # as the trainer's step: pseudo-labels from the weak views, the strong views join the batch
                pseudo, mask = pseudo_label(weak_probs(model, views[0], n, cap), cfg.semi.threshold)
                batch, target = torch.cat([x, views[1]]), step_targets(y, pseudo, mask, cfg.semi.weight)
            if teacher is not None:
                with torch.no_grad():
                    target = (*target, teacher(batch))
            s0 = time.perf_counter()
            if cap is None and dev.type == "cpu":
                base = storage_bytes([*model.parameters(), *model.buffers(), batch, *target])
                with MemoryTracker(baseline=base) as tracker:  # no cap: measured, not enforced
                    res = train_step(model, optimizer, batch, target, micro_batches=n, loss_fn=loss_fn,
                                     clip_grad_norm=optim.clip_grad_norm, adaptive_clip=optim.adaptive_clip)
                peak = max(peak, tracker.peak)
            else:
                res = train_step(model, optimizer, batch, target, micro_batches=n, loss_fn=loss_fn,
                                 clip_grad_norm=optim.clip_grad_norm, adaptive_clip=optim.adaptive_clip, cap=cap)
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            times.append(time.perf_counter() - s0)
            retries += res.retries
            n = res.micro_batches
        if dev.type == "cuda":
            peak = int(torch.cuda.max_memory_allocated(dev))
        elif cap is not None:
            peak = cap.peak
        return replace(facts, measured_peak_bytes=peak, steps=steps, micro_batches=n,
                       step_seconds=min(times) if times else None, retries=retries)
    # a failed step, a model that refuses the size, CUDA, or whatever else torch raises for this model: said, not raised
    except Exception as e:  # noqa: BLE001
        text = str(e).strip().splitlines()[0] if isinstance(e, (EdgerevError, ValueError, RuntimeError)) and \
            str(e).strip() else described(e)  # the message as it is, or with its type where that says more
        return replace(facts, error=text, advice=facts.advice or "see the error; edgerev plan shows the planning "
                       "step by step")
