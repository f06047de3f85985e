"""Errors that edgerev raises on bad input.

Every check that guards user input raises a subclass of :class:`EdgerevError` with one sentence that
names the problem, so the CLI can print it as a single line instead of a stack trace deep in torch.
"""

from __future__ import annotations


def one_line(e: BaseException) -> str:
    """``e``'s message on one line (its type's name where it has none): what a command line, a log line or an
    HTTP body prints of an error, whatever a library's message quoted (SQLite's quotes a damaged schema's SQL,
    newlines and all)."""
    return " ".join(str(e).split()) or type(e).__name__


def described(e: BaseException) -> str:
    """``e`` as its type's name and its message's first line (the name alone where it has none): what a summary, a
    refusal or a fact records of an error that it passes over (``RuntimeError: CUDA error: out of memory``)."""
    lines = str(e).strip().splitlines()
    return f"{type(e).__name__}: {lines[0].strip()}" if lines else type(e).__name__


class EdgerevError(ValueError):
    """Base class of all edgerev input errors."""


class ShapeError(EdgerevError):
    """An input tensor has a shape a layer or model cannot take."""


class UnknownModelError(EdgerevError, KeyError):
    """A model name is not in the registry."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class NonFiniteError(EdgerevError):
    """A tensor holds NaN or infinity where finite values are required."""


class ModeError(EdgerevError):
    """A stage was asked to run in a mode it does not support."""


class ExportError(EdgerevError):
    """A model cannot be exported to ONNX, its export does not match PyTorch, or an ONNX file cannot be used."""


class ArchitectureError(EdgerevError):
    """A model's arguments describe a network its design cannot build (a width, a block list)."""


class UnsupportedModel(EdgerevError):
    """A model file cannot be imported: not ONNX, truncated, or an op, opset, type or shape edgerev cannot train."""


class TrustError(EdgerevError):
    """A file asks for what only the owner may name: code to run (a factory the owner has not allowed), or a
    file outside the folder of the model that names it (:mod:`edgerev.models.trust`)."""
