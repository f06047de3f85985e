"""What the rest of edgerev needs to know of a model, wherever it came from: :func:`model_spec`.

The planner, the step's accounting, the trainer and export feed a model images and count its logits;
they ask this module, never the model's own attributes, so a model from outside (an ONNX import, a
factory of the user's, any ``nn.Module`` classifier) fits as well as the registry's.

A model that says it (edgerev's own classes, an ONNX import) is taken at its word: its ``in_channels``,
``num_classes`` and ``image_size`` attributes, and the ``mean`` and ``std`` it carries. Anything else is
read from its layers: the input channels of its first convolution (or, for a model that flattens images
into a linear layer, its input features over its ``image_size`` squared) and the rows of its last linear layer,
the classifier whose rows are the classes (the head that grows when new classes come).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from edgerev.errors import EdgerevError


class SpecError(EdgerevError):
    """A model does not show what edgerev needs of it (its input channels or its classes)."""


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


_LINEAR = (nn.Linear,)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)


def _int_attr(model: nn.Module, name: str) -> int | None:
    value = getattr(model, name, None)
    return int(value) if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _floats(value) -> tuple[float, ...] | None:
    if value is None:
        return None
    try:
        return tuple(float(v) for v in value)
    except (TypeError, ValueError):
        return None


def head_name(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s classifier: the one it names (an ONNX import's ``head_name``: its last
    Gemm/MatMul in the order the graph runs), else its last linear layer in module order (None: none)."""
    named = getattr(model, "head_name", None)
    if isinstance(named, str):
        return named
    last = None
    for name, m in model.named_modules():
        if isinstance(m, _LINEAR):
            last = name
    return last


def model_spec(model: nn.Module) -> ModelSpec:
    """The :class:`ModelSpec` of ``model``: its attributes where it has them, else read from its layers.

    Raises:
        SpecError: the model has no convolution or linear layer to read its input channels from, or no
            linear layer and no ``num_classes`` to count its classes (one line naming its type).
    """
    head = head_name(model)
    in_channels = _int_attr(model, "in_channels")
    if in_channels is None:
        first = next((m for m in model.modules() if isinstance(m, _CONV + _LINEAR)), None)
        if first is None:
            raise SpecError(f"{type(model).__name__} has no convolution or linear layer to read its input channels "
                            "from; give the model an in_channels attribute")
        if isinstance(first, _CONV):
            in_channels = first.in_channels
        else:  # a model that flattens the image first: its features are channels x height x width
            size = _int_attr(model, "image_size")
            if size is None or first.in_features % (size * size):
                raise SpecError(f"{type(model).__name__} flattens its images into a linear layer of "
                                f"{first.in_features} features; give the model in_channels (or image_size) attributes")
            in_channels = first.in_features // (size * size)
    num_classes = _int_attr(model, "num_classes")
    if num_classes is None:
        if head is None:
            raise SpecError(f"{type(model).__name__} has no linear layer to count its classes from; give the model "
                            "a num_classes attribute")
        num_classes = model.get_submodule(head).out_features
    io = getattr(model, "io", None)  # an ONNX import's record of the original's input (normalization among it)
    mean = _floats(getattr(model, "mean", None)) or _floats(getattr(io, "mean", None)) or None
    std = _floats(getattr(model, "std", None)) or _floats(getattr(io, "std", None)) or None
    return ModelSpec(in_channels, num_classes, _int_attr(model, "image_size"), head, mean, std)


def check_size(model: nn.Module, size: int) -> None:
    """One clear error for an image size ``model`` cannot take: its own ``check_input`` where it has one (edgerev's
    models), its ``image_size`` where it was built for one, else a forward of one zero image (no gradient, in
    eval mode so batch norm's running statistics stay as they were).

    Raises:
        edgerev.errors.ShapeError, SpecError: the size does not fit (one line).
    """
    spec = model_spec(model)
    tensor = next(iter(model.parameters()), None)
    x = torch.zeros(1, spec.in_channels, size, size, device=tensor.device if tensor is not None else "cpu")
    if callable(getattr(model, "check_input", None)):
        model.check_input(x)
        return
    if spec.image_size is not None and spec.image_size != size:
        raise SpecError(f"the model takes {spec.image_size}x{spec.image_size} images, not {size}x{size}")
    was = model.training
    try:
        with torch.no_grad():
            model.eval()(x)
    except (RuntimeError, ValueError, IndexError) as e:
        raise SpecError(f"the model cannot take {size}x{size} images: {str(e).strip().splitlines()[0]}") from None
    finally:
        model.train(was)
