"""What the data directory holds, in bytes, measured cheaply enough to do at every cycle.

The budget (``storage.max_bytes``) covers everything the daemon keeps: blobs, the store (with its
write-ahead log), the journal, the version directories, a job's checkpoints and the quarantine. The
figure is what the files occupy on disk (``st_blocks``), not their lengths: a 3 KB PNG takes a 4 KiB
block, and the disk is what runs out.

The blob folder is the one that grows (hundreds of thousands of files in 256 folders), so each of its
folders is summed once and cached under its modification time: a folder whose entries did not change
keeps its sum, and a cycle stats 256 folders instead of every file. A file written into a folder within
the file system's timestamp granularity of the scan could leave the time unchanged; a folder modified in
the last :data:`SETTLE_SECONDS` is therefore scanned again at the next measure.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerev_daemon.layout import Layout

SETTLE_SECONDS = 2.0


@dataclass(frozen=True)
class Usage:
    """Bytes on disk by part of the data directory."""

    blobs: int = 0
    store: int = 0
    journal: int = 0
    versions: int = 0
    jobs: int = 0
    quarantine: int = 0

    @property
    def total(self) -> int:
        return self.blobs + self.store + self.journal + self.versions + self.jobs + self.quarantine

    def to_json(self) -> dict:
        return asdict(self) | {"total": self.total}


def _on_disk(st: os.stat_result) -> int:
    blocks = getattr(st, "st_blocks", None)
    return blocks * 512 if blocks is not None else st.st_size


def tree_bytes(path: Path) -> int:
    """Bytes on disk of every file under ``path`` (links are not followed; a missing path is 0)."""
    total = 0
    try:
        entries = list(os.scandir(path))
    except (FileNotFoundError, NotADirectoryError):
        return 0
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                total += tree_bytes(Path(e.path))
            else:
                total += _on_disk(e.stat(follow_symlinks=False))
        except FileNotFoundError:  # removed while we looked
            continue
    return total


def file_bytes(path: Path) -> int:
    try:
        return _on_disk(os.stat(path, follow_symlinks=False))
    except FileNotFoundError:
        return 0


class DiskUsage:
    """Measures a data directory, caching each blob folder's sum under its modification time."""

    def __init__(self, layout: Layout, wall: callable = time.time) -> None:
        self.layout = layout
        self._wall = wall  # the file system's times are wall-clock times, whatever clock the daemon runs on
        self._folders: dict[str, tuple[int, int]] = {}  # name -> (mtime_ns, bytes)
        self._lock = threading.Lock()  # the HTTP page's threads share one (see :func:`shared`)

    def blobs(self) -> int:
        root = self.layout.blobs
        total, seen = 0, set()
        try:
            folders = list(os.scandir(root))
        except FileNotFoundError:
            return 0
        recent = (self._wall() - SETTLE_SECONDS) * 1e9
        for e in folders:
            try:
                st = e.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not e.is_dir(follow_symlinks=False):
                total += _on_disk(st)
                continue
            seen.add(e.name)
            cached = self._folders.get(e.name)
            if cached is not None and cached[0] == st.st_mtime_ns and st.st_mtime_ns < recent:
                total += cached[1]
                continue
            n = tree_bytes(Path(e.path)) + _on_disk(st)
            self._folders[e.name] = (st.st_mtime_ns, n)
            total += n
        for gone in set(self._folders) - seen:
            del self._folders[gone]
        return total

    def measure(self) -> Usage:
        with self._lock:
            return self._measure()

    def _measure(self) -> Usage:
        layout = self.layout
        db = layout.database
        store = sum(file_bytes(db.with_name(db.name + s)) for s in ("", "-wal", "-shm"))
        return Usage(blobs=self.blobs(), store=store, journal=file_bytes(layout.journal),
                     versions=tree_bytes(layout.root / "versions"), jobs=tree_bytes(layout.jobs),
                     quarantine=tree_bytes(layout.quarantine))


_SHARED: dict[Path, DiskUsage] = {}
_SHARED_LOCK = threading.Lock()


def shared(layout: Layout) -> DiskUsage:
    """One :class:`DiskUsage` per data directory and process: ``status`` asked again (the HTTP page, a
    Prometheus scrape every few seconds) walks only the blob folders that changed since."""
    with _SHARED_LOCK:
        usage = _SHARED.get(layout.root)
        if usage is None:
            usage = _SHARED[layout.root] = DiskUsage(layout)
        return usage
