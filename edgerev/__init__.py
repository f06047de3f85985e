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
    "list_models": "edgerev.models",
}

if TYPE_CHECKING:  # what type checkers and editors see
    from edgerev.engine import InvertibleSequence, Mode, plain
    from edgerev.errors import EdgerevError, NonFiniteError, ShapeError, UnknownModelError
    from edgerev.models import create_model, list_models

__all__ = [
    "EdgerevError",
    "InvertibleSequence",
    "Mode",
    "NonFiniteError",
    "ShapeError",
    "UnknownModelError",
    "__version__",
    "create_model",
    "list_models",
    "plain",
]

__getattr__, __dir__ = lazy_attributes("edgerev", _LAZY, globals())
