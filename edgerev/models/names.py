"""The registry's names, and what else may name a model, without building anything: what a config checks
``model.arch`` against.

Importing this module imports no torch (the package loads its torch-backed names on first use), so
the daemon's config, ``edgerev daemon status`` and ``check`` stay light. The registry itself
(:func:`edgerev.models.list_models`) must list exactly these names; a test checks.
"""

from __future__ import annotations

import re
from enum import Enum

from edgerev.errors import UnknownModelError

ARCHS = ("irevnet", "layerwise", "resnet18", "revnet", "revnext")

# package.module:callable (dotted on both sides: a class's classmethod, a nested factory)
_FACTORY = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*:[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$")


class SourceKind(Enum):
    """Where a model comes from (see :mod:`edgerev.models.resolve`)."""

    REGISTRY = "registry"  # a name of list_models()
    DIRECTORY = "directory"  # an edgerev model directory (model.json + model.safetensors)
    ONNX = "onnx"  # an .onnx file
    FACTORY = "factory"  # package.module:callable returning an nn.Module
    MODULE = "module"  # an nn.Module object, from Python (never spelt: source_kind does not return it)


SOURCES_HELP = ("a registry name (" + ", ".join(ARCHS) + "), a model directory (a path with a /), an .onnx file or "
                "a factory package.module:callable")


def source_kind(arch: str) -> SourceKind:
    """What ``arch`` names, from its spelling alone (nothing is opened or imported).

    A path is told from a registry name by a ``/`` (``./run1``) or an ``.onnx`` suffix, so a typo of a
    registry name is refused here instead of being looked for as a folder.

    Raises:
        UnknownModelError: ``arch`` is none of them (the message lists what it may be).
    """
    if arch in ARCHS:
        return SourceKind.REGISTRY
    if _FACTORY.match(arch):
        return SourceKind.FACTORY
    if arch.lower().endswith(".onnx"):
        return SourceKind.ONNX
    if "/" in arch or arch.startswith(("~", ".")):
        return SourceKind.DIRECTORY
    raise UnknownModelError(f"unknown architecture {arch!r}; give {SOURCES_HELP}")
