"""Errors the daemon raises on bad input or a state it refuses to work in.

Each is an :class:`edgerev.errors.EdgerevError` (so the CLI prints it as one line) whose message names
the file, key or directory at fault.
"""

from __future__ import annotations

from edgerev.errors import EdgerevError


class DaemonError(EdgerevError):
    """Base class of the daemon's errors."""


class StoreError(DaemonError):
    """The database cannot be used: newer schema, wrong image size, an illegal state change."""


class LockError(DaemonError):
    """Another daemon holds the data directory."""


class Stopped(Exception):  # noqa: N818 (not an error: the service was asked to stop)
    """The service was asked to stop in the middle of a phase (an evaluation, the ONNX export, a
    promotion), which ends there: what it had done is safe to leave, and the next start does it again.
    The message names the phase. Not an :class:`~edgerev.errors.EdgerevError`: nothing failed."""
