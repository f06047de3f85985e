"""The registry with every model family registered (importing this module registers them)."""

from edgerev.models import resnet, revnet, revnext  # noqa: F401  (registers the models)
from edgerev.models._registry import create_model, list_models, register_model

__all__ = ["create_model", "list_models", "register_model"]
