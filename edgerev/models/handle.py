"""One model handle: the module and everything edgerev knows of it, made once where a model is resolved.

timm pairs every model with a config that travels with it; :class:`ModelHandle` is edgerev's. The resolver
(:func:`edgerev.models.resolve.resolve_model`) returns one for every kind of source, and the trainer, the
planner, the accounting, export, head growth, the fleet and the daemon read it instead of probing the module
for attributes. A module that arrives without one (a test's module, a chain the planner cut) is described by
:func:`describe`: by what its class registered (:func:`describes`), else by its layers (the input channels of
its first convolution, the rows of its last linear layer).

The handle is frozen, the module in it is not: its weights change every step, and its classifier grows when
new classes come. So the head is the handle's to change (:meth:`ModelHandle.set_head_rows`, and
:func:`edgerev.train.continual.grow_head`), in place, and :attr:`ModelHandle.num_classes` counts the head's
rows each time it is asked: a handle never says a number of classes its module no longer has. What a head
change cannot alter (the input, the normalization, how to rebuild the model) is fixed in its fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn  # noqa: F401 (Tensor: named for the model directory annotations)

from edgerev.engine import InvertibleSequence, engine_body
from edgerev.errors import EdgerevError, described

#: the names the PyTorch route exports a model's input and output under (an ONNX import keeps the file's own)
INPUT_NAME, OUTPUT_NAME = "pixels", "logits"


class SpecError(EdgerevError):
    """A model does not show what edgerev needs of it (its input channels or its classes)."""


class Exporter:
    """How a handle's model goes to ONNX: :data:`TRACED` (torch's exporters trace the module) or :data:`IMPORTED`
    (the weights go back into the file it was imported from). :mod:`edgerev.export.onnx` binds each to its function."""

    TRACED = "traced"
    IMPORTED = "imported"


@dataclass(frozen=True)
class ModelHandle:
    """A model and what the rest of edgerev needs to know of it.

    Attributes:
        module: the ``nn.Module`` that trains (its weights and its head change in place; nothing else is set on it).
        arch: what rebuilds it, as a model directory's ``model.json`` records it: a registry name, a factory
            ``package.module:callable`` (a timm or torchvision module object's builder among them), ``"onnx"``, or
            a module object's class ``package.module:Class``; None when nothing names it (a class defined inside a
            function).
        args: the keyword arguments ``arch`` is built with (``num_classes`` excluded).
        in_channels: the image channels it takes.
        image_size: the one input size it was built for (None: any size its layers take).
        head: the qualified name of its classifier (the layer whose rows are the classes; None: none).
        mean, std: the normalization it expects on pixels scaled to 0..1 (None: not known).
        input_name, output_name: what its ONNX export calls its input and output (an ONNX file's own names).
        onnx_source: an ONNX import's original file (external data inlined): its graph lives there.
        exporter: :class:`Exporter`'s kind.
        fixed_classes: the logits of a model without a linear head (its output's width), else None.
        classes: the class names the source carries, in output order (a model directory's, an ONNX file's
            metadata or sidecar), or ``()``.
    """

    module: nn.Module
    arch: str | None
    in_channels: int
    args: Mapping = field(default_factory=dict)
    image_size: int | None = None
    head: str | None = None
    mean: tuple[float, ...] | None = None
    std: tuple[float, ...] | None = None
    input_name: str = INPUT_NAME
    output_name: str = OUTPUT_NAME
    onnx_source: bytes | None = None
    exporter: str = Exporter.TRACED
    fixed_classes: int | None = None
    classes: tuple[str, ...] = ()

    @property
    def num_classes(self) -> int:
        """The logits it returns: its head's rows now (after growth too), else its fixed output width."""
        if self.head is not None:
            return int(self.module.get_submodule(self.head).out_features)
        if self.fixed_classes is None:
            raise SpecError(f"{type(self.module).__name__} has no linear layer to count its classes from")
        return self.fixed_classes

    @property
    def engine(self) -> InvertibleSequence | None:
        """Its planning surface when it is one of edgerev's models: the engine sequence of its stages (None: a
        model from outside, which the planner cuts into a chain, :mod:`edgerev.memory.graph`)."""
        return engine_body(self.module)

    def replace(self, **changes) -> ModelHandle:
        """A handle with ``changes`` (a new normalization, a module moved or copied)."""
        return dataclasses.replace(self, **changes)

    def set_head_rows(self, rows: int) -> None:
        """Replace the classifier by a fresh one of the same kind with ``rows`` rows (nothing when it has them, or
        when a model without a linear head already returns ``rows`` logits).

        Raises:
            SpecError: the model has no linear layer whose rows are its classes, and returns another count.
        """
        if self.head is None:
            if self.fixed_classes == rows:
                return
            raise SpecError(f"{type(self.module).__name__} has no linear layer whose rows could be its {rows} classes")
        layer = self.module.get_submodule(self.head)
        if layer.out_features == rows:
            return
        from edgerev.models.head import ScaledLinear

        new = (layer.resized(rows) if isinstance(layer, ScaledLinear)  # keeps its scale and its bias-free kind
               else nn.Linear(layer.in_features, rows, bias=layer.bias is not None))
        self.replace_head(new.to(layer.weight.device, layer.weight.dtype))

    def replace_head(self, layer: nn.Linear) -> None:
        """Put ``layer`` where the classifier is (edgerev's own models keep their ``num_classes`` in step)."""
        parent, _, name = self.head.rpartition(".")
        setattr(self.module.get_submodule(parent) if parent else self.module, name, layer)
        for cls in type(self.module).__mro__:
            if cls in _HEAD_GROWN:
                _HEAD_GROWN[cls](self.module, layer.out_features)
                break

    def check_size(self, size: int) -> None:
        """One clear error for an image size the model cannot take: its class's own check where it registered
        one (edgerev's models), its ``image_size`` where it was built for one, else a forward of one zero image
        (no gradient, in eval mode so batch norm's running statistics stay as they were).

        Raises:
            edgerev.errors.ShapeError, SpecError: the size does not fit (one line).
        """
        model = self.module
        tensor = next(iter(model.parameters()), None)
        x = torch.zeros(1, self.in_channels, size, size, device=tensor.device if tensor is not None else "cpu")
        for cls in type(model).__mro__:
            if cls in _INPUT_CHECKS:
                _INPUT_CHECKS[cls](model, x)
                return
        if self.image_size is not None and self.image_size != size:
            raise SpecError(f"the model takes {self.image_size}x{self.image_size} images, not {size}x{size}")
        was = model.training
        try:
            with torch.no_grad():
                model.eval()(x)
        except (RuntimeError, ValueError, IndexError) as e:
            raise SpecError(f"the model cannot take {size}x{size} images: {str(e).strip().splitlines()[0]}") from None
        finally:
            model.train(was)


# ---- what a class says of its models -------------------------------------------------------------------------------

#: class -> the handle's fields its instances carry (edgerev's models, an ONNX import, the planner's chain)
_DESCRIBED: dict[type, Callable[[nn.Module], dict]] = {}
#: class -> its own input check, ``check(module, x)`` raising one line
_INPUT_CHECKS: dict[type, Callable[[nn.Module, torch.Tensor], None]] = {}
#: class -> what follows a new head of ``rows`` rows (a class that keeps its class count as an attribute)
_HEAD_GROWN: dict[type, Callable[[nn.Module, int], None]] = {}


def describes(cls: type, fields: Callable[[nn.Module], dict], *,
              check_input: Callable[[nn.Module, torch.Tensor], None] | None = None,
              head_grown: Callable[[nn.Module, int], None] | None = None) -> None:
    """Say what a model class's instances are: ``fields(module)`` gives the handle's fields it knows (the rest
    are read from its layers), ``check_input`` its own input check, ``head_grown`` what follows a new head.

    A room below the handle's users declares here what it knows of its own models (torchao binds each config
    type to its handler the same way), so nothing above asks the module.
    """
    _DESCRIBED[cls] = fields
    if check_input is not None:
        _INPUT_CHECKS[cls] = check_input
    if head_grown is not None:
        _HEAD_GROWN[cls] = head_grown


_LINEAR = (nn.Linear,)
_CONV = (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose2d)


def last_linear(model: nn.Module) -> str | None:
    """The qualified name of ``model``'s last linear layer: in the order the graph runs them for a
    ``torch.fx.GraphModule``, in module order for any other model (None: none)."""
    if isinstance(model, torch.fx.GraphModule):
        modules = dict(model.named_modules())
        for node in reversed(model.graph.nodes):
            if node.op == "call_module" and isinstance(modules.get(node.target), _LINEAR):
                return node.target
    last = None
    for name, m in model.named_modules():
        if isinstance(m, _LINEAR) and name:
            last = name
    return last


def _first_channels(model: nn.Module, image_size: int | None) -> int:
    first = next((m for m in model.modules() if isinstance(m, _CONV + _LINEAR)), None)
    if first is None:
        raise SpecError(f"{type(model).__name__} has no convolution or linear layer to read its input channels "
                        "from; give the model in_channels through a factory of one's own")
    if isinstance(first, _CONV):
        return first.in_channels
    # a model that flattens the image first: its features are channels x height x width
    if image_size is None or first.in_features % (image_size * image_size):
        raise SpecError(f"{type(model).__name__} flattens its images into a linear layer of {first.in_features} "
                        "features; its input channels cannot be read from it")
    return first.in_features // (image_size * image_size)


def _output_width(model: nn.Module, in_channels: int, image_size: int | None) -> int:
    """The classes of a model with no linear layer (SqueezeNet's last layer is a 1x1 convolution): the width of
    the logits of a forward of a copy without data, two images of ``image_size`` (224 where none is known)."""
    from edgerev._torchapi import shadowed

    size = image_size or 224

    def width(copy: nn.Module):
        copy.eval()
        with torch.no_grad():
            return copy(torch.empty(2, in_channels, size, size)).shape

    name = type(model).__name__
    try:
        shape = shadowed(model, width)
    except Exception as e:  # noqa: BLE001 (any failure of the user's forward is the one line below)
        raise SpecError(f"{name} has no linear layer to count its classes from, and its forward at {size}x{size} "
                        f"failed ({described(e)})") from None
    if len(shape) != 2:
        raise SpecError(f"{name} has no linear layer to count its classes from, and returns a tensor of shape "
                        f"{tuple(shape)} for two images, not [batch, classes]")
    return int(shape[1])


def describe(model: nn.Module | ModelHandle, **known) -> ModelHandle:
    """The handle of ``model``: itself when it is one; else what its class registered (:func:`describes`) and
    ``known`` (the resolver's: ``arch``, ``args``, ``mean``, ``std``...), the rest read from its layers.

    Raises:
        SpecError: the model has no convolution or linear layer to read its input channels from, or no linear
            layer, no known output width and no forward that returns ``[batch, classes]`` to count its classes
            from (one line naming its type).
    """
    if isinstance(model, ModelHandle):
        return model.replace(**known) if known else model
    fields: dict = {}
    for cls in type(model).__mro__:
        if cls in _DESCRIBED:
            fields = _DESCRIBED[cls](model)
            break
    fields = {**fields, **{k: v for k, v in known.items() if v is not None}}
    if "head" not in fields:
        fields["head"] = last_linear(model)
    if "in_channels" not in fields:
        fields["in_channels"] = _first_channels(model, fields.get("image_size"))
    if fields["head"] is None and fields.get("fixed_classes") is None:
        fields["fixed_classes"] = _output_width(model, fields["in_channels"], fields.get("image_size"))
    fields.setdefault("arch", None)
    return ModelHandle(module=model, **fields)
