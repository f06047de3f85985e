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
