"""What rebuilds a module object of a package edgerev knows: timm's and torchvision's builders.

A module handed to :func:`edgerev.fit` is recorded in its model directory by what rebuilds it. Its class alone
rarely does for these two packages: timm's ``MobileNetV3`` takes its ``block_args``, torchvision's ``ResNet``
its ``block`` and ``layers``; their builders (``timm.create_model("mobilenetv3_small_050")``,
``torchvision.models.resnet18()``) are what make them. :func:`package_builder` finds that builder, one function
per package in :data:`BUILDERS`, keyed by the top-level package the module's class comes from, so neither
package is imported unless the module already comes from it (they are not edgerev's dependencies).

- **timm** records its models' names: ``pretrained_cfg["architecture"]`` (``default_cfg`` in older releases).
  The builder is ``timm:create_model`` (timm's public name for it) with ``model_name``, ``in_chans`` when
  the first convolution does not take 3 channels, and ``img_size`` when the module's weights have the shapes of
  another image size than its default (EfficientFormerV2's attention biases: built at 64x64, not 224x224).
- **torchvision** does not. Its registered builders (``torchvision.models.list_models()``) that return the
  module's class are built on the meta device (nothing allocated), with the module's classifier rows, and
  the one whose weights have the module's names and shapes is its builder; none, or two that differ, is
  refused.

``num_classes`` is never recorded: it comes from the data when the model directory is rebuilt. What comes
back is checked the same way as any module object before a run starts
(:func:`edgerev.models.resolve.rebuild_error`: names and shapes of the weights).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Callable

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from edgerev.errors import EdgerevError


class NoBuilder(EdgerevError):
    """A module of a known package whose builder cannot be named: the message says why, in one line."""


def weight_shapes(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """The names and shapes of ``model``'s weights and buffers: what a model directory's weights must fit."""
    return {k: tuple(v.shape) for k, v in model.state_dict().items()}


def shapes_differ(own: dict[str, tuple[int, ...]], built: dict[str, tuple[int, ...]]) -> list[str]:
    """The names present in one of two :func:`weight_shapes` only, then those of another shape (sorted)."""
    return sorted(set(own) ^ set(built)) + sorted(k for k in own if k in built and own[k] != built[k])


def package_builder(model: nn.Module, num_classes: int, in_channels: int) -> tuple[str, dict] | None:
    """The factory ``package.module:callable`` and keyword arguments (``num_classes`` left out) that rebuild
    ``model``, when its class comes from a package in :data:`BUILDERS`; None when it comes from another.

    Args:
        num_classes: the rows of its classifier now.
        in_channels: the image channels it takes.

    Raises:
        NoBuilder: the class is the package's, but no builder of it can be named (one line).
    """
    package = type(model).__module__.partition(".")[0]
    find = BUILDERS.get(package)
    return None if find is None else find(model, num_classes, in_channels)


def _timm(model: nn.Module, num_classes: int, in_channels: int) -> tuple[str, dict]:
    cfg = vars(model).get("pretrained_cfg") or vars(model).get("default_cfg") or {}
    name = cfg.get("architecture") if isinstance(cfg, dict) else getattr(cfg, "architecture", None)
    if not isinstance(name, str) or not name:
        raise NoBuilder(f"timm's {type(model).__qualname__} carries no model name (pretrained_cfg['architecture']): "
                        "it was not made by timm.create_model")
    args = {"model_name": name, **({} if in_channels == 3 else {"in_chans": in_channels})}
    import timm

    own = weight_shapes(model)
    built = _built_empty(timm.create_model, num_classes, args)
    if built is None or not shapes_differ(own, weight_shapes(built)):
        return "timm:create_model", args  # (one that cannot be built empty is checked by rebuild_error)
    try:
        takes_size = "img_size" in inspect.signature(type(model).__init__).parameters
    except (TypeError, ValueError):
        takes_size = False
    for size in _IMG_SIZES if takes_size else ():  # its weights' shapes follow the image size it was built for
        built = _built_empty(timm.create_model, num_classes, {**args, "img_size": size})
        if built is not None and not shapes_differ(own, weight_shapes(built)):
            return "timm:create_model", {**args, "img_size": size}
    return "timm:create_model", args  # rebuild_error names the weights that differ


#: the ``img_size`` values tried for a timm model whose weights built by its name alone have other shapes (timm
#: records a model's name, not the arguments it was built with): 32 to 512 in steps of 32, the first that builds
#: every weight's name and shape is recorded
_IMG_SIZES = tuple(range(32, 513, 32))


def package_normalization(model: nn.Module, in_channels: int) -> tuple[tuple[float, ...], tuple[float, ...]] | None:
    """The mean and std a package pairs with ``model``: timm's ``pretrained_cfg`` (the normalization its weights are
    trained at, and that timm's own transforms apply), where it holds one value per input channel; None for another
    package's module or a configuration without them."""
    if type(model).__module__.partition(".")[0] != "timm":
        return None
    cfg = vars(model).get("pretrained_cfg") or vars(model).get("default_cfg") or {}
    mean, std = (cfg.get("mean"), cfg.get("std")) if isinstance(cfg, dict) else (None, None)
    try:
        mean, std = tuple(float(v) for v in mean), tuple(float(v) for v in std)
    except (TypeError, ValueError):
        return None
    if len(mean) != in_channels or len(std) != in_channels or not all(v > 0 for v in std):
        return None
    return mean, std


def _torchvision(model: nn.Module, num_classes: int, in_channels: int) -> tuple[str, dict]:
    from torchvision import models

    cls = type(model)
    own = weight_shapes(model)
    found: dict[Callable, tuple[str, dict]] = {}  # builder -> its registered name and arguments
    tried = []
    kept = kept_arguments(model)
    for name in models.list_models():
        fn = models.get_model_builder(name)
        returns = inspect.signature(fn).return_annotation
        if returns not in (cls, cls.__name__, inspect.Signature.empty):
            continue  # a builder of another class: its annotation says so without building it
        tried.append(name)
        for args in ({}, kept) if kept else ({},):
            built = _built_empty(fn, num_classes, args)
            if type(built) is cls and not shapes_differ(own, weight_shapes(built)):
                found.setdefault(fn, (name, args))
                break
    if len(found) > 1:
        raise NoBuilder(f"torchvision builders {', '.join(sorted(n for n, _ in found.values()))} all build this "
                        f"{cls.__qualname__}; name the one that built it as a factory")
    if not found:
        more = f" and {len(tried) - 5} more" if len(tried) > 5 else ""
        which = f" (tried {', '.join(tried[:5])}{more})" if tried else ""
        raise NoBuilder(f"no torchvision builder makes a {cls.__qualname__} with these weights' names and "
                        f"shapes{which}")
    (fn, (name, args)), = found.items()
    public = f"torchvision.models:{name}" if getattr(models, name, None) is fn else f"{fn.__module__}:{fn.__qualname__}"
    return public, args


#: the types of a constructor argument :func:`kept_arguments` recovers (what a model directory's JSON holds)
_KEPT_TYPES = (bool, int, float, str)


def kept_arguments(model: nn.Module) -> dict:
    """The arguments of ``model``'s constructor that it keeps as attributes of the same name, where they differ from
    the constructor's defaults: many modules keep theirs (torchvision's GoogLeNet keeps ``aux_logits``). Only
    values of :data:`_KEPT_TYPES` whose default is of the same type; a builder given them is still checked to build
    the weights' names and shapes."""
    try:
        params = inspect.signature(type(model).__init__).parameters
    except (TypeError, ValueError):
        return {}
    own = vars(model)
    kept = {}
    for name, p in params.items():
        value = own.get(name)
        if (p.default is inspect.Parameter.empty or type(p.default) not in _KEPT_TYPES
                or type(value) is not type(p.default) or value == p.default):
            continue
        kept[name] = value
    return kept


def _built_empty(fn: Callable[..., nn.Module], num_classes: int, args: dict | None = None) -> nn.Module | None:
    """What ``fn(num_classes=..., **args)`` builds, its weights without memory: on the meta device, or, for a builder
    that computes its layout from tensors' values (torchvision's RegNet), with only ``torch.empty`` (what layers make
    their weights with) on the meta device; None when it cannot build one of these rows."""
    for where in (torch.device("meta"), _EmptyOnMeta()):
        try:
            with where, warnings.catch_warnings():
                warnings.simplefilter("ignore")  # a builder's deprecation notes are not the owner's business
                return fn(num_classes=num_classes, **(args or {}))
        except Exception:  # noqa: BLE001, S112  (a builder that cannot build this way does not build this module)
            continue
    return None


class _EmptyOnMeta(TorchFunctionMode):
    """``torch.empty`` on the meta device, every other function as it is (a thread's own mode, as torch's device
    context is)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.empty:
            kwargs = {**kwargs, "device": "meta"}
        return func(*args, **kwargs)


#: the top-level package a module's class comes from, and the function that names its builder:
#: ``find(module, num_classes, in_channels) -> (factory, args)``, raising :class:`NoBuilder`
BUILDERS: dict[str, Callable[[nn.Module, int, int], tuple[str, dict]]] = {
    "timm": _timm,
    "torchvision": _torchvision,
}
