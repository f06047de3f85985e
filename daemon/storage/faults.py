"""Storage faults are weather: lasting conditions, logged once when they start and once when they clear.

A full disk, an I/O error, a read-only remount: none is the input's fault and none ends the service.
:class:`Conditions` remembers which conditions hold now. :meth:`Conditions.begin` logs a condition the
first time it is seen and records an event; while it lasts, each new sighting only counts on that event
(``repeats``), so a fault seen at every poll for a week is one row, not a hundred thousand.
:meth:`Conditions.end` logs that it cleared. Recording an event may itself fail on the full disk it
reports: that failure is swallowed (the log line already went out), never raised out of the loop.
"""

from __future__ import annotations

import errno
import logging
import shutil
import sqlite3
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from edgerev_daemon.storage.records import EventKind

log = logging.getLogger("edgerev.daemon")

STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EIO, errno.EROFS, errno.EDQUOT, errno.EFBIG})
_SQLITE_STORAGE = ("disk is full", "disk i/o error", "readonly database", "unable to open database")


def storage_fault(e: BaseException) -> str | None:
    """A one-line description when ``e`` is a storage fault (disk full, I/O error, read-only file
    system), else ``None``. Follows ``__cause__``/``__context__``: SQLite's errors arrive wrapped."""
    seen = 0
    while e is not None and seen < 8:
        if isinstance(e, OSError) and e.errno in STORAGE_ERRNOS:
            return f"{e.strerror or e}" + (f": {e.filename}" if e.filename else "")
        if isinstance(e, sqlite3.Error) and any(s in str(e).lower() for s in _SQLITE_STORAGE):
            return f"SQLite: {e}"
        e = e.__cause__ or e.__context__
        seen += 1
    return None


def free_bytes(path: Path) -> int | None:
    """Free space for an unprivileged writer on ``path``'s file system (None: cannot tell)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


@dataclass
class Condition:
    message: str
    since: float
    seen: int = 1


class Conditions:
    """The lasting conditions of one daemon (by key: ``"storage"``, ``"disk space"``, ...).

    Args:
        record: adds an event ``(kind, message, repeat)`` (the store's ``add_event``); may raise.
        clock: seconds since the epoch.
    """

    def __init__(self, record: Callable[[EventKind, dict, bool], object], clock: Callable[[], float]) -> None:
        self._record = record
        self.clock = clock
        self.active: dict[str, Condition] = {}

    def begin(self, key: str, message: str) -> bool:
        """Note that condition ``key`` holds; returns whether it is new (logged now)."""
        cond = self.active.get(key)
        new = cond is None or cond.message != message
        if new:
            log.error("%s: %s; the daemon keeps running and retries at every poll", key, message)
            self.active[key] = Condition(message, self.clock())
        else:
            cond.seen += 1
        self.event(EventKind.ERROR, {"where": key, "error": message}, repeat=True)
        return new

    def end(self, key: str) -> bool:
        """Note that condition ``key`` no longer holds; returns whether it held (logged now)."""
        cond = self.active.pop(key, None)
        if cond is None:
            return False
        log.warning("%s cleared after %.0f s (%d polls): %s", key, self.clock() - cond.since, cond.seen, cond.message)
        self.event(EventKind.INFO, {"message": f"{key} cleared: {cond.message}"})
        return True

    def event(self, kind: EventKind, message: dict, repeat: bool = False) -> bool:
        """Record an event if the store can take it; returns whether it could (never raises an error)."""
        try:
            self._record(kind, message, repeat)
            return True
        except Exception as e:  # noqa: BLE001 - the error path must not fail the process
            log.debug("event not recorded (%s): %s", e, message)
            return False

    def to_json(self) -> dict:
        return {k: {"message": c.message, "since": c.since, "polls": c.seen} for k, c in self.active.items()}
