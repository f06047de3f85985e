"""Model families, all reachable by name through the registry."""

from edgerev.models import resnet, revnet, revnext  # noqa: F401  (registers the models)
from edgerev.models._registry import create_model, list_models, register_model
from edgerev.models.base import EngineModel, SequentialModel

__all__ = ["EngineModel", "SequentialModel", "create_model", "list_models", "register_model"]
