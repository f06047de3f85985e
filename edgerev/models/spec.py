"""What the rest of edgerev needs to know of a model, as a plain record: :func:`model_spec`.

The record is read off the model's handle (:class:`edgerev.models.handle.ModelHandle`, which the resolver makes);
a module without one is described by its class or its layers (:func:`edgerev.models.handle.describe`): the input
channels of its first convolution and the rows of its last linear layer, the classifier whose rows are the classes
(the head that grows when new classes come).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from edgerev.models.handle import ModelHandle, SpecError, describe

__all__ = ["ModelSpec", "SpecError", "check_size", "head_name", "model_spec"]


@dataclass(frozen=True)
class ModelSpec:
    """``in_channels``: the image channels the model takes; ``num_classes``: the logits it returns;
    ``image_size``: the one input size it was built for (None: any size its layers take); ``head``: the
    qualified name of its classifier (the last linear layer; None when it has none); ``mean`` and
    ``std``: the normalization it expects on pixels scaled to 0..1, when it carries one."""

    in_channels: int
    num_classes: int
    image_size: int | None = None
    head: str | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None


def head_name(model: nn.Module | ModelHandle) -> str | None:
    """The qualified name of ``model``'s classifier (None: it has none)."""
    return describe(model).head


def model_spec(model: nn.Module | ModelHandle) -> ModelSpec:
    """The :class:`ModelSpec` of ``model`` (a handle, or a module described by its class or its layers).

    Raises:
        SpecError: the model has no convolution or linear layer to read its input channels from, or no
            linear layer to count its classes (one line naming its type).
    """
    h = describe(model)
    return ModelSpec(h.in_channels, h.num_classes, h.image_size, h.head, h.mean, h.std)


def check_size(model: nn.Module | ModelHandle, size: int) -> None:
    """One clear error for an image size ``model`` cannot take (:meth:`ModelHandle.check_size`).

    Raises:
        edgerev.errors.ShapeError, SpecError: the size does not fit (one line).
    """
    describe(model).check_size(size)
