"""Ingest under the storage budget: it stops where the retention policy starts, so no burst of files takes the
data directory past ``storage.max_bytes``.

The retention policy (:mod:`edgerev_daemon.storage.retention`) runs at the start of every cycle and brings the
data directory under ``storage.target`` of the budget. Ingest then takes what the inbox holds until the data
directory passes that same share: before every file it asks :meth:`IngestBudget.full`; when the bytes kept,
with what the batch under way will add at its commit, pass ``target * max_bytes``, the files examined so far
are committed (a shorter batch, as a stop by SIGTERM commits them), the bytes are read again, and if they are
still past it ingest ends there. The files not examined wait in the inbox, untouched, for the next cycle,
whose retention pass makes room first. Ingest only stops *above* the target, as counted, so that pass has
something to remove (unless a job holds the samples or only protected ones remain: then ingest waits, as the
retention policy says); should the count be higher than that pass measures, the next ingest measures afresh
and takes at least one file.

Above the target, the rest of the budget is headroom for what ingest overshoots by (the file that passed the
target, and what a batch's commit added beyond its estimate), a job's checkpoints and the version it writes,
and the journal lines and write-ahead log pages of the next removal, written before its blobs go.

Counting is cheap enough for every file: the data directory is measured once at the start (its blob folders'
sums cached by :class:`~edgerev_daemon.storage.usage.DiskUsage`), then what ingest writes is added as it
lands: each blob and the growth of its folder, each quarantined file and its reason file. The store (with its
write-ahead log) and the journal grow at each commit and are read again after it (four ``stat`` calls); what
the batch under way will add to them is reckoned per file at the most a file added at a commit of this
ingest, one page before the first.
"""

from __future__ import annotations

import math
import os

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.layout import SIDECAR
from edgerev_daemon.storage.usage import DiskUsage, file_bytes

PAGE = 4096  # what a file is reckoned to add to the store and journal at its commit, before one was measured


class IngestBudget:
    """The bytes the data directory keeps, kept current while ingest adds to it, against ingest's bound:
    ``storage.target`` of ``storage.max_bytes`` (no bound without a budget: nothing is measured)."""

    def __init__(self, config: DaemonConfig, usage: DiskUsage | None = None) -> None:
        st = config.storage
        self.layout = config.layout
        self.max_bytes, self.target = st.max_bytes, st.target
        self.bound = None if self.max_bytes is None else math.floor(self.target * self.max_bytes)
        self.per_file: int | None = None  # the most a file added at a commit of this ingest (None: none yet)
        self.pending = 0  # files examined since the last commit
        if self.bound is None:
            return
        start = (usage or DiskUsage(self.layout)).measure()
        self.books = self._books()
        self.rest = start.total - start.store - start.journal  # what a commit does not change
        self.folders = {e.name: file_bytes(self.layout.blobs / e.name) for e in _folders(self.layout.blobs)}

    def _books(self) -> int:
        """The store's files (with the write-ahead log) and the journal: what a commit grows."""
        db = self.layout.database
        return sum(file_bytes(db.with_name(db.name + s)) for s in ("", "-wal", "-shm")) + file_bytes(
            self.layout.journal)

    @property
    def used(self) -> int:
        """Bytes kept now, as counted (0 without a budget)."""
        return 0 if self.bound is None else self.rest + self.books

    def full(self) -> bool:
        """Whether the bytes kept, with what the files examined since the last commit will add to the store at
        theirs, pass the bound."""
        per_file = PAGE if self.per_file is None else self.per_file
        return self.bound is not None and self.used + self.pending * per_file > self.bound

    def examined(self) -> None:
        """One more file for the next commit to record (stored, a duplicate, quarantined: each is a row)."""
        self.pending += 1

    def wrote_blob(self, path: os.PathLike) -> None:
        """A blob was written at ``path``: add it, and what its folder grew by."""
        if self.bound is None:
            return
        folder = os.path.dirname(path)
        name = os.path.basename(folder)
        now = file_bytes(folder)
        self.rest += file_bytes(path) + now - self.folders.get(name, 0)
        self.folders[name] = now

    def quarantined(self, moved_to: str) -> None:
        """A file was quarantined (``moved_to`` as :func:`~edgerev_daemon.intake.quarantine.quarantine` returns
        it): add it and its reason file (a file left in the inbox, across file systems, only its reason)."""
        if self.bound is None:
            return
        if moved_to.startswith("quarantine/"):
            path = self.layout.quarantine / moved_to.split("/", 1)[1]
            self.rest += file_bytes(path) + file_bytes(path.with_name(path.name + SIDECAR))
        else:
            self.rest += PAGE

    def committed(self) -> None:
        """A batch was committed (or had nothing to record): read the store and the journal again, and learn
        from what they grew by what a file adds."""
        if self.bound is None:
            return
        books = self._books()
        if self.pending:
            self.per_file = max(self.per_file or 0, math.ceil((books - self.books) / self.pending))
        self.books, self.pending = books, 0

    def why(self, waiting: int) -> str:
        """The line that says ingest stopped at its bound, and how many files wait."""
        return (f"{self.used} bytes kept, past {100 * self.target:.0f} % (storage.target) of storage.max_bytes "
                f"({self.max_bytes}): {waiting} inbox files wait for the next cycle, whose retention pass makes room")


def _folders(root: os.PathLike) -> list[os.DirEntry]:
    try:
        return [e for e in os.scandir(root) if e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []
