"""The store is an index: refuse to start on a lost one, and rebuild it from the files.

What cannot be recreated is the images (the blobs, after ingest the only copy) and what is known about
them (the journal, :mod:`edgerev_daemon.storage.journal`). A store that is missing, empty (zero bytes after a
power cut or an fsck) or damaged, next to blobs, a journal or model versions, is not a fresh start:
:func:`guard_start` refuses it with the way out, before anything opens (opening would create an empty
store, which would call every blob an orphan). :func:`rebuild` is that way out: a new store from the
journal (samples, labels, splits, batches, the count of removed samples), the blobs it names, and the
version directories on disk (their ``metrics.json`` and ``model.json``); the job history, the versions
that were refused and the events, which only the store holds, are copied from the old store as far as it
can still be read (``check`` names what a rebuild from a lost store would lose). Unlabelled samples come
back unlabelled, and those labelled later with the label, split and batch their labelling line gave.
:func:`replay` records, at start, journal lines an intact store lacks (samples or labels: a crash between
the journal's fsync and the commit, or lost rows).
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgerev.atomic import fsync_dir
from edgerev.errors import one_line
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import StoreError
from edgerev_daemon.layout import Layout
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.faults import storage_fault
from edgerev_daemon.storage.journal import Journal, JournalContents
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.schema import LATEST, current_version, schema_difference
from edgerev_daemon.storage.store import Store

log = logging.getLogger(__name__)


@dataclass
class Evidence:
    """What the data directory holds besides the store: things a fresh start would ignore or destroy."""

    blobs: int = 0
    journal_lines: int = 0
    versions: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.blobs or self.journal_lines or self.versions)

    def describe(self) -> str:
        parts = [f"{n} {what}" for n, what in ((self.blobs, "blobs"), (self.journal_lines, "journal records")) if n]
        if self.versions:
            parts.append(f"{len(self.versions)} model versions")
        return ", ".join(parts)


def evidence(layout: Layout) -> Evidence:
    """Count what a data directory holds outside the store (no file is written)."""
    found = Evidence()
    found.blobs = sum(1 for key, _ in BlobStore(layout.blobs).scan() if key is not None)
    if layout.journal.is_file():
        found.journal_lines = len(Journal(layout.journal).read().records)
    found.versions = Registry(layout.root).versions()
    return found


UNREADABLE = "cannot be read now"  # a storage fault (full disk, I/O error) kept it from being opened


def store_state(path: Path, thorough: bool = True) -> str | None:
    """Why the store at ``path`` cannot be trusted, or ``None`` when it is intact. Opens it read-only:
    a missing or empty file is never turned into a fresh database here. A storage fault while opening
    (a full disk: SQLite cannot create its shared-memory file) is not damage: the answer then starts
    with :data:`UNREADABLE` and the caller waits instead of refusing. ``thorough``: also run
    ``PRAGMA quick_check`` (reads every page; ``status``, called often, skips it)."""
    if not path.exists():
        return "is missing"
    if not path.is_file():
        return "is not a file"
    if path.stat().st_size == 0:
        return "is empty (0 bytes)"
    try:
        return _inspect(f"{path.resolve().as_uri()}?mode=ro", thorough)
    except sqlite3.Error as e:
        if storage_fault(e) is None:
            return f"is damaged ({one_line(e)})"
        wal = path.with_name(path.name + "-wal")
        if wal.exists() and wal.stat().st_size > 0:
            return f"{UNREADABLE} ({one_line(e)})"  # its last commits live in the write-ahead log: read it later
    try:  # the main file alone, without the shared memory a full disk cannot hold
        return _inspect(f"{path.resolve().as_uri()}?immutable=1", thorough)
    except sqlite3.Error as e:
        return f"{UNREADABLE} ({one_line(e)})" if storage_fault(e) else f"is damaged ({one_line(e)})"


def _inspect(uri: str, thorough: bool) -> str | None:
    try:
        return _inspect_schema(uri, thorough)
    except UnicodeDecodeError as e:
        # a damaged schema name quoted in SQLite's own message is not UTF-8: Python cannot decode the message and
        # raises this instead of the sqlite3 error it carries
        raise sqlite3.DatabaseError(f"malformed database schema (undecodable text at byte {e.start})") from None


def _inspect_schema(uri: str, thorough: bool) -> str | None:
    conn = sqlite3.connect(uri, uri=True, timeout=10.0)
    try:
        if not conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'schema_version'").fetchone():
            return "holds no edgerev schema"
        bad = [r[0] for r in conn.execute("PRAGMA quick_check") if r[0] != "ok"] if thorough else []
        if bad:
            return f"is damaged ({bad[0]})"
        version = current_version(conn)
        if version < 1:
            return "holds no edgerev schema"
        differs = schema_difference(conn, min(version, LATEST))  # a newer store is refused when it opens
        return None if differs is None else f"is damaged ({differs})"
    finally:
        conn.close()


def guard_start(config: DaemonConfig, config_path: str | Path | None = None) -> None:
    """Refuse a data directory whose store is lost or damaged while blobs, a journal or versions remain.

    Raises:
        StoreError: one line: what is wrong, what remains, and the command that rebuilds the store.
    """
    layout = config.layout
    why = store_state(layout.database)
    if why is None or why.startswith(UNREADABLE):
        return  # intact, or not readable on a full disk now: the daemon comes up and waits
    found = evidence(layout)
    if not found and why == "is missing":
        return  # a new data directory
    if not found and why == "is empty (0 bytes)":
        return  # created by a start that died at once: nothing to lose
    raise refusal(layout, why, config_path, found)


def refusal(layout: Layout, why: str, config_path: str | Path | None = None, found: Evidence | None = None
            ) -> StoreError:
    """The one-line refusal to start on a store that ``why`` (``is missing``, ``is damaged (...)``), naming what
    the data directory holds and the command that rebuilds the store."""
    found = evidence(layout) if found is None else found
    return StoreError(f"{layout.database} {why}, but the data directory holds {found.describe() or 'other files'}; "
                      f"the daemon will not start on it (that would lose them): run "
                      f"edgerev daemon rebuild --config {config_path or 'CONFIG'}"
                      + (" --move-aside" if why != "is missing" else ""))


#: SQLite's result codes for a damaged file (SQLITE_CORRUPT, SQLITE_NOTADB)
_DAMAGED_CODES = frozenset({11, 26})


def damage(e: BaseException) -> str | None:
    """``is damaged (...)`` when ``e``, raised by a query of the store, says the file is damaged: SQLite's own
    corruption codes, or a text value that is not UTF-8 (Python's sqlite3 cannot decode it: a flipped byte in a
    row, which the start's quick check does not read); else None (a busy database, a storage fault, a bug)."""
    if not isinstance(e, sqlite3.DatabaseError):
        return None
    if "could not decode" in str(e).lower():
        return "is damaged (a text value that is not UTF-8)"
    if getattr(e, "sqlite_errorcode", None) in _DAMAGED_CODES:
        return f"is damaged ({one_line(e)})"
    return None


def replay(store: Store, blobs: BlobStore, contents: JournalContents | None = None) -> int:
    """Record journal samples the store lacks whose blob exists, and journal labels that stored samples
    still lack (a crash between the journal's fsync and the commit); returns how many samples changed."""
    contents = contents if contents is not None else store.journal.read()
    known = store.blob_hashes()
    todo = [r for r in contents.samples().values() if r.sha256 not in known and blobs.exists(r.sha256)]
    added = store.restore_samples(todo) if todo else 0
    unlabeled = set(store.unlabeled_hashes())
    labels = [r for sha, r in contents.labelings().items() if sha in unlabeled]
    return added + (store.restore_labels(labels) if labels else 0)


@dataclass
class RebuildReport:
    samples: int = 0
    labels: list[str] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    without_blob: int = 0           # journal records whose blob is gone (not recorded)
    unlabeled_blobs: int = 0        # blobs no journal record names (kept on disk, not recorded)
    bad_lines: list[int] = field(default_factory=list)
    torn_tail: bool = False
    moved_aside: list[str] = field(default_factory=list)
    salvaged: dict[str, int] = field(default_factory=dict)  # rows of the old store's history copied, per table
    lost_history: str | None = None  # why the old store's history could not be read (None: nothing to read)
    removed: dict[str, int] = field(default_factory=dict)   # samples removed by the retention policy, by reason

    def to_json(self) -> dict:
        return {"samples": self.samples, "labels": self.labels, "versions": self.versions,
                "without_blob": self.without_blob, "unlabeled_blobs": self.unlabeled_blobs,
                "bad_lines": self.bad_lines, "torn_tail": self.torn_tail, "moved_aside": self.moved_aside,
                "salvaged": self.salvaged, "lost_history": self.lost_history, "removed": self.removed}


_STORE_FILES = ("", "-wal", "-shm", "-journal")


def _move_aside(database: Path, stamp: str) -> list[str]:
    """Rename the store and its companion files to ``store.sqlite.damaged-STAMP*`` (nothing deleted)."""
    moved = []
    for suffix in _STORE_FILES:
        src = database.with_name(database.name + suffix)
        if src.exists() or src.is_symlink():
            dst = database.with_name(f"{database.name}.damaged-{stamp}{suffix}")
            os.rename(src, dst)
            moved.append(dst.name)
    fsync_dir(database.parent)
    return moved


def rebuild(config: DaemonConfig, move_aside: bool = False, clock: Callable[[], float] = time.time) -> RebuildReport:
    """Recreate the store from the journal, the blobs and the version directories (hold the lock).

    Args:
        move_aside: an existing store (damaged, or missing rows) is renamed to
            ``store.sqlite.damaged-<time>`` first; without it, an existing store is refused.

    Raises:
        StoreError: a store exists and ``move_aside`` was not given; or there is no journal to rebuild from.
    """
    layout = config.layout
    database = layout.database
    present = [database.name + s for s in _STORE_FILES if database.with_name(database.name + s).exists()]
    if present and not move_aside:
        why = store_state(database) or "exists"
        raise StoreError(f"{database} {why}: rebuild replaces it only with --move-aside "
                         "(it is renamed to store.sqlite.damaged-<time>, never deleted)")
    journal = Journal(layout.journal)
    if not journal.exists():
        raise StoreError(f"{journal.path} is missing: the labels of the blobs are not recorded anywhere else, "
                         "so the store cannot be rebuilt")
    contents = journal.read()
    report = RebuildReport(bad_lines=contents.bad_lines, torn_tail=contents.torn_tail)
    blobs = BlobStore(layout.blobs)
    tmp = database.with_name(f".{database.name}.rebuild-{os.getpid()}")
    for suffix in _STORE_FILES:
        tmp.with_name(tmp.name + suffix).unlink(missing_ok=True)
    samples = contents.samples()
    with Store(tmp, clock=clock) as store:
        store.check_image_size(contents.image_size or config.image_size)
        todo = [r for r in samples.values() if blobs.exists(r.sha256)]
        report.without_blob = len(samples) - len(todo)
        report.samples = store.restore_samples(todo)
        report.labels = store.labels()
        report.removed = contents.removal_counts()
        if report.removed:
            store.restore_removal_counts(report.removed)
        if present:
            report.salvaged, report.lost_history = _salvage(database, store)
        else:
            report.lost_history = f"{database.name} is missing"
        report.versions = _restore_versions(store, Registry(layout.root), job_history=bool(report.salvaged.get("jobs")))
        store.checkpoint()
    report.unlabeled_blobs = sum(1 for key, _ in blobs.scan() if key is not None and key not in samples)
    if present:
        report.moved_aside = _move_aside(database, time.strftime("%Y%m%dT%H%M%S", time.gmtime(clock())))
    os.rename(tmp, database)
    fsync_dir(database.parent)
    log.info("rebuilt %s: %d samples, %d labels, versions %s", database, report.samples, len(report.labels),
             ", ".join(report.versions) or "none")
    return report


def _salvage(database: Path, store: Store) -> tuple[dict[str, int], str | None]:
    """Copy the job history, versions and events of the store being replaced, read-only, as far as it can
    be read; returns the rows copied per table and, when it could not be opened, why."""
    if not database.is_file() or database.stat().st_size == 0:
        return {}, f"{database.name} {store_state(database, thorough=False) or 'is empty'}"
    try:
        old = sqlite3.connect(f"{database.resolve().as_uri()}?mode=ro", uri=True, timeout=10.0)
    except sqlite3.Error as e:
        return {}, f"{database.name} cannot be opened ({e})"
    try:
        copied = store.salvage_history(old)
    except sqlite3.Error as e:
        return {}, f"{database.name} cannot be read ({e})"
    finally:
        old.close()
    missing = [t for t in Store.HISTORY_TABLES if t not in copied]
    return copied, (f"{', '.join(missing)} of {database.name} could not be read" if missing else None)


def _restore_versions(store: Store, registry: Registry, job_history: bool = False) -> list[str]:
    """A row per complete version directory, promoted (only promoted versions are written to disk), with
    its ``metrics.json``; a finished job stands for the last one's data, so the schedule counts only
    samples that arrived after it as new (unless the old store's job history was salvaged)."""
    names = registry.versions()
    last_batch = 0
    for name in names:
        folder = registry.path(name)
        try:
            metrics = json.loads((folder / "metrics.json").read_text())
        except (OSError, ValueError):
            metrics = {}
        metrics = metrics if isinstance(metrics, dict) else {}
        store.restore_version(name, created_at=folder.stat().st_mtime, metrics=metrics,
                              reason=f"rebuilt from versions/{name}")
        last_batch = max(last_batch, int(metrics.get("data_batch_id", 0) or 0))
    if names and not job_history:
        store.restore_done_job(f"rebuilt: the data of {names[-1]}", last_batch)
    try:
        current = registry.current()
    except Exception:  # a damaged link is repaired at the next start, from this record
        current = None
    store.set_in_service(current or (names[-1] if names else None))
    return names

