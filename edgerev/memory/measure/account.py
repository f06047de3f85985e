"""One accounting of a training step: what a step under a recipe holds at its peak.

This is the only place that says it. The trainer's plan and its CPU cap, ``edgerev plan``, the
daemon's start check and every "smallest budget" in an error come from :func:`account_step`:

- held through the step (the tracker's baseline, :meth:`StepAccount.baseline`): the weights and
  buffers; the optimizer's state (SGD momentum: one buffer per trainable weight); the distillation
  teacher's weights and buffers; the whole batch as one float tensor (replay samples are part of
  the batch: a step mixes them in, it does not add them), its labels, and the teacher's logits for
  it; with FixMatch (``StepShape.unlabeled``), the batch is the labelled samples and the unlabelled
  images' strong views together, with a weight per sample; where a CUDA step is planned on its device, the
  workspaces the math libraries keep for the process (:mod:`edgerev.memory.measure.workspaces`);
- allocated by the step (:attr:`StepAccount.step_bytes`): the weight gradients, and the
  activations, gradients and temporaries of the planned micro-batch, measured exactly by running
  the trainer's own micro-batch loop (:func:`edgerev.memory.measure.microbatch.accumulate`) on tensors
  without data (meta tensors, :func:`edgerev._torchapi.shadowed`), and, with FixMatch, the no-grad forward
  of a micro-batch of weak views that comes before it (its input is counted as the batch's: it is made and
  dropped before the batch is); and, where a CUDA step is planned on its device, what each convolution takes
  inside itself while it runs (cuDNN's workspace), measured there.

Not counted: what the CPU tracker cannot see and the CPU cap therefore does not guard (Python
objects, the allocator's slack), and the teacher's and evaluation's no-grad forwards, which run
between steps (on CUDA they share the cap; on CPU they are outside the tracked step).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from edgerev._torchapi import left_as_it_was, restore_buffers, save_buffers, shadowed
from edgerev.engine import engine_body, floor_restores
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.memory.measure.tracker import MemoryTracker
from edgerev.memory.measure.workspaces import active as library_memory
from edgerev.models.spec import model_spec

LABEL_BYTES = 8  # int64 class indices


@dataclass(frozen=True)
class StepShape:
    """What a recipe says about a step, besides the model.

    Attributes:
        size: input height and width.
        batch: samples per optimizer step (None: the micro-batch itself, a step without accumulation).
        momentum: the optimizer keeps one buffer per trainable weight (SGD with momentum).
        state_bytes: bytes per element of that buffer: 4 (float32, the weights' own) or 2 (bfloat16,
            :func:`edgerev.train.optim.keep_state_in`).
        teacher_bytes: the distillation teacher's weights and buffers (0: no teacher).
        teacher_classes: the teacher's logits per sample (0: no teacher).
        input_bytes: bytes per element of the input batch (float32).
        unlabeled: of ``batch``, the unlabelled images' strong views (FixMatch, :mod:`edgerev.train.semi`):
            the step also holds a weight per sample, and runs their weak views forward without gradient
            first (0: a labelled-only step).
    """

    size: int
    batch: int | None = None
    momentum: bool = False
    state_bytes: int = 4
    teacher_bytes: int = 0
    teacher_classes: int = 0
    input_bytes: int = 4
    unlabeled: int = 0

    def __post_init__(self) -> None:
        if self.size < 1 or (self.batch is not None and self.batch < 1):
            raise ValueError(f"a step needs a positive size and batch, got size {self.size}, batch {self.batch}")
        if self.state_bytes not in (2, 4):
            raise ValueError(f"the optimizer's state takes 2 or 4 bytes per element, got {self.state_bytes}")
        if self.unlabeled and (self.batch is None or not 0 < self.unlabeled < self.batch):
            raise ValueError(f"unlabelled views ({self.unlabeled}) are part of a step's batch ({self.batch}) beside "
                             "at least one labelled sample")


@dataclass(frozen=True)
class StepAccount:
    """The bytes of one training step under a recipe and a plan (see the module docstring)."""

    weights: int
    buffers: int
    optimizer: int
    teacher: int
    batch_input: int
    labels: int
    teacher_logits: int
    sample_weights: int  # FixMatch's weight per sample of the batch (0 without unlabelled views)
    gradients: int  # part of step_bytes: the weight gradients at the end of the backward
    step_bytes: int  # the largest total the step itself had alive (gradients, activations, temporaries)
    batch: int
    micro_batch: int
    libraries: int = 0  # the math libraries' workspaces kept for the process (CUDA, planned on the device)

    @property
    def baseline(self) -> int:
        """Bytes alive before the step and through it: the CPU cap's baseline."""
        return (self.weights + self.buffers + self.optimizer + self.teacher + self.batch_input + self.labels
                + self.teacher_logits + self.sample_weights + self.libraries)

    @property
    def total(self) -> int:
        """The peak of the step: the smallest budget under which it runs."""
        return self.baseline + self.step_bytes

    def as_dict(self) -> dict:
        return {**asdict(self), "baseline": self.baseline, "total": self.total}


def _nbytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def held(model: nn.Module, shape: StepShape, micro_batch: int) -> dict[str, int]:
    """The bytes held through a step (the baseline's terms), from sizes alone: nothing runs."""
    batch = shape.batch or micro_batch
    trainable = [p for p in model.parameters() if p.requires_grad]
    pixels = model_spec(model).in_channels * shape.size * shape.size
    return {
        "weights": _nbytes(model.parameters()),
        "buffers": _nbytes(model.buffers()),
        "optimizer": sum(p.numel() for p in trainable) * shape.state_bytes if shape.momentum else 0,
        "teacher": shape.teacher_bytes,
        "batch_input": batch * pixels * shape.input_bytes,
        "labels": batch * LABEL_BYTES,
        "teacher_logits": batch * shape.teacher_classes * 4 if shape.teacher_bytes else 0,
        "sample_weights": batch * 4 if shape.unlabeled else 0,
    }


def beyond_model(model: nn.Module, shape: StepShape, micro_batch: int) -> int:
    """What a step holds besides what a bare micro-batch step holds (the solvers' profiles count that)."""
    h = held(model, shape, micro_batch)
    bare = micro_batch * (model_spec(model).in_channels * shape.size * shape.size * shape.input_bytes + LABEL_BYTES)
    return max(0, h["optimizer"] + h["teacher"] + h["batch_input"] + h["labels"] + h["teacher_logits"]
                  + h["sample_weights"] - bare)


def account_step(model: nn.Module, shape: StepShape, micro_batch: int, apply: Callable[[nn.Module], None],
                 loss_fn: Callable[..., Tensor] | None = None, real: bool = False,
                 stage_peaks: dict[int, int] | None = None) -> StepAccount:
    """The bytes of one training step of ``model`` under ``shape``, in micro-batches of ``micro_batch``.

    Args:
        apply: sets the plan (modes or checkpoint segments) on the model that runs.
        loss_fn: the trainer's loss, called as ``loss_fn(logits, labels[, teacher_logits])``
            (default: cross-entropy).
        real: run ``model`` itself on real tensors (CPU) and measure, instead of predicting on a copy without
            data: the check of a prediction (``edgerev plan --verify``); its batch norms' statistics, gradients
            and modes are put back.
        stage_peaks: filled with the step's peak while each stage of the engine body ran (its forward and its
            backward; baseline included), by stage index: what the stage's own batch slices decide.

    The step runs through the trainer's own micro-batch loop, on tensors without data unless ``real``: nothing
    is allocated. Its first two micro-batches are run: the later ones repeat the second (gradients
    already allocated, the same or fewer samples). With unlabelled views, a micro-batch of weak views runs
    forward without gradient first (its batch norms' buffers put back, as the trainer does).
    """
    batch = shape.batch or micro_batch
    micro_batch = min(micro_batch, batch)
    terms = held(model, shape, micro_batch)
    lib = library_memory()
    libraries = lib.persistent if lib is not None else 0
    baseline = sum(terms.values()) + libraries
    loss_fn = loss_fn or F.cross_entropy
    spec = model_spec(model)
    # the way floor stages run where the model is, unless the plan says (a copy without data is on the meta device)
    restore = floor_restores(next(iter(model.parameters()), torch.empty(0)).device)

    def run_step(run: nn.Module) -> MemoryTracker:
        apply(run)
        run.train()
        run.zero_grad(set_to_none=True)
        x = torch.randn(batch, spec.in_channels, shape.size, shape.size)
        targets: tuple[Tensor, ...] = (torch.randint(0, spec.num_classes, (batch,)),)
        if shape.unlabeled:
            targets += (torch.rand(batch),)
        if shape.teacher_bytes:
            targets += (torch.randn(batch, max(1, shape.teacher_classes)),)
        parts = split_batch(batch, math.ceil(batch / micro_batch))[:2]
        tracker = MemoryTracker(baseline=baseline)
        body = engine_body(run)
        before = body.execution if body is not None else None
        if body is not None:
            body.set_execution(replace(
                before, watch=tracker.enter if stage_peaks is not None else before.watch,
                floor_restore=restore if before.floor_restore is None else before.floor_restore))
        try:
            with tracker:
                if shape.unlabeled:
                    weak_forward(run, x[:min(micro_batch, shape.unlabeled)])
                accumulate(run, x, targets, parts, loss_fn)
        finally:
            if body is not None:
                body.set_execution(before)  # the model itself, when real, runs as it did
        return tracker

    if real:  # the model itself: its statistics, gradients and modes are left as they were
        with left_as_it_was(model):
            tracker = run_step(model)
    else:
        tracker = shadowed(model, run_step)
    if stage_peaks is not None:
        stage_peaks.update(tracker.section_peaks)
    trainable = [p for p in model.parameters() if p.requires_grad]
    return StepAccount(**terms, gradients=_nbytes(trainable), step_bytes=tracker.peak - baseline, batch=batch,
                       micro_batch=micro_batch, libraries=libraries)


def weak_forward(model: nn.Module, x: Tensor) -> None:
    """The weak views' no-grad forward of one micro-batch, as :func:`edgerev.train.semi.weak_probs` runs it."""
    saved = save_buffers(model)
    with torch.no_grad():
        probs = F.softmax(model(x).float(), dim=1)
        del probs
    restore_buffers(model, saved)
    del saved
