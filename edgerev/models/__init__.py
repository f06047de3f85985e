"""Model families, all reachable by name through the registry.

The names below load on first use (the registry imports every model family, and torch with them),
so :mod:`edgerev.models.names` can be read without torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

_LAZY = {
    **dict.fromkeys(("create_model", "list_models", "register_model"), "edgerev.models.registered"),
    **dict.fromkeys(("EngineModel", "SequentialModel"), "edgerev.models.base"),
}

if TYPE_CHECKING:
    from edgerev.models.base import EngineModel, SequentialModel
    from edgerev.models.registered import create_model, list_models, register_model

__all__ = ["EngineModel", "SequentialModel", "create_model", "list_models", "register_model"]

__getattr__, __dir__ = lazy_attributes("edgerev.models", _LAZY, globals())
