"""Peak memory of one training step, measured (CPU tracker, CUDA statistics) or predicted (fake tensors)."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from edgerev._torchapi import fake_copy, fake_mode, storage_bytes
from edgerev.engine import Execution, Mode, engine_body, supported_modes
from edgerev.errors import ModeError
from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.microbatch import StepLoss, accumulate
from edgerev.memory.measure.tracker import CudaPeak, MemoryTracker
from edgerev.models import create_model
from edgerev.models.spec import model_spec


@dataclass(frozen=True)
class StepMemory:
    """Peak of one training step (forward, loss, backward; optimizer state excluded).

    ``peak_bytes`` includes what lives throughout the step: weights, buffers, the input batch and
    the labels (``baseline_bytes``), plus the largest total of tensors the step itself had alive
    (activations, their gradients, weight gradients, temporaries).
    """

    peak_bytes: int
    baseline_bytes: int
    peak_op: str
    reserved_bytes: int | None = None  # CUDA: the allocator's peak reservation; None where it has none

    def as_dict(self) -> dict:
        return asdict(self)


def training_step(model: nn.Module, x: torch.Tensor, target: torch.Tensor) -> StepLoss:
    """Forward, cross-entropy, backward, as the trainer's step runs them (:func:`accumulate`, one micro-batch):
    the loss and the value checks, unread."""
    return accumulate(model, x, (target,), [slice(0, x.shape[0])], F.cross_entropy)


def step_peak(model: nn.Module, batch: int, size: int, device: str = "cpu", in_channels: int | None = None,
              tracker: bool | None = None) -> StepMemory:
    """Peak bytes of one training step of ``model`` on a random batch.

    On CPU (and under ``FakeTensorMode``) the :class:`MemoryTracker` counts live tensors; on CUDA the
    allocator's own peak is read, and its peak reservation. Gradients are cleared first so the step
    allocates them.

    Args:
        tracker: count with the tracker (True) or read the CUDA allocator (False); default: the
            allocator on CUDA. The tracker on CUDA tensors is the CPU figure of the same step, at a
            speed the CPU cannot reach.
    """
    model.train()
    model.zero_grad(set_to_none=True)
    spec = model_spec(model)
    num_classes = spec.num_classes
    x = torch.randn(batch, in_channels or spec.in_channels, size, size, device=device)
    target = torch.randint(0, num_classes, (batch,), device=device)
    if tracker is None:
        tracker = torch.device(device).type != "cuda"
    if not tracker:
        with CudaPeak(device) as cp:
            training_step(model, x, target)
        return StepMemory(cp.peak, cp.baseline, "", cp.reserved)
    baseline = storage_bytes([*model.parameters(), *model.buffers(), x, target])
    with MemoryTracker(baseline=baseline) as tr:
        training_step(model, x, target)
    return StepMemory(tr.peak, baseline, tr.peak_op)


def fake_step_peak(model: nn.Module, modes: tuple[str, ...] | None, batch: int, size: int,
                   segments: tuple | None = None, floor_restore: bool | None = None) -> int:
    """Exact peak bytes of one bare training step (cross-entropy, no optimizer state, a batch of
    ``batch``) with ``modes`` (or checkpoint ``segments``), on fake tensors: nothing is allocated. ``floor_restore``:
    the way floor stages run (``Execution.floor_restore``; None: the way of the device the model is on).

    A step under a recipe (accumulation, momentum, a teacher) is :func:`edgerev.memory.measure.account.account_step`;
    this is that step with nothing but the micro-batch.
    """
    return account_step(model, StepShape(size), batch,
                        lambda m: apply_plan(m, modes, segments, floor_restore=floor_restore)).total


def apply_plan(model: nn.Module, modes: tuple[str, ...] | None, segments: tuple | None,
               slices: tuple[int, ...] | None = None, floor_restore: bool | None = None) -> None:
    """Set stage ``modes`` (None: leave them), checkpoint ``segments`` (None: the engine), the stages' batch-slice
    budgets (None: the default) and the way floor stages run (None: the device's, ``Execution.floor_restore``) on
    ``model``."""
    if modes is not None:
        model.body.set_modes(list(modes))
    model.body.set_execution(Execution(segments=tuple(segments) if segments is not None else None,
                                       slices=tuple(slices) if slices is not None else None,
                                       floor_restore=floor_restore))


def set_modes(model: nn.Module, modes: str, name: str | None = None) -> None:
    """Set engine modes from a command line's text: one mode for every stage that supports it (at least
    one must), or a comma-separated mode per stage (each must be one its stage supports).

    Raises:
        ModeError: an unknown mode, a stage that cannot run its mode (named, with the modes it supports),
            or a single mode no stage supports.
    """
    body, name = engine_body(model), name or type(model).__name__
    if body is None:
        raise ModeError(f"{name} is not one of edgerev's reversible models: "
                        "it trains through plain autograd; leave the mode out")
    if "," in modes:
        body.set_modes([m.strip() for m in modes.split(",")])
        return
    body.set_modes(modes)
    if Mode(modes) not in body.modes:
        allowed = sorted({m.value for s in body.stages for m in supported_modes(s)})
        raise ModeError(f"no stage of {name} can run in {modes} mode; "
                        f"its stages support {', '.join(allowed)}")


@contextlib.contextmanager
def _maybe_fake(fake: bool):
    if not fake:
        yield None
        return
    with fake_mode() as mode:
        yield mode


def measure(arch: str, batch: int = 32, size: int = 32, device: str = "cpu", fake: bool = False,
            seed: int = 0, modes: str | None = None, trust_factories: Sequence[str] = (), **overrides) -> dict:
    """Peak at ``batch`` and ``2 * batch``, and the bytes per input pixel (slope between them).

    The slope cancels everything that does not grow with the batch (weights, their gradients,
    batch-sliced temporaries), as in the RevNeXt paper. ``fake=True`` predicts the same figures
    with fake tensors: nothing is allocated, so any size can be asked for. ``modes`` sets one
    engine mode for every stage that supports it. ``arch`` is any model source
    (:mod:`edgerev.models.resolve`); a model from outside the registry runs through plain autograd.
    ``trust_factories``: the factories a model directory may name (:mod:`edgerev.models.trust`).
    """
    from edgerev.memory.measure.analytic import model_bytes_per_pixel
    from edgerev.models.names import SourceKind, source_kind
    from edgerev.models.resolve import resolve_model

    if fake and device != "cpu":
        raise ValueError("--fake predicts on the CPU tracker; leave --device at cpu")
    torch.manual_seed(seed)
    registry = source_kind(arch) is SourceKind.REGISTRY
    # a registry model is built on fake tensors directly; a source from outside loads real weights, then is copied
    outside = None if registry else resolve_model(arch, args=overrides, trust_factories=trust_factories).module
    with _maybe_fake(fake) as mode:
        model = create_model(arch, **overrides) if registry else outside if not fake else fake_copy(outside, mode)
        if not fake:
            model = model.to(device)
        if modes is not None:
            set_modes(model, modes, arch)
        params = sum(p.numel() for p in model.parameters())
        first = step_peak(model, batch, size, device)
        second = step_peak(model, 2 * batch, size, device)
    pixels = batch * size * size
    return {
        "arch": arch,
        "params": params,
        "batch": batch,
        "size": size,
        "device": device,
        "fake": fake,
        "modes": sorted({str(m) for m in engine_body(model).modes}) if engine_body(model) is not None else ["plain"],
        "peak_bytes": first.peak_bytes,
        "peak_bytes_2x": second.peak_bytes,
        "bytes_per_pixel": (second.peak_bytes - first.peak_bytes) / pixels,
        "model_bytes_per_pixel": _analytic(model_bytes_per_pixel, model),
        "peak_op": first.peak_op,
    }


def _analytic(fn, model: nn.Module) -> float | None:
    """The analytic bytes per pixel of an edgerev model; None for one without an invertible sequence."""
    try:
        return fn(model)
    except ValueError:
        return None
