"""Model registry: ``create_model(name, **overrides)`` and ``list_models()``."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

from edgerev.errors import UnknownModelError

_MODELS: dict[str, Callable[..., nn.Module]] = {}


def register_model(fn: Callable[..., nn.Module]) -> Callable[..., nn.Module]:
    """Register a factory under its function name."""
    name = fn.__name__
    if name in _MODELS:
        raise ValueError(f"model {name!r} is registered twice")
    _MODELS[name] = fn
    return fn


def list_models() -> list[str]:
    """Names of all registered models, sorted."""
    return sorted(_MODELS)


def create_model(name: str, **overrides) -> nn.Module:
    """Build a registered model; ``overrides`` replace its default arguments."""
    if name not in _MODELS:
        raise UnknownModelError(f"unknown architecture {name!r}; choose from {', '.join(list_models())}")
    try:
        model = _MODELS[name](**overrides)
    except TypeError as e:
        raise UnknownModelError(f"bad arguments for {name!r}: {e}") from None
    model.arch = name
    return model
