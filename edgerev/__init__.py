"""edgerev: on-device continual learning with reversible networks whose training memory does not grow with depth.

Importing edgerev never touches CUDA, and never imports torch by itself: the names below are loaded
on first use, so the torch-free parts (``edgerev.export.predict``, the ONNX Runtime training backend,
``edgerev.errors``) run on devices without PyTorch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

__version__ = "0.1.0"

# public name -> module that defines it (imported on first access, see __getattr__)
_LAZY = {
    "InvertibleSequence": "edgerev.engine",
    "Mode": "edgerev.engine",
    "plain": "edgerev.engine",
    "EdgerevError": "edgerev.errors",
    "NonFiniteError": "edgerev.errors",
    "ShapeError": "edgerev.errors",
    "UnknownModelError": "edgerev.errors",
    "create_model": "edgerev.models",
    "fit": "edgerev.api",
    "list_models": "edgerev.models",
    "model_spec": "edgerev.models.spec",
    "plan": "edgerev.api",
    "resolve_model": "edgerev.models.resolve",
}

if TYPE_CHECKING:  # what type checkers and editors see
    from edgerev.api import fit, plan
    from edgerev.engine import InvertibleSequence, Mode, plain
    from edgerev.errors import EdgerevError, NonFiniteError, ShapeError, UnknownModelError
    from edgerev.models import create_model, list_models
    from edgerev.models.resolve import resolve_model
    from edgerev.models.spec import model_spec

__all__ = [
    "EdgerevError",
    "InvertibleSequence",
    "Mode",
    "NonFiniteError",
    "ShapeError",
    "UnknownModelError",
    "__version__",
    "create_model",
    "fit",
    "list_models",
    "model_spec",
    "plain",
    "plan",
    "resolve_model",
]

__getattr__, __dir__ = lazy_attributes("edgerev", _LAZY, globals())
