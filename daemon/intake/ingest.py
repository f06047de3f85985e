"""Ingest: inbox files to stored samples, in batches, safe against a crash at any instant.

For each batch of at most ``ingest.batch_files`` files (see :mod:`edgerev_daemon.intake.inbox` for what a
scan finds):

1. Examine each file: a symbolic link or anything but a regular file (a FIFO, a socket, a device), a
   label that is not a valid name, an extension not allowed, an empty file or one above
   ``limits.max_file_size`` is quarantined at once; otherwise its bytes are read and hashed (SHA-256).
   Every file is reached from the inbox's descriptor, folder by folder, without following a link
   (:mod:`edgerev_daemon.intake.confined`): a folder swapped for a link at any instant makes the file vanish
   for this batch, never reach outside the inbox.
2. A hash already stored (or seen earlier in the batch) is a *duplicate*: not stored again, recorded
   as a duplicate event, removed from the inbox in step 6. When the stored copy came from the same
   inbox path, or this path's duplicate event is already recorded, the file is a *leftover* of a
   crash between steps 5 and 6: removed, no second event. The one exception: a file with a label
   whose image is stored *unlabelled* (or waits unlabelled earlier in the batch) *labels* it (step 5
   journals the label and records a ``labeled`` event) instead of being a duplicate; it is not stored
   twice, and after a crash between steps 5 and 6 its recorded label event makes it a leftover.
3. The rest are validated and normalized (:mod:`edgerev_daemon.intake.images`); a decompression bomb or a
   file that does not decode is quarantined.
4. Each normalized image is written as blob ``blobs/<hash>`` (temporary file, rename); then the
   batch's blobs are made durable at once (:meth:`~edgerev_daemon.storage.blobs.BlobStore.sync`).
5. One transaction records the batch, its samples (an image from ``inbox/unlabeled/`` or a manifest
   line without a label is stored unlabelled), new labels, the labels given to stored unlabelled
   samples and the batch's events; the commit is durable when it returns (``synchronous=FULL``).
6. Only then are the batch's stored, duplicate and leftover files deleted from the inbox (each only
   if it is still the very file that was read: same device, inode, size and modification time,
   looked up in the folder reached again by descriptor).

Why a crash (``kill -9``, power cut) at any instant loses no file and records none twice:

- Before the commit of step 5, nothing is recorded and no inbox file of the batch was deleted: the
  next scan finds every file again. Blobs written in step 4 are rewritten with the same bytes (the
  key is the hash of the file, the normalization is deterministic); a blob whose file has since
  vanished from the inbox is an orphan, harmless, reported and removable by the consistency check.
- The commit is atomic: all the batch's rows or none.
- After the commit, a file not yet deleted is found again by the next scan; its hash is stored, from
  the same path, so step 2 deletes it as a leftover. The sample is recorded exactly once (its hash is
  the primary key), and never points at a missing or torn blob (step 4's sync comes first).
- A quarantined file is moved (one rename) before its event is committed: a crash between the two
  leaves it safe in ``quarantine/`` (or hidden in the inbox, across file systems) with its reason
  file, and only the event row missing. It is never copied (see :mod:`edgerev_daemon.intake.quarantine`).
- A manifest is deleted only after every file it listed was stored, found a duplicate, gave a label
  or was quarantined; re-read after a crash, its entries whose files are gone are recognized (stored,
  labelling, or quarantined with an event or a reason file, from that path) and skipped.
- A manifest an ingest leaves with lines to handle (a stop, the storage budget, a file it could not remove)
  is remembered in the store with its identity, after the last commit. Read again unchanged, none of its
  lines is refused again: those refused were recorded when it was first read, and a file gone since was
  handled (the retention policy may have removed its sample since, which the store alone could no longer
  tell). A crash before the store remembers it leaves the rule above.

The storage budget is checked before every file (:mod:`edgerev_daemon.intake.budget`): once the data directory
passes ``storage.target`` of ``storage.max_bytes``, the files examined so far are committed as a shorter batch
and ingest ends; the files not yet examined wait in the inbox for the next cycle, as after a stop.

No file can stop the batch: whatever its name (recorded in the escaped form of
:mod:`edgerev_daemon.intake.names`), type or content, it ends stored, a duplicate, quarantined, refused (a
manifest line) or, when it cannot be moved or removed, *stuck* (reported, retried next scan); the
rest of the batch goes on.

Errors that are not the file's fault (disk full while writing a blob, the database unwritable)
propagate: the batch is abandoned as if the process had crashed, and the files wait in the inbox.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.intake import confined
from edgerev_daemon.intake.budget import IngestBudget
from edgerev_daemon.intake.confined import Identity, NotConfined
from edgerev_daemon.intake.images import ImageRejected, normalize
from edgerev_daemon.intake.inbox import Candidate, Scan, scan_inbox, valid_label
from edgerev_daemon.intake.names import shown
from edgerev_daemon.intake.quarantine import quarantine, quarantined_from
from edgerev_daemon.intake.watch import InboxWatch
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.records import LABEL_RULE, EventKind, NewLabel, NewSample, Sample
from edgerev_daemon.storage.store import Store, split_of
from edgerev_daemon.storage.usage import DiskUsage

log = logging.getLogger(__name__)


@dataclass
class IngestReport:
    """What one :func:`ingest_inbox` call did; ``accepted`` counts the samples stored (``unlabeled`` of them
    without a label); ``labeled``: stored unlabelled samples that got their label from a file; ``quarantined``,
    ``refused`` and ``stuck`` hold ``(inbox path, reason)`` pairs; ``problems``: folders newly found
    unreadable, ``(folder, reason)``; ``stopped``: the call ended early, files wait for the next; ``budget``: why
    it ended at the storage budget (:mod:`edgerev_daemon.intake.budget`), files wait for the next, or None."""

    accepted: int = 0
    unlabeled: int = 0
    labeled: int = 0
    duplicates: int = 0
    leftovers: int = 0
    quarantined: list[tuple[str, str]] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)
    stuck: list[tuple[str, str]] = field(default_factory=list)  # could not be moved or deleted: retried later
    problems: list[tuple[str, str]] = field(default_factory=list)
    unsettled: int = 0
    batches: int = 0
    stopped: bool = False
    budget: str | None = None
    seconds: float = 0.0

    @property
    def images_per_second(self) -> float:
        return self.accepted / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict:
        return {"accepted": self.accepted, "unlabeled": self.unlabeled, "labeled": self.labeled,
                "duplicates": self.duplicates, "leftovers": self.leftovers,
                "quarantined": [list(q) for q in self.quarantined], "refused": [list(r) for r in self.refused],
                "stuck": [list(s) for s in self.stuck], "problems": [list(p) for p in self.problems],
                "unsettled": self.unsettled, "batches": self.batches, "stopped": self.stopped,
                "budget": self.budget, "seconds": round(self.seconds, 4)}


@dataclass(frozen=True)
class _Read:
    """A file read to the end: its bytes, hash, and the identity it had when read."""

    data: bytes
    sha256: str
    identity: Identity


class _Batch:
    """One transaction's worth of outcomes."""

    def __init__(self) -> None:
        self.samples: list[NewSample] = []
        self.labels: list[NewLabel] = []
        self.events: list[tuple[EventKind, dict]] = []
        self.remove: list[tuple[Candidate, Identity]] = []
        self.seen: dict[str, Candidate | Sample] = {}
        self.duplicates = self.quarantined = self.refused = 0


class _Changed(Exception):
    """The entry under a candidate's name is not the one the scan saw, or a folder on its way was
    swapped for a link: left for the next scan, which judges what is there then."""


def _changed(c: Candidate, st: os.stat_result) -> bool:
    """Whether the entry under ``c``'s name is no longer the one the scan saw (swapped since)."""
    return c.inode is not None and (st.st_dev, st.st_ino) != c.inode


def _read(root_fd: int, c: Candidate, max_bytes: int) -> _Read:
    """Read a regular file without following a link, from the folder reached by descriptor; raises
    :class:`ImageRejected` for a file that may not be read, ``FileNotFoundError`` for one that
    vanished, :class:`_Changed` when its folder was swapped for a link or its name now holds
    another file."""
    try:
        with confined.parent(root_fd, c.parts) as dir_fd:
            try:
                fd = confined.open_file(dir_fd, c.name)
            except NotConfined as e:  # the file itself is a link, or not a regular file
                raise ImageRejected("symbolic link (not followed)" if e.errno == errno.ELOOP
                                    else "not a regular file") from None
    except NotConfined:  # a folder on its way was swapped for a link: the file is no longer in the inbox
        raise _Changed(f"{c.source}: a folder on its way is not a folder") from None
    except FileNotFoundError:
        raise
    except OSError as e:
        raise ImageRejected(f"cannot read: {e.strerror or e}") from None
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if _changed(c, st):
            raise _Changed(f"{c.source} was replaced since the scan")
        if st.st_size == 0:
            raise ImageRejected("empty file (0 bytes)")
        if st.st_size > max_bytes:
            raise ImageRejected(f"{st.st_size} bytes, above limits.max_file_size ({max_bytes})")
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise ImageRejected(f"grew above limits.max_file_size ({max_bytes}) while read")
    return _Read(data, hashlib.sha256(data).hexdigest(), confined.identity(st))


def _precheck(root_fd: int, c: Candidate, extensions: tuple[str, ...]) -> str | None:
    """Why ``c`` is refused before it is opened, or ``None``.

    Raises:
        FileNotFoundError: it vanished.
        _Changed: something else took its name since the scan: what is judged is always what is
            then read or moved.
    """
    try:
        with confined.parent(root_fd, c.parts) as dir_fd:
            st = confined.lstat(dir_fd, c.name)
    except NotConfined:
        raise _Changed(f"{c.source}: a folder on its way is not a folder") from None
    if _changed(c, st):
        raise _Changed(f"{c.source} was replaced since the scan")
    if stat.S_ISLNK(st.st_mode):
        return "symbolic link (not followed)"
    if not stat.S_ISREG(st.st_mode):
        return "not a regular file"
    if c.label is None and not c.unlabeled:
        return "not in a label folder: drop images into inbox/<label>/ (or inbox/unlabeled/ without a label)"
    if c.label is not None and not valid_label(c.label):
        return f"label '{shown(c.label)}' is not a valid name ({LABEL_RULE})"
    suffix = os.path.splitext(c.name)[1].lower()
    if suffix not in extensions:
        return f"extension '{shown(suffix) or '(none)'}' not allowed (limits.extensions: {', '.join(extensions)})"
    return None


class _Ingest:
    def __init__(self, config: DaemonConfig, store: Store, clock: Callable[[], float], root_fd: int,
                 budget: IngestBudget) -> None:
        self.config, self.store, self.clock, self.root_fd, self.budget = config, store, clock, root_fd, budget
        self.layout = config.layout
        self.blobs = BlobStore(self.layout.blobs)
        self.max_bytes = config.limits.max_file_size
        self.report = IngestReport()

    def _quarantine(self, batch: _Batch, c: Candidate, reason: str) -> bool:
        try:
            dst = quarantine(self.root_fd, c.parts, self.layout.quarantine, reason, c.source, self.clock(), c.inode)
        except FileNotFoundError:
            return True  # vanished before it could be moved: nothing left to handle
        except OSError as e:
            log.warning("cannot quarantine %s (%s): %s", c.source, reason, e.strerror or e)
            self.report.stuck.append((c.source, f"{reason}; could not be moved: {e.strerror or e}"))
            return False
        self.budget.quarantined(dst)
        log.warning("quarantined %s: %s", c.source, reason)
        batch.events.append((EventKind.QUARANTINE, {"source": c.source, "reason": reason, "moved_to": dst}))
        batch.quarantined += 1
        self.report.quarantined.append((c.source, reason))
        return True

    def _leftover(self, first: Candidate | Sample, c: Candidate, sha256: str) -> bool:
        """Whether ``c`` is a file an earlier batch recorded (as a sample or a duplicate) but a crash
        kept from being removed."""
        if isinstance(first, Candidate):  # seen earlier in this very batch: a true duplicate
            return False
        return first.source == c.source or self.store.duplicate_recorded(sha256, c.source)

    def examine(self, batch: _Batch, c: Candidate) -> bool:
        """Handle one file up to the commit; ``False`` when it is left in the inbox unresolved."""
        try:
            why = _precheck(self.root_fd, c, self.config.limits.extensions)
            if why is not None:
                return self._quarantine(batch, c, why)
            got = _read(self.root_fd, c, self.max_bytes)
        except FileNotFoundError:
            return True
        except _Changed as e:
            log.info("%s; left for the next scan", e)
            return False
        except ImageRejected as e:
            return self._quarantine(batch, c, e.reason)
        first = batch.seen.get(got.sha256) or self.store.get_sample(got.sha256)
        if first is not None and first.label is None and c.label is not None:
            self._label(batch, first, c, got)
            return True
        if first is not None:
            if self._leftover(first, c, got.sha256):
                self.report.leftovers += 1
            else:
                batch.duplicates += 1
                self.report.duplicates += 1
                batch.events.append((EventKind.DUPLICATE, {
                    "source": c.source, "sha256": got.sha256, "existing": first.source, "label": c.label,
                    "existing_label": first.label,
                    "label_conflict": c.label is not None and c.label != first.label}))
            batch.remove.append((c, got.identity))
            return True
        try:
            img = normalize(got.data, self.config.image_size, self.config.limits.max_pixels)
        except ImageRejected as e:
            return self._quarantine(batch, c, e.reason)
        self.budget.wrote_blob(self.blobs.write(got.sha256, img.png))
        batch.samples.append(NewSample(got.sha256, c.label, img.width, img.height,
                                       hashlib.sha256(img.png).hexdigest(), c.source))
        batch.seen[got.sha256] = c
        batch.remove.append((c, got.identity))
        return True

    def _label(self, batch: _Batch, first: Candidate | Sample, c: Candidate, got: _Read) -> None:
        """``c``, a file with a label, is the image of an unlabelled sample: stored (``first`` a
        :class:`Sample`) or waiting earlier in this batch (a :class:`Candidate`, whose new sample takes the
        label before it is recorded). Not stored twice; its removal waits for the commit like any file's."""
        if isinstance(first, Candidate):
            i = next(i for i, s in enumerate(batch.samples) if s.sha256 == got.sha256)
            batch.samples[i] = replace(batch.samples[i], label=c.label)
            split = split_of(got.sha256, self.config.heldout_fraction).value
            batch.events.append((EventKind.LABELED, {"sha256": got.sha256, "label": c.label, "split": split,
                                                     "source": c.source, "sample_source": first.source}))
        else:
            batch.labels.append(NewLabel(got.sha256, c.label, c.source))
        batch.seen[got.sha256] = replace(first, label=c.label)  # a later copy in the batch is a duplicate of it
        log.info("%s labels the unlabelled image %s: %s", c.source, shown(first.source), c.label)
        batch.remove.append((c, got.identity))

    def _remove(self, source: str, parts: tuple[str, ...], ident: Identity, what: str) -> None:
        try:
            if not confined.remove_if_same(self.root_fd, parts, ident):
                log.info("%s changed or moved while it was ingested; it stays for the next scan", source)
        except OSError as e:
            self.report.stuck.append((source, f"{what}, but could not be removed: {e.strerror or e}"))

    def commit(self, batch: _Batch) -> None:
        if batch.samples or batch.events or batch.labels:  # a batch of leftovers only has nothing to record
            self.blobs.sync()
            self.store.record_batch(batch.samples, batch.events, self.config.heldout_fraction,
                                    duplicates=batch.duplicates, quarantined=batch.quarantined, refused=batch.refused,
                                    labels=batch.labels)
            self.report.batches += 1
            self.report.accepted += len(batch.samples)
            self.report.unlabeled += sum(1 for s in batch.samples if s.label is None)
            self.report.labeled += len(batch.labels) + sum(1 for k, _ in batch.events if k is EventKind.LABELED)
        self.budget.committed()
        for c, ident in batch.remove:
            self._remove(c.source, c.parts, ident, "stored")

    def problems(self, batch: _Batch, found: dict[str, str], cleared: list[str]) -> None:
        """Record folders newly found unreadable (an error event each) and those fine again."""
        for folder, reason in found.items():
            log.warning("inbox folder %s skipped: %s", folder, reason)
            batch.events.append((EventKind.ERROR, {"where": "inbox", "folder": folder, "error": reason}))
            self.report.problems.append((folder, reason))
        for folder in cleared:
            log.info("inbox folder %s is readable again", folder)
            batch.events.append((EventKind.INFO, {"where": "inbox", "folder": folder,
                                                  "message": f"inbox folder {folder} is readable again"}))

    def run(self, scan: Scan, problems: tuple[dict[str, str], list[str]], stop: Callable[[], bool],
            read: dict[str, tuple[int, ...]]) -> None:
        """Ingest everything the scan found, or stop between two files when ``stop()`` says so or the storage
        budget is reached; then remember the manifests left with lines to handle (``read``: those remembered)."""
        left = self._run(scan, problems, stop)
        for name in left:
            identity = tuple(scan.manifests[name][1])
            if read.get(name) != identity:
                self.store.set_manifest_read(name, identity)
        for name in read.keys() - left.keys():  # done (removed), or no longer in the inbox
            self.store.set_manifest_read(name, None)

    def _run(self, scan: Scan, problems: tuple[dict[str, str], list[str]], stop: Callable[[], bool]) -> dict[str, int]:
        """:meth:`run` up to the last commit; returns the manifests left open, with how many of their files wait."""
        size = self.config.ingest.batch_files
        batch = _Batch()
        self.problems(batch, *problems)
        for r in scan.refusals:
            where = f"{r.manifest}:{r.line}"
            log.warning("refused %s (%s): %s", where, r.path, r.reason)
            batch.events.append((EventKind.REFUSED, {"manifest": r.manifest, "line": r.line, "path": r.path,
                                                     "reason": r.reason}))
            batch.refused += 1
            self.report.refused.append((where, r.reason))
        for c, reason in scan.bad_manifests:
            self._quarantine(batch, c, reason)
        open_manifests = {name: 0 for name in scan.manifests}
        for c in scan.candidates:
            if c.manifest is not None:
                open_manifests[c.manifest] += 1
        pending: list[Candidate] = []
        for i, c in enumerate(scan.candidates):
            if i and i % size == 0:
                self._finish(batch, pending, open_manifests, scan)
                batch, pending = _Batch(), []
            # asked before every file, not every batch: a batch of large images (max_pixels each) takes
            # minutes to decode; a stop commits the files examined so far as a shorter batch
            if i and stop():
                self._finish(batch, pending, open_manifests, scan)
                self.report.stopped = True
                return open_manifests
            if self.budget.full():  # what the batch holds is committed, then counted: still full, the rest waits
                self._finish(batch, pending, open_manifests, scan)
                batch, pending = _Batch(), []
                if self.budget.full():
                    self.report.budget = self.budget.why(len(scan.candidates) - i)
                    log.info("ingest stopped at the storage budget: %s", self.report.budget)
                    return open_manifests
            self.budget.examined()
            if self.examine(batch, c):
                pending.append(c)
        self._finish(batch, pending, open_manifests, scan)
        return open_manifests

    def _finish(self, batch: _Batch, handled: list[Candidate], open_manifests: dict[str, int], scan: Scan) -> None:
        self.commit(batch)
        for c in handled:
            if c.manifest is not None:
                open_manifests[c.manifest] -= 1
        for name in [n for n, left in open_manifests.items() if left == 0]:
            parts, ident = scan.manifests[name]
            self._remove(name, parts, ident, "manifest done")
            del open_manifests[name]


def ingest_inbox(config: DaemonConfig, store: Store, clock: Callable[[], float] = time.time,
                 stop: Callable[[], bool] = lambda: False, watch: InboxWatch | None = None,
                 wait: Callable[[float], object] | None = None, usage: DiskUsage | None = None) -> IngestReport:
    """Ingest what waits in the inbox (the caller holds the data directory's lock).

    Args:
        clock: the current time (for settling and the recorded times).
        stop: asked between files; ``True`` commits the files examined and ends the call early (the rest
            waits for the next).
        watch: what earlier scans of this process saw (settling, folders already reported); a
            long-running caller keeps one. ``None``: a fresh one, for this call only.
        wait: sleeps for the given seconds. When the watch has seen no scan yet and files are not
            settled, the inbox is scanned once more after ``wait(settle_seconds)``, so that one call
            (``edgerev daemon once``) still ingests files that are complete.
        usage: measures the data directory once at the start, for the storage budget (the daemon's, its blob
            folders' sums cached); None: a fresh one when ``storage.max_bytes`` is set.

    Raises:
        StoreError: the store holds images of another size than ``config.image_size``, or a class named like
            the folder of unlabelled images (:meth:`~edgerev_daemon.storage.store.Store.check_labels`).
        OSError: the data directory cannot be written (disk full), or the inbox cannot be opened:
            the current batch is abandoned.
    """
    started = time.perf_counter()
    store.check_image_size(config.image_size)
    store.check_labels()

    def seen(source: str) -> bool:
        return (store.has_source(source) or store.labeled_from(source) or store.quarantined_source(source)
                or quarantined_from(config.layout.quarantine, source))

    read = store.manifests_read()

    def read_before(source: str, identity: tuple[int, ...]) -> bool:
        return read.get(source) == tuple(identity)

    watch = watch if watch is not None else InboxWatch()
    fresh = watch.scans == 0
    settle = config.ingest.settle_seconds
    root_fd = confined.open_root(config.inbox_path)
    try:
        scan = scan_inbox(root_fd, clock(), settle, config.limits.max_file_size, seen, watch, read_before)
        if scan.unsettled and fresh and wait is not None and settle > 0:
            wait(settle)
            scan = scan_inbox(root_fd, clock(), settle, config.limits.max_file_size, seen, watch, read_before)
        job = _Ingest(config, store, clock, root_fd, IngestBudget(config, usage))
        job.report.unsettled = scan.unsettled
        job.run(scan, watch.problems(scan.problems), stop, read)
    finally:
        os.close(root_fd)
    job.report.seconds = time.perf_counter() - started
    r = job.report
    if r.accepted or r.labeled or r.duplicates or r.quarantined or r.refused or r.leftovers:
        log.info("ingest: %d stored (%d unlabelled), %d labelled, %d duplicates, %d quarantined, %d refused, "
                 "%d leftovers in %.2fs", r.accepted, r.unlabeled, r.labeled, r.duplicates, len(r.quarantined),
                 len(r.refused), r.leftovers, r.seconds)
    return r
