"""Package attributes imported on first use (PEP 562), so importing a package never imports torch."""

from __future__ import annotations

import importlib
from collections.abc import Callable


def lazy_attributes(package: str, table: dict[str, str], namespace: dict) -> tuple[Callable, Callable]:
    """``(__getattr__, __dir__)`` for ``package``: ``table`` maps a public name to the module defining it.

    A name is imported on first access and stored in ``namespace`` (the package's ``globals()``), so
    later lookups do not come back here.
    """

    def __getattr__(name: str):
        module = table.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value
        return value

    def __dir__() -> list[str]:
        return sorted({*namespace, *table})

    return __getattr__, __dir__
