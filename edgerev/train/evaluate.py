"""Accuracy of a model on labelled images: overall, per class, and split into old and new classes.

An evaluation can be long (a service's held-out samples, thousands of images): given a ``stop`` callable it
asks it between two batches and raises :class:`EvaluationStopped` once it says so, so a stop request waits one
batch, never the whole set. (Not before the first: a caller asks after the work that came before, and an
evaluation of one batch asks nothing.)
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from edgerev.models.directory import ModelInfo, normalize
from edgerev.train.labeled import LabeledImages


class EvaluationStopped(Exception):  # noqa: N818 (not an error: the caller was asked to stop)
    """``stop()`` said so between two batches of an evaluation; nothing of it is kept."""


@torch.no_grad()
def predict_logits(model: nn.Module, data: LabeledImages, info: ModelInfo, device: str | torch.device = "cpu",
                   batch: int = 256, stop: Callable[[], bool] | None = None) -> torch.Tensor:
    """Logits of every sample (eval mode; the model's training mode is restored after).

    Raises:
        EvaluationStopped: ``stop()``, asked between two batches, said so.
    """
    was = model.training
    model.eval()
    out = []
    try:
        for i in range(0, len(data), batch):
            if i and stop is not None and stop():
                raise EvaluationStopped(f"stopped after {i} of {len(data)} samples")
            out.append(model(normalize(data.images[i:i + batch].to(device), info)).float().cpu())
    finally:
        model.train(was)
    return torch.cat(out) if out else torch.zeros(0, len(info.classes))


def _accuracy(correct: torch.Tensor, mask: torch.Tensor) -> float | None:
    n = int(mask.sum())
    return float(correct[mask].float().mean()) if n else None


def evaluate(model: nn.Module, data: LabeledImages, info: ModelInfo, device: str | torch.device = "cpu",
             batch: int = 256, old: Collection[str] = (), stop: Callable[[], bool] | None = None) -> dict:
    """Loss and accuracy on ``data`` (labels must index ``info.classes``).

    Args:
        old: names of the classes the starting model knew; ``old_acc`` and ``new_acc`` are the
            accuracies on samples of those classes and of the others (None when there are none).
        stop: asked between two batches (:func:`predict_logits`).

    Raises:
        EvaluationStopped: ``stop()`` said so.
    """
    if data.classes != info.classes:
        data = data.relabel(info.classes)
    logits = predict_logits(model, data, info, device, batch, stop)
    if len(data) == 0:
        return {"samples": 0, "loss": None, "acc": None, "old_acc": None, "new_acc": None, "per_class": {},
                "confusion": confusion([], [], info.classes)}
    correct = logits.argmax(1) == data.labels
    is_old = torch.tensor([c in set(old) for c in info.classes])[data.labels]
    per_class = {c: _accuracy(correct, data.labels == k) for k, c in enumerate(info.classes)}
    return {
        "samples": len(data),
        "loss": float(F.cross_entropy(logits, data.labels)),
        "acc": float(correct.float().mean()),
        "old_acc": _accuracy(correct, is_old),
        "new_acc": _accuracy(correct, ~is_old),
        "per_class": {c: a for c, a in per_class.items() if a is not None},
        "confusion": confusion([info.classes[k] for k in data.labels.tolist()],
                               [info.classes[k] for k in logits.argmax(1).tolist()], info.classes),
    }


def confusion(truth: Sequence[str], predicted: Sequence[str], labels: Sequence[str],
              columns: Sequence[str] | None = None) -> dict:
    """``{"labels", "predicted", "matrix"}``: ``matrix[i][j]`` counts samples of ``labels[i]`` predicted as
    ``columns[j]`` (default: the labels; a model may predict classes the data lacks, and the reverse)."""
    labels = list(labels)
    columns = labels if columns is None else list(columns)
    matrix = [[0] * len(columns) for _ in labels]
    for t, p in zip(truth, predicted, strict=True):
        matrix[labels.index(t)][columns.index(p)] += 1
    return {"labels": labels, "predicted": list(columns), "matrix": matrix}
