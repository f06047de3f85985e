"""What every model shares: a stored stem, an engine-run body, a linear head, and input checks."""

from __future__ import annotations

from collections.abc import Sequence

from torch import Tensor, nn

from edgerev.engine import InvertibleSequence, Mode
from edgerev.errors import ShapeError
from edgerev.finite import check_finite
from edgerev.models.handle import describes


def stem(channels: int, in_channels: int = 3) -> nn.Conv2d:
    """The non-invertible 3x3 stem; its input, the image, is kept anyway."""
    return nn.Conv2d(in_channels, channels, 3, padding=1, bias=False)


class EngineModel(nn.Module):
    """An image classifier whose body is an :class:`InvertibleSequence` (stem included).

    Args:
        stages: stem first, then the body's stages.
        features: channels of the last stage.
        num_classes: outputs of the linear head.
        divisor: input height and width must be multiples of this (two per pooling).
        in_channels: channels of the input image.
        pool: how the last activation becomes per-sample features: ``"mean"`` or ``"max"`` over
            space and the batch-pooled sub-images (see :func:`edgerev.layers.global_pool`).
        head: the head module (default: ``nn.Linear(features, num_classes)``).
    """

    def __init__(self, stages: Sequence[nn.Module], features: int, num_classes: int, divisor: int,
                 in_channels: int = 3, pool: str = "mean", head: nn.Module | None = None) -> None:
        super().__init__()
        self.body = InvertibleSequence(stages, pool=pool)
        self.head = head if head is not None else nn.Linear(features, num_classes)
        self.divisor, self.in_channels, self.num_classes = divisor, in_channels, num_classes

    @property
    def stages(self) -> nn.ModuleList:
        return self.body.stages

    def set_modes(self, modes: Sequence[Mode | str] | Mode | str) -> None:
        self.body.set_modes(modes)

    def check_input(self, x: Tensor) -> None:
        """One clear error for an input the model cannot take."""
        name = vars(self).get("arch", type(self).__name__)  # the registry's name, where the registry built it
        if x.dim() != 4:
            raise ShapeError(f"{name} expects images as a [batch, channels, height, width] tensor, "
                             f"got {tuple(x.shape)}")
        if x.shape[1] != self.in_channels:
            raise ShapeError(f"{name} expects {self.in_channels}-channel images, got {x.shape[1]} channels")
        h, w = x.shape[-2:]
        if h % self.divisor or w % self.divisor or h == 0 or w == 0:
            raise ShapeError(f"{name} needs height and width divisible by {self.divisor}, got {h}x{w}")
        check_finite(x, "the input batch")

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.head(self.body(x, samples=x.shape[0]))


class SequentialModel(nn.Module):
    """A user's ``nn.Sequential``-like classifier, wrapped so the planner and the cap can work with it.

    Each child becomes a stage (stored by default; the planner can checkpoint segments of them). The
    last child must produce the logits.

    Args:
        layers: the model's children, in order (an ``nn.Sequential`` or a list of modules).
        num_classes: number of logits the model outputs.
        in_channels: channels of the input image.
        divisor: input height and width must be multiples of this.
    """

    def __init__(self, layers: Sequence[nn.Module] | nn.Sequential, num_classes: int, in_channels: int = 3,
                 divisor: int = 1) -> None:
        super().__init__()
        self.body = InvertibleSequence(list(layers), pool=None)
        self.num_classes, self.in_channels, self.divisor = num_classes, in_channels, divisor
        self.arch = "sequential"

    check_input = EngineModel.check_input

    def forward(self, x: Tensor) -> Tensor:
        self.check_input(x)
        return self.body(x)


def _engine_fields(model: EngineModel) -> dict:
    return {"in_channels": model.in_channels, "head": "head" if isinstance(model.head, nn.Linear) else None,
            "fixed_classes": model.num_classes}


def _sequential_fields(model: SequentialModel) -> dict:
    from edgerev.models.handle import last_linear

    head = last_linear(model)
    fits = head is not None and model.get_submodule(head).out_features == model.num_classes
    return {"in_channels": model.in_channels, "head": head if fits else None, "fixed_classes": model.num_classes}


def _classes_follow(model: EngineModel | SequentialModel, rows: int) -> None:
    model.num_classes = rows


describes(EngineModel, _engine_fields, check_input=EngineModel.check_input, head_grown=_classes_follow)
describes(SequentialModel, _sequential_fields, check_input=SequentialModel.check_input, head_grown=_classes_follow)
