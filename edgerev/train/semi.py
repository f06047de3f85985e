"""Learning from unlabelled images: FixMatch (Sohn et al., NeurIPS 2020) in the trainer's step.

A step of ``B`` labelled images takes ``U = ratio * B`` unlabelled ones as well (fewer when fewer exist):

1. the weak view of each (the recipe's own augmentation) runs through the model being trained without
   gradient (:func:`weak_probs`), in micro-batches of the plan, under the run's memory cap; the batch
   norms normalize with the views' own statistics, as in the paper's shared batch, and their running
   statistics are put back after: the step's one update comes from the step itself;
2. an image whose top probability reaches ``semi.threshold`` takes that class as its pseudo-label, a
   class at most its quota of them, its most confident first (:func:`pseudo_label`, :func:`quotas`);
3. the strong views join the labelled batch as one batch of ``B + U`` with a weight per sample
   (:func:`step_targets`): the step's loss (:class:`SemiLoss`, the mean of weight times cross-entropy) is
   then ``CE(labelled) + weight * sum(mask * CE(strong, pseudo)) / U``, the paper's, and the micro-batch
   loop's share-of-the-batch weighting keeps it exact under accumulation.

The step's one memory accounting (:mod:`edgerev.memory.measure.account`, ``StepShape.unlabeled``) counts the
``B + U`` batch, the per-sample weights, and the weak view's no-grad forward. Pseudo-labels exist only
inside a step: they never reach the held-out evaluation, the replay sample or the promotion gate.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev._torchapi import restore_buffers, save_buffers
from edgerev.memory.measure.microbatch import split_batch, step_signature
from edgerev.train.cap import CpuCap, cpu_cap


def quotas(labels: Tensor, num_classes: int, unlabeled: int, class_cap: float | None) -> Tensor | None:
    """Per class, the most pseudo-labels a step of ``unlabeled`` images may give it: ``class_cap`` times the
    class's share of the labelled ``labels``, of ``unlabeled`` (rounded up; at least 1). None: no cap."""
    if class_cap is None:
        return None
    counts = torch.bincount(labels, minlength=num_classes).double()
    share = counts / max(1.0, float(counts.sum()))
    return torch.ceil(class_cap * share * unlabeled).long().clamp_min(1)


def pseudo_label(probs: Tensor, threshold: float, quota: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """``(labels, mask)`` of a step's unlabelled images from their weak views' class probabilities.

    An image is pseudo-labelled (``mask`` True) when its top probability is at least ``threshold`` and, with
    a ``quota`` per class, it is among its class's ``quota`` most confident such images. Nothing here keeps
    a gradient: the weak view is a target, never trained.
    """
    probs = probs.detach()
    conf, labels = probs.max(dim=1)
    mask = conf >= threshold
    if quota is not None:
        for c in labels[mask].unique().tolist():
            members = torch.nonzero(mask & (labels == c)).flatten()
            limit = int(quota[c])
            if len(members) > limit:
                order = torch.argsort(conf[members], descending=True, stable=True)
                mask[members[order[limit:]]] = False
    return labels, mask


def step_targets(labels: Tensor, pseudo: Tensor, mask: Tensor, weight: float) -> tuple[Tensor, Tensor]:
    """The labels and per-sample weights of the batch ``[labelled; strong views]`` (see the module docstring).

    A labelled sample weighs ``n / B`` and a strong view ``weight * mask * n / U`` (``n = B + U``), so the mean
    of weight times cross-entropy over the batch is FixMatch's loss.
    """
    b, u = len(labels), len(pseudo)
    n = b + u
    w = torch.cat([torch.full((b,), n / b, device=labels.device), weight * mask.float().to(labels.device) * (n / u)])
    return torch.cat([labels, pseudo.to(labels.device)]), w


class SemiLoss:
    """``mean(weights * CE(logits, labels))``, plus ``base``'s distillation when a teacher's logits come with
    the batch (over every sample: the old model's outputs are a target on any image, LwF's point).

    Called by :func:`edgerev.train.cap.train_step` as ``loss(logits, labels, weights[, teacher_logits])``.
    """

    def __init__(self, base) -> None:
        self.base = base

    @property
    def memory_key(self) -> tuple:
        """What a step's memory depends on in this loss (:class:`edgerev.memory.plan.autoplan.DescribedLoss`): the
        weighted per-sample cross-entropy, and ``base``'s distillation. The planner keeps a step's account under it,
        so that a daemon's job (``semi`` is on by default) accounts each proposal once."""
        return ("semi", *self.base.memory_key)

    def __call__(self, logits: Tensor, labels: Tensor, weights: Tensor, teacher: Tensor | None = None) -> Tensor:
        from edgerev.train.continual import distillation_loss

        ce = F.cross_entropy(logits, labels, reduction="none", label_smoothing=self.base.label_smoothing)
        loss = (weights * ce).mean()
        if teacher is not None and self.base.distill > 0:
            loss = loss + self.base.distill * distillation_loss(logits, teacher, self.base.temperature)
        return loss


def weak_probs(model: nn.Module, x: Tensor, micro_batches: int, cap: CpuCap | None = None) -> Tensor:
    """Class probabilities of the weak views ``x`` (normalized floats), without gradient, in the step's
    micro-batches, under the run's CPU cap (verified on the first forward of each shape, as a step is).

    The model stays in training mode (its batch norms normalize by the views' statistics); every buffer it
    had (running statistics) is put back after, so the weak forward is no update.
    """
    buffers = save_buffers(model)
    key = ("weak", tuple(x.shape), micro_batches, *step_signature(model, x[:1], (), micro_batches))
    check = cap is not None and cap.needs_check(key)
    guard = cpu_cap(cap.budget, cap.baseline) if check else contextlib.nullcontext()
    out = []
    try:
        with torch.no_grad(), guard as tracker:
            for part in split_batch(len(x), micro_batches):
                out.append(F.softmax(model(x[part]).float(), dim=1))
    finally:
        restore_buffers(model, buffers)
    if check:
        cap.verified(key)
        cap.peak = max(cap.peak, tracker.peak)
    return torch.cat(out)


class UnlabeledOrder:
    """Which unlabelled images a step takes: ``per_step`` of the ``n`` images, in a fresh seeded order each
    time the pool is used up (independent of the labelled order, so a resumed run draws the same ones)."""

    def __init__(self, n: int, per_step: int, seed: int) -> None:
        self.n, self.per_step, self.seed = n, per_step, seed

    def at(self, step: int) -> Tensor:
        start = step * self.per_step
        rounds = range(start // self.n, (start + self.per_step - 1) // self.n + 1)
        order = torch.cat([torch.randperm(self.n, generator=torch.Generator().manual_seed(
            self.seed * 7_919 + 1_000_033 * r + 17)) for r in rounds])
        offset = start - rounds[0] * self.n
        return order[offset:offset + self.per_step]


def per_step(ratio: int, batch: int, pool: int) -> int:
    """The unlabelled images a step takes: ``ratio`` per labelled one, at most the pool (0: no pool)."""
    return min(ratio * batch, pool)


def semi_summary(epochs: Sequence[dict], pool: int, per: int) -> dict:
    """The summary's ``semi`` block: the pool, the images per step, and per epoch how many unlabelled images
    the steps took and how many of them got a pseudo-label."""
    return {"unlabeled_pool": pool, "unlabeled_per_step": per, "epochs": list(epochs),
            "unlabeled_used": sum(e["unlabeled"] for e in epochs),
            "pseudo_labeled": sum(e["pseudo_labeled"] for e in epochs)}


def semi_counts(summary: dict | None) -> dict | None:
    """A job's ``semi`` summary without its per-epoch list (what a version's record keeps): the pool, the views
    the steps took and those pseudo-labelled, and the last epoch's pass (``last_epoch``: how many of the pool's
    images the finished model's training last took, and gave a pseudo-label). None: no unlabelled image."""
    if not summary:
        return None
    epochs = summary.get("epochs") or []
    return {k: summary.get(k) for k in ("unlabeled_pool", "unlabeled_per_step", "unlabeled_used", "pseudo_labeled")} | {
        "epochs": len(epochs), "last_epoch": dict(epochs[-1]) if epochs else None}
