"""edgerev: on-device continual learning with reversible networks whose training memory does not grow with depth.

Importing edgerev never touches CUDA.
"""

from edgerev.engine import InvertibleSequence, Mode, plain
from edgerev.errors import EdgerevError, NonFiniteError, ShapeError, UnknownModelError
from edgerev.models import create_model, list_models

__version__ = "0.1.0"

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
