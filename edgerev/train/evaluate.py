"""Accuracy of a model on labelled images: overall, per class, and split into old and new classes."""

from __future__ import annotations

from collections.abc import Collection

import torch
import torch.nn.functional as F
from torch import nn

from edgerev.train.checkpoint import ModelInfo, normalize
from edgerev.train.labeled import LabeledImages


@torch.no_grad()
def predict_logits(model: nn.Module, data: LabeledImages, info: ModelInfo, device: str | torch.device = "cpu",
                   batch: int = 256) -> torch.Tensor:
    """Logits of every sample (eval mode; the model's training mode is restored after)."""
    was = model.training
    model.eval()
    try:
        out = [model(normalize(data.images[i:i + batch].to(device), info)).float().cpu()
               for i in range(0, len(data), batch)]
    finally:
        model.train(was)
    return torch.cat(out) if out else torch.zeros(0, len(info.classes))


def _accuracy(correct: torch.Tensor, mask: torch.Tensor) -> float | None:
    n = int(mask.sum())
    return float(correct[mask].float().mean()) if n else None


def evaluate(model: nn.Module, data: LabeledImages, info: ModelInfo, device: str | torch.device = "cpu",
             batch: int = 256, old: Collection[str] = ()) -> dict:
    """Loss and accuracy on ``data`` (labels must index ``info.classes``).

    Args:
        old: names of the classes the starting model knew; ``old_acc`` and ``new_acc`` are the
            accuracies on samples of those classes and of the others (None when there are none).
    """
    if data.classes != info.classes:
        data = data.relabel(info.classes)
    logits = predict_logits(model, data, info, device, batch)
    if len(data) == 0:
        return {"samples": 0, "loss": None, "acc": None, "old_acc": None, "new_acc": None, "per_class": {}}
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
    }
