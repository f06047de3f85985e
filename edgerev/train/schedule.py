"""The learning rate at each step: the recipe's schedule, and the anneal that ends a run early stopping cut short.

A schedule (``optim.schedule``) is laid over the epoch maximum (``train.epochs``): a run that reaches it
ends at a learning rate near 0. Early stopping (``train.patience``) ends a run wherever its held-out
figures stop improving, which with a one-cycle schedule over 30 epochs is often at half the peak; a
model left there sits on a noisy point of its trajectory and is judged by the promotion gate as it is.
So once patience runs out the run does not stop at once: it follows a :class:`Tail` of
``train.anneal_epochs`` epochs, a half cosine from the schedule's rate at that step down to 0, then
stops (the tail ends no later than the epoch maximum).

Everything here is a function of the step and of where patience ran out, which the trainer rebuilds
from the held-out rows of ``metrics.jsonl``: a resumed run takes the very same rate at every step as
one that was never interrupted.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from edgerev.train.config import OptimConfig


@dataclass(frozen=True)
class Tail:
    """The anneal after early stopping: steps ``start`` (the step after the epoch patience ran out
    on) to ``end`` (exclusive: the run's last step is ``end - 1``)."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not 0 <= self.start <= self.end:
            raise ValueError(f"an anneal runs forward: start {self.start}, end {self.end}")


def tail_after(ran_out_epoch: int, per_epoch: int, anneal_epochs: int, total: int) -> Tail:
    """The tail of a run whose patience ran out at the end of epoch ``ran_out_epoch`` (1-based)."""
    start = min(ran_out_epoch * per_epoch, total)
    return Tail(start, min(start + anneal_epochs * per_epoch, total))


def scheduled(step: int, total: int, cfg: OptimConfig) -> float:
    """The schedule alone, over ``total`` steps.

    One-cycle: linear warm-up from ``lr/25`` to ``lr`` over ``warmup`` of the steps, then cosine
    annealing to ``lr/25e4`` (the shape of ``torch.optim.lr_scheduler.OneCycleLR``); linear: the RevNeXt
    authors' piecewise-linear cycle, from 0 up to ``lr`` over ``warmup`` of the steps and straight back
    down towards 0; or constant.
    """
    if cfg.schedule == "constant":
        return cfg.lr
    rise = max(1, int(round(cfg.warmup * total)))
    if cfg.schedule == "linear":
        if step < rise:
            return cfg.lr * step / rise
        return cfg.lr * max(0.0, total - step) / max(1, total - rise)
    start, end = cfg.lr / 25, cfg.lr / 25e4
    if step < rise:
        return start + (cfg.lr - start) * step / rise
    t = (step - rise) / max(1, total - rise)
    return end + (cfg.lr - end) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


def lr_at(step: int, total: int, cfg: OptimConfig, tail: Tail | None = None) -> float:
    """The rate of ``step`` (0-based) in a run of at most ``total`` steps, annealed along ``tail`` from its
    start when early stopping has set one: ``lr0 * (1 + cos(pi * (step - start) / (end - start))) / 2``,
    ``lr0`` the schedule's rate at ``start``, so the curve is continuous and its last step is near 0."""
    if tail is None or step < tail.start or tail.end == tail.start:
        return scheduled(step, total, cfg)
    lr0 = scheduled(tail.start, total, cfg)
    t = min(step - tail.start, tail.end - tail.start) / (tail.end - tail.start)
    return lr0 * 0.5 * (1 + math.cos(math.pi * t))
