"""Continual learning: head expansion, distillation from the previous model (LwF), and replay.

New data may bring new classes. The head grows by one row per new class and keeps the old rows as
they were, so the model starts from exactly the old model's predictions on the old classes. Two
things then keep it from forgetting them while it learns the new ones:

- **replay**: a bounded, class-balanced sample of earlier training data, kept beside each model
  (``replay.safetensors``), is mixed into the new data;
- **distillation** (Li and Hoiem, *Learning without Forgetting*): the old model's softened outputs
  on the old classes are a second target, ``T^2 KL(softmax(old/T) || softmax(new[:, :K]/T))``
  over the ``K`` old logits of every batch.

When the starting model is a pretrained one, the new rows do not start from their random initialization:
:func:`fit_new_rows` fits them to the pretrained features first (a linear probe with the old rows held,
then every weight trains: LP-FT, Kumar et al., *Fine-Tuning can Distort Pretrained Features*, ICLR 2022).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev.errors import one_line
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


@torch.no_grad()
def head_inputs(model: nn.Module | ModelHandle, batches: Iterable[Tensor]) -> Tensor:
    """What the head (:func:`head_name`) takes for each image of ``batches`` (normalized, on the model's device),
    in eval mode (float32, on the CPU); the model's mode is restored after."""
    module = model.module if isinstance(model, ModelHandle) else model
    head = module.get_submodule(head_name(model))
    got: list[Tensor] = []
    hook = head.register_forward_hook(lambda _m, args, _out: got.append(args[0].detach().float().cpu()))
    was = module.training
    module.eval()
    try:
        for x in batches:
            module(x)
    finally:
        hook.remove()
        module.train(was)
    return torch.cat(got) if got else torch.zeros(0, 0)


def fit_new_rows(model: nn.Module | ModelHandle, features: Tensor, labels: Tensor, first: int,
                 weight_decay: float = 5e-4, iterations: int = 100) -> dict:
    """Fit the head's rows from ``first`` on (the classes it grew by) to ``features`` (:func:`head_inputs`) and
    ``labels`` (row indices), the rows before ``first`` and the rest of the model held: the cross-entropy over
    every row, plus ``weight_decay / 2`` times the new rows' squared norm (SGD's decay), minimized by L-BFGS.
    The head is called as it is (a bias or none, :class:`~edgerev.models.head.ScaledLinear`'s scale).

    Random rows beside trained ones start with the old classes' images scoring high on them and the new
    classes' images scattered: in ``benchmarks/byo_model.py``'s few-shot digits the grown MobileNetV2 learned
    the new digits to 0.65 from such rows and to 0.86 from fitted ones (random weights: 0.82; means of three
    seeds).

    Returns:
        ``{"rows", "images", "accuracy"}``: the rows fitted, the images they were fitted on and the head's
        accuracy on them after; ``{"rows": 0, ...}`` with nothing changed when there is no new row or no image,
        and with ``"kept": "..."`` when the features or the fit are not finite (the rows keep their
        initialization).
    """
    module = model.module if isinstance(model, ModelHandle) else model
    head = module.get_submodule(head_name(model))
    rows = head.weight.shape[0] - first
    out = {"rows": max(rows, 0), "images": len(labels), "accuracy": None}
    if rows <= 0 or len(labels) == 0:
        return {**out, "rows": 0}
    device = head.weight.device
    held = {n: p.detach() for n, p in head.named_parameters() if p.shape[:1] == (rows + first,)}
    new = {n: p[first:].clone().requires_grad_(True) for n, p in held.items()}
    features, labels = features.to(device, head.weight.dtype), labels.to(device)

    def logits() -> Tensor:
        return torch.func.functional_call(head, {n: torch.cat([held[n][:first], new[n]]) for n in held}, (features,))

    with torch.no_grad():
        shape = tuple(logits().shape)
    if shape != (len(labels), rows + first):
        return {**out, "rows": 0, "kept": f"the head gives logits of shape {list(shape)}, not one row per image"}

    if not bool(torch.isfinite(features).all()):
        return {**out, "kept": "the features are not finite"}
    opt = torch.optim.LBFGS(list(new.values()), max_iter=iterations, line_search_fn="strong_wolfe")

    def closure() -> Tensor:
        opt.zero_grad()
        loss = F.cross_entropy(logits(), labels) + weight_decay / 2 * sum((p ** 2).sum() for p in new.values())
        loss.backward()
        return loss

    try:
        opt.step(closure)
    except RuntimeError as e:  # L-BFGS's step overflowed a float
        return {**out, "kept": f"the fit failed: {one_line(e)}"}
    if not all(bool(torch.isfinite(p).all()) for p in new.values()):
        return {**out, "kept": "the fit did not end finite"}
    with torch.no_grad():
        for n, p in head.named_parameters():
            if n in new:
                p[first:] = new[n]
        out["accuracy"] = round(float((logits().argmax(1) == labels).float().mean()), 4)
    return out


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
