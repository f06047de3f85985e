"""Continual learning: head expansion, distillation from the previous model (LwF), and replay.

New data may bring new classes. The head grows by one row per new class and keeps the old rows as
they were, so the model starts from exactly the old model's predictions on the old classes. Two
things then keep it from forgetting them while it learns the new ones:

- **replay**: a bounded, class-balanced sample of earlier training data, kept beside each model
  (``replay.safetensors``), is mixed into the new data;
- **distillation** (Li and Hoiem, *Learning without Forgetting*): the old model's softened outputs
  on the old classes are a second target, ``T^2 KL(softmax(old/T) || softmax(new[:, :K]/T))``
  over the ``K`` old logits of every batch.
"""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.models.directory import CheckpointError, load_tensors, save_tensors
from edgerev.models.handle import ModelHandle, SpecError, describe, last_linear
from edgerev.models.head import ScaledLinear
from edgerev.train.labeled import LabeledImages

REPLAY = "replay.safetensors"


def head_name(model: nn.Module | ModelHandle) -> str:
    """The qualified name of the layer whose rows are ``model``'s classes: its handle's ``head`` (edgerev's own
    ``head``; an ONNX import's last Gemm/MatMul/Linear in the order the graph runs), else its last linear layer:
    in graph order for a ``torch.fx.GraphModule``, in module order for any other model (``classifier.1`` of a
    MobileNetV2, ``fc`` of a ResNet).

    Raises:
        CheckpointError: the model has no linear layer.
    """
    module = model.module if isinstance(model, ModelHandle) else model
    try:
        name = describe(model).head
    except SpecError:  # its input cannot be read from its layers: its classifier still can
        name = last_linear(module)
    if name is None:
        raise CheckpointError(f"{type(module).__name__} has no linear layer (Gemm, MatMul or Linear) whose rows are "
                              "its classes: its head cannot grow for new classes")
    return name


def grow_head(model: nn.Module | ModelHandle, old: tuple[str, ...], new: tuple[str, ...]) -> None:
    """Replace the model's head (:func:`head_name`) by one with a row per class of ``new`` (which starts with
    ``old``), in place (:meth:`ModelHandle.replace_head`: edgerev's models keep their ``num_classes`` in step).

    Old rows keep their weights and biases; new rows get the layer's default initialization, so the grown
    model gives exactly the old logits on the old classes.

    Raises:
        CheckpointError: ``new`` does not start with ``old``, the model has no linear layer, or its head's
            rows are not the old classes.
    """
    if new[: len(old)] != old:
        raise CheckpointError(f"new classes {list(new)} must start with the old ones {list(old)}")
    name = head_name(model)
    module = model.module if isinstance(model, ModelHandle) else model
    head: nn.Linear = module.get_submodule(name)
    if head.out_features != len(old):
        raise CheckpointError(f"the head {name!r} of {type(module).__name__} has {head.out_features} rows, not "
                              f"one per old class ({len(old)}): its last linear layer is not the classifier")
    if len(new) == len(old):
        return
    if isinstance(head, ScaledLinear):  # keeps its kind: no bias, the same logit scale
        grown: nn.Linear = head.resized(len(new))
    else:
        grown = nn.Linear(head.in_features, len(new), bias=head.bias is not None).to(head.weight.device,
                                                                                      head.weight.dtype)
    with torch.no_grad():
        grown.weight[: len(old)] = head.weight
        if head.bias is not None:
            grown.bias[: len(old)] = head.bias
    grown.train(head.training)
    describe(model).replace_head(grown)


def distillation_loss(logits: Tensor, teacher: Tensor, temperature: float) -> Tensor:
    """LwF's loss: KL from the teacher's softened outputs to the student's on the teacher's classes,
    scaled by ``T^2`` so its gradients keep their size across temperatures; mean over the batch."""
    k = teacher.shape[1]
    t = temperature
    log_p = F.log_softmax(logits[:, :k] / t, dim=1)
    q = F.softmax(teacher / t, dim=1)
    return F.kl_div(log_p, q, reduction="batchmean") * (t * t)


class ContinualLoss:
    """Cross-entropy on the labels plus, when a teacher's logits come with the batch, distillation.

    Called by :func:`edgerev.train.cap.train_step` as ``loss(logits, labels[, teacher_logits])``.
    """

    def __init__(self, distill: float = 0.0, temperature: float = 2.0, label_smoothing: float = 0.0) -> None:
        self.distill, self.temperature, self.label_smoothing = distill, temperature, label_smoothing

    @property
    def memory_key(self) -> tuple:
        """What a step's memory depends on in this loss: the planner remembers a step's account by it
        (:class:`edgerev.memory.plan.autoplan.DescribedLoss`)."""
        return ("continual", self.distill, self.temperature, self.label_smoothing)

    def __call__(self, logits: Tensor, labels: Tensor, teacher: Tensor | None = None) -> Tensor:
        loss = F.cross_entropy(logits, labels, label_smoothing=self.label_smoothing)
        if teacher is not None and self.distill > 0:
            loss = loss + self.distill * distillation_loss(logits, teacher, self.temperature)
        return loss


def save_replay(folder: str | Path, data: LabeledImages) -> str:
    """Write the replay sample beside a model (labels index the model's classes); returns its hash."""
    return save_tensors(Path(folder) / REPLAY, {"images": data.images, "labels": data.labels})


def load_replay(folder: str | Path, classes: tuple[str, ...], sha256: str | None) -> LabeledImages | None:
    """The replay sample kept beside the model in ``folder``, or None if it has none."""
    path = Path(folder) / REPLAY
    if not path.exists():
        return None
    t = load_tensors(path, sha256)
    if set(t) != {"images", "labels"}:
        raise CheckpointError(f"{path} is not a replay sample (keys {sorted(t)})")
    return LabeledImages(t["images"], t["labels"], classes)
