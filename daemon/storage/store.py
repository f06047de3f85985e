"""The daemon's SQLite store: samples, labels, ingest batches, jobs, model versions and events.

Connection settings, and why:

- ``journal_mode=WAL``: readers (``status``, the HTTP page) never block the writer, nor it them.
- ``synchronous=FULL``: the write-ahead log is fsynced at every commit. Ingest deletes a file from
  the inbox right after the commit that records it; with ``NORMAL`` a power cut could lose that
  commit while the deletion survives, losing the image. One fsync per batch of files costs little.
- ``busy_timeout``: a second connection (a ``status`` command) waits instead of failing at once.
- ``foreign_keys=ON``: a sample cannot name a label or batch that does not exist.
- Autocommit mode (``isolation_level=None``) and explicit ``BEGIN IMMEDIATE`` transactions that roll
  back on any exception (:meth:`Store.transaction`): the write lock is taken at the start of a
  transaction, so it never fails halfway with ``SQLITE_BUSY`` on upgrade.

Every sample recorded is also appended to the journal beside the database (:mod:`edgerev_daemon.storage.journal`),
inside the transaction and before its ``COMMIT``: the store can be rebuilt from the journal and the blobs.

Unlabelled samples are samples like the others (one blob, one row, one journal record, the same dedupe by
hash and the same budget) with no label and no split: :meth:`Store.unlabeled_samples` lists them, and every
reading by split (training, the held-out evaluation, the gate) leaves them out. A label given later
(:meth:`Store.label_sample`, or the same image dropped again with a label, through :meth:`Store.record_batch`)
turns one into a labelled sample in place: its split is then decided by :func:`split_of`, and it counts as
data of the batch that labelled it, so the schedule and the next job see it as new.

Times are given by an injected ``clock`` (seconds since the epoch) so tests drive them. The order in
which samples arrived is the ingest batch id (monotonic), never a time: a device without a real-time
clock may jump back.
"""

from __future__ import annotations

import json
import sqlite3
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

from edgerev.errors import one_line
from edgerev_daemon.errors import StoreError
from edgerev_daemon.storage.journal import NAME as JOURNAL_NAME
from edgerev_daemon.storage.journal import Journal, JournalRecord, Labeling, Removal
from edgerev_daemon.storage.records import (
    JOB_TRANSITIONS,
    UNLABELED,
    Event,
    EventKind,
    Job,
    JobState,
    NewLabel,
    NewSample,
    Sample,
    Split,
    Version,
    dumps,
    label_problem,
)
from edgerev_daemon.storage.schema import migrate


def split_of(sha256: str, heldout_fraction: float) -> Split:
    """The split of a sample, a pure function of its hash: the first 4 bytes as an integer, modulo
    1000, against the held-out share in thousandths.

    The split is computed once, at ingest (for an unlabelled sample: when it gets its label), and stored:
    changing ``heldout_fraction`` later applies to new samples only, so no sample a model trained on ever
    moves into the held-out set.
    """
    return Split.HELDOUT if int(sha256[:8], 16) % 1000 < round(heldout_fraction * 1000) else Split.TRAIN


class Store:
    """One connection to ``store.sqlite``, migrated to the latest schema when opened.

    Args:
        path: the database file (created if missing).
        clock: seconds since the epoch, for the ``*_at`` columns.
        busy_timeout: seconds to wait for another connection's write lock.
    """

    def __init__(self, path: str | Path, clock: Callable[[], float] = time.time, busy_timeout: float = 10.0) -> None:
        self.path = Path(path)
        self.clock = clock
        self.journal = Journal(self.path.with_name(JOURNAL_NAME))
        self._conn = sqlite3.connect(self.path, timeout=busy_timeout, isolation_level=None)
        try:
            self._conn.execute(f"PRAGMA busy_timeout = {int(busy_timeout * 1000)}")
            mode = self._conn.execute("PRAGMA journal_mode = WAL").fetchone()[0]
            if mode.lower() != "wal":
                raise StoreError(f"{self.path}: SQLite refused write-ahead logging (journal mode {mode})")
            self._conn.execute("PRAGMA synchronous = FULL")
            self._conn.execute("PRAGMA foreign_keys = ON")
            migrate(self._conn, clock(), str(self.path))
        except sqlite3.DatabaseError as e:
            self._conn.close()
            raise StoreError(f"cannot open the store {self.path}: {one_line(e)}") from e  # the cause tells a full disk
        except BaseException:
            self._conn.close()
            raise

    @classmethod
    def snapshot(cls, path: str | Path) -> Store:
        """A read-only view of the database file alone (``immutable``: no lock, no shared memory, the
        write-ahead log ignored), for ``status`` when a full disk keeps SQLite from opening the store
        normally. It shows the last checkpointed state; nothing is migrated or written."""
        self = cls.__new__(cls)
        self.path, self.clock = Path(path), time.time
        self.journal = Journal(self.path.with_name(JOURNAL_NAME))
        self._conn = sqlite3.connect(f"{self.path.resolve().as_uri()}?immutable=1", uri=True, isolation_level=None)
        return self

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """``BEGIN IMMEDIATE`` ... ``COMMIT``, or ``ROLLBACK`` and re-raise on any exception."""
        if self._conn.in_transaction:
            raise RuntimeError("transactions do not nest")
        self._conn.execute("BEGIN IMMEDIATE")
        try:
            yield self._conn
            self._conn.execute("COMMIT")
        except BaseException:
            if self._conn.in_transaction:  # a failed COMMIT (disk full) leaves it open too
                self._conn.execute("ROLLBACK")
            raise

    def _one(self, sql: str, args: Sequence = ()) -> tuple | None:
        return self._conn.execute(sql, args).fetchone()

    # settings ---------------------------------------------------------------------------------------

    def check_image_size(self, size: int) -> None:
        """Record the normalization size on first use; refuse another size later.

        Raises:
            StoreError: the stored images were normalized to another size.
        """
        with self.transaction() as c:
            row = c.execute("SELECT value FROM meta WHERE key = 'image_size'").fetchone()
            if row is None:
                c.execute("INSERT INTO meta (key, value) VALUES ('image_size', ?)", (str(size),))
            elif int(row[0]) != size:
                raise StoreError(f"{self.path}: the stored images are {row[0]}x{row[0]}, the config asks for "
                                 f"image_size {size}; keep {row[0]} or start a new data directory")

    def check_labels(self) -> None:
        """Refuse a store that holds a class named like the folder of unlabelled images (made by an edgerev
        before unlabelled images existed, when ``inbox/unlabeled/`` was a label folder like any other).

        Such a store is not migrated: its samples may be a real class a model in service was trained on, or
        images the owner meant as unlabelled, and only the owner knows which.

        Raises:
            StoreError: samples carry such a label (how many, and the ways out).
        """
        marks = ", ".join("?" * len(UNLABELED))
        rows = self._conn.execute("SELECT l.name, COUNT(s.sha256) FROM labels l LEFT JOIN samples s "
                                  f"ON s.label_id = l.id WHERE l.name IN ({marks}) GROUP BY l.id", UNLABELED).fetchall()
        if rows:
            held = ", ".join(f"{n} under '{name}'" for name, n in rows)
            raise StoreError(f"{self.path} holds a class named like the folder of unlabelled images ({held}): "
                             f"inbox/{UNLABELED[0]}/ now holds images without a label, so this store is not "
                             "ingested into; keep the edgerev that made it, or start a new data directory and "
                             "drop those images again under inbox/<a label>/ (a class) or inbox/unlabeled/")

    # samples ----------------------------------------------------------------------------------------

    _SAMPLE = ("SELECT s.sha256, l.name, s.split, s.width, s.height, s.blob_sha256, s.source, s.added_at, s.batch_id "
               "FROM samples s LEFT JOIN labels l ON l.id = s.label_id")

    @staticmethod
    def _sample(row: tuple) -> Sample:
        return Sample(row[0], row[1], None if row[2] is None else Split(row[2]), *row[3:])

    def get_sample(self, sha256: str) -> Sample | None:
        row = self._one(self._SAMPLE + " WHERE s.sha256 = ?", (sha256,))
        return None if row is None else self._sample(row)

    def has_source(self, source: str) -> bool:
        """Whether a sample was stored from this inbox path (after a crash, to tell a file already
        recorded and removed from one that never existed)."""
        return self._one("SELECT 1 FROM samples WHERE source = ? LIMIT 1", (source,)) is not None

    def record_batch(self, samples: Sequence[NewSample], events: Sequence[tuple[EventKind, dict]],
                     heldout_fraction: float, duplicates: int = 0, quarantined: int = 0, refused: int = 0,
                     labels: Sequence[NewLabel] = ()) -> int:
        """Record one ingest batch in one transaction: its samples (new labels too; a sample without a label
        is stored unlabelled), the labels it gives stored unlabelled samples (``labels``: each journaled, its
        split decided, a ``labeled`` event) and its events.

        Returns:
            The batch id.

        Raises:
            sqlite3.IntegrityError: a sample is already stored (nothing of the batch is recorded).
            StoreError: a sample of ``labels`` is not a stored unlabelled one (nothing is recorded).
        """
        now = self.clock()
        with self.transaction() as c:
            batch = c.execute("INSERT INTO ingest_batches (at, accepted, duplicates, quarantined, refused, labeled) "
                              "VALUES (?, ?, ?, ?, ?, ?)",
                              (now, len(samples), duplicates, quarantined, refused, len(labels))).lastrowid
            records = [JournalRecord(batch, s.sha256, s.label,
                                     None if s.label is None else split_of(s.sha256, heldout_fraction).value,
                                     s.width, s.height, s.blob_sha256, s.source, now) for s in samples]
            labelings = [self._labeling(c, n.sha256, n.label, n.source, batch, heldout_fraction, now) for n in labels]
            self._journal(c, [*records, *labelings])
            label_ids = {label: self._label_id(c, label, now) for label in dict.fromkeys(r.label for r in records)}
            c.executemany(
                "INSERT INTO samples (sha256, label_id, split, width, height, blob_sha256, source, added_at, batch_id) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                [(r.sha256, label_ids[r.label], r.split, r.width, r.height, r.blob_sha256, r.source, now, batch)
                 for r in records])
            for labeling in labelings:
                self._apply_labeling(c, labeling)
            c.executemany("INSERT INTO events (at, kind, message) VALUES (?, ?, ?)",
                          [(now, EventKind(k).value, dumps(m)) for k, m in events])
        return batch

    @staticmethod
    def _label_id(c: sqlite3.Connection, label: str | None, now: float) -> int | None:
        """The id of ``label`` (added at ``now`` when new); ``None`` for no label."""
        if label is None:
            return None
        c.execute("INSERT OR IGNORE INTO labels (name, added_at) VALUES (?, ?)", (label, now))
        return c.execute("SELECT id FROM labels WHERE name = ?", (label,)).fetchone()[0]

    def _labeling(self, c: sqlite3.Connection, sha256: str, label: str, source: str, batch: int,
                  heldout_fraction: float, now: float) -> Labeling:
        """The journal line that gives the stored unlabelled sample ``sha256`` its label, as of ``batch``.

        Raises:
            StoreError: ``label`` cannot be a class, or the sample is not a stored unlabelled one.
        """
        why = label_problem(label)
        if why is not None:
            raise StoreError(why)
        row = c.execute("SELECT label_id FROM samples WHERE sha256 = ?", (sha256,)).fetchone()
        if row is None or row[0] is not None:
            raise StoreError(f"sample {sha256[:12]} is {'not stored' if row is None else 'already labelled'}")
        return Labeling(sha256, label, split_of(sha256, heldout_fraction).value, batch, source, now)

    def _apply_labeling(self, c: sqlite3.Connection, r: Labeling, replayed: bool = False) -> None:
        """Give the row its label, split and batch, and record a ``labeled`` event (call after journaling)."""
        label_id = self._label_id(c, r.label, r.at)
        source = c.execute("SELECT source FROM samples WHERE sha256 = ?", (r.labeled,)).fetchone()[0]
        c.execute("UPDATE samples SET label_id = ?, split = ?, batch_id = ? WHERE sha256 = ? AND label_id IS NULL",
                  (label_id, r.split, r.batch, r.labeled))
        message = {"sha256": r.labeled, "label": r.label, "split": r.split, "source": r.source,
                   "sample_source": source} | ({"replayed": "from the journal"} if replayed else {})
        self._event(c, EventKind.LABELED, message)

    def label_sample(self, ref: str, label: str, heldout_fraction: float, source: str = "answer") -> Sample:
        """Give a stored unlabelled sample its label (what ``edgerev daemon label --set SAMPLE=LABEL`` calls):
        in one transaction of its own, a batch that labels it, the journal line (fsynced before the commit,
        so ``rebuild`` reproduces it), the row's label and split (:func:`split_of` with ``heldout_fraction``)
        and a ``labeled`` event. The caller holds the data directory's lock.

        Args:
            ref: the sample's hash, or a prefix of it (at least :data:`MIN_PREFIX` hex digits) that only it has.
            source: what gave the label (recorded in the journal and the event).

        Returns:
            The sample, labelled. A sample that already carries this very label is returned unchanged.

        Raises:
            StoreError: the label cannot be a class; no sample (or more than one) matches ``ref``, with why
                (removed by the retention policy, never stored); the sample already carries another label.
        """
        why = label_problem(label)
        if why is not None:
            raise StoreError(why)
        sample = self.resolve_sample(ref)
        if sample.label == label:
            return sample
        if sample.label is not None:
            raise StoreError(f"sample {sample.sha256[:12]} is already labelled '{sample.label}'; a label is given "
                             "once (a model may have trained on it)")
        now = self.clock()
        with self.transaction() as c:
            batch = c.execute("INSERT INTO ingest_batches (at, accepted, duplicates, quarantined, refused, labeled) "
                              "VALUES (?, 0, 0, 0, 0, 1)", (now,)).lastrowid
            labeling = self._labeling(c, sample.sha256, label, source, batch, heldout_fraction, now)
            self._journal(c, [labeling])
            self._apply_labeling(c, labeling)
        return self.get_sample(sample.sha256)

    MIN_PREFIX = 6

    def resolve_sample(self, ref: str) -> Sample:
        """The stored sample ``ref`` names: its hash, or a prefix of it that no other sample has.

        Raises:
            StoreError: ``ref`` is not hexadecimal or too short; no sample has it (with why, where the journal
                still says: removed by the retention policy); more than one has it.
        """
        ref = ref.strip().lower()
        if not (self.MIN_PREFIX <= len(ref) <= 64) or any(ch not in "0123456789abcdef" for ch in ref):
            raise StoreError(f"'{ref}' names no sample: give its hash, or at least {self.MIN_PREFIX} of its first "
                             "hexadecimal digits")
        rows = self._conn.execute(self._SAMPLE + " WHERE s.sha256 >= ? AND s.sha256 < ? ORDER BY s.sha256 LIMIT 2",
                                  (ref, ref + "g")).fetchall()
        if len(rows) > 1:
            raise StoreError(f"'{ref}' is the start of more than one sample's hash ({rows[0][0][:12]}, "
                             f"{rows[1][0][:12]}, ...): give more digits")
        if not rows:
            raise StoreError(f"no sample {ref} in the store: {self._gone(ref)}")
        return self._sample(rows[0])

    def _gone(self, ref: str) -> str:
        """Why no stored sample's hash starts with ``ref``, as far as the journal still says."""
        last = None
        for r in self.journal.read().lines:
            if isinstance(r, Removal) and r.removed.startswith(ref):
                last = r
        if last is not None:
            return f"removed by the retention policy ({last.why}) at {last.at:.0f}"
        return "never stored, or removed before the journal's last compaction"

    def _journal(self, c: sqlite3.Connection, records: list) -> None:
        """Append ``records`` to the journal (inside the caller's transaction, before its commit). A data
        directory without a journal (written by an older edgerev, or the journal was deleted) gets one
        holding every sample already stored first, so the journal never knows less than the store."""
        if self.journal.exists():
            self.journal.append(records)
            return
        if not records and not c.execute("SELECT 1 FROM samples LIMIT 1").fetchone():
            return
        size = c.execute("SELECT value FROM meta WHERE key = 'image_size'").fetchone()
        self.journal.create(int(size[0]) if size else None, self._records(c) + records)

    def _records(self, c: sqlite3.Connection) -> list[JournalRecord]:
        rows = c.execute("SELECT s.batch_id, s.sha256, l.name, s.split, s.width, s.height, s.blob_sha256, s.source, "
                         "s.added_at FROM samples s LEFT JOIN labels l ON l.id = s.label_id "
                         "ORDER BY s.batch_id, s.rowid")
        return [JournalRecord(*r) for r in rows]

    def ensure_journal(self) -> bool:
        """Write the journal from the stored samples if it is missing; returns whether it was written."""
        if self.journal.exists():
            return False
        with self.transaction() as c:
            self._journal(c, [])
        return self.journal.exists()

    def restore_samples(self, records: Sequence[JournalRecord]) -> int:
        """Record samples from the journal that the store lacks, with their own batch ids, splits and
        times (labels are added in the order the records name them; an unlabelled record stays unlabelled);
        returns how many were added."""
        added = 0
        with self.transaction() as c:
            for r in records:
                if c.execute("SELECT 1 FROM samples WHERE sha256 = ?", (r.sha256,)).fetchone():
                    continue
                label = self._label_id(c, r.label, r.added_at)
                c.execute("INSERT OR IGNORE INTO ingest_batches (id, at, accepted, duplicates, quarantined, refused) "
                          "VALUES (?, ?, 0, 0, 0, 0)", (r.batch, r.added_at))
                c.execute("UPDATE ingest_batches SET accepted = accepted + 1 WHERE id = ?", (r.batch,))
                c.execute("INSERT INTO samples (sha256, label_id, split, width, height, blob_sha256, source, added_at, "
                          "batch_id) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                          (r.sha256, label, r.split, r.width, r.height, r.blob_sha256, r.source, r.added_at, r.batch))
                added += 1
        return added

    def restore_labels(self, labelings: Sequence[Labeling]) -> int:
        """Apply journal labellings to stored samples still unlabelled here (a crash between the journal's
        fsync and the commit), each with its own split and batch and a ``labeled`` event saying it was
        replayed; returns how many samples got their label."""
        done = 0
        with self.transaction() as c:
            for r in labelings:
                row = c.execute("SELECT label_id FROM samples WHERE sha256 = ?", (r.labeled,)).fetchone()
                if row is None or row[0] is not None:
                    continue
                c.execute("INSERT OR IGNORE INTO ingest_batches (id, at, accepted, duplicates, quarantined, refused) "
                          "VALUES (?, ?, 0, 0, 0, 0)", (r.batch, r.at))
                c.execute("UPDATE ingest_batches SET labeled = labeled + 1 WHERE id = ?", (r.batch,))
                self._apply_labeling(c, r, replayed=True)
                done += 1
        return done

    def remove_samples(self, shas: Sequence[str], why: str, event: dict | None = None) -> int:
        """Remove samples (the retention policy's choice) in one transaction: their removal lines are
        appended to the journal and fsynced before the ``COMMIT`` that deletes the rows (see
        :mod:`edgerev_daemon.storage.journal`); the caller deletes the blobs after it. The count by reason grows
        and one ``removed`` event says what went and why; returns how many rows went.

        Args:
            why: a :class:`~edgerev_daemon.storage.records.RemovalReason` value.
            event: more for the event's message (bytes freed, the budget).
        """
        now = self.clock()
        with self.transaction() as c:
            by_label, unlabeled = self._labels_of(c, shas)
            self._journal(c, [Removal(sha, why, now) for sha in shas])
            n = self._delete(c, shas, why)
            message = {"why": why, "samples": n, "by_label": by_label, "unlabeled": unlabeled} | (event or {})
            self._event(c, EventKind.REMOVED, message)
        return n

    def finish_removals(self, shas: Sequence[str], why: str = "interrupted") -> int:
        """Delete the rows of samples the journal already says were removed (a crash came between the
        journal's fsync and the commit); returns how many went."""
        with self.transaction() as c:
            by_label, unlabeled = self._labels_of(c, shas)
            n = self._delete(c, shas, why)
            if n:
                self._event(c, EventKind.REMOVED, {"why": why, "samples": n, "by_label": by_label,
                                                   "unlabeled": unlabeled,
                                                   "finished": "a removal the journal recorded before a crash"})
        return n

    @staticmethod
    def _labels_of(c: sqlite3.Connection, shas: Sequence[str]) -> tuple[dict[str, int], int]:
        """How many of the stored ``shas`` each label holds, and how many are unlabelled."""
        out: dict[str, int] = {}
        unlabeled = 0
        for sha in shas:
            row = c.execute("SELECT s.label_id, l.name FROM samples s LEFT JOIN labels l ON l.id = s.label_id "
                            "WHERE s.sha256 = ?", (sha,)).fetchone()
            if row is None:
                continue
            if row[0] is None:
                unlabeled += 1
            else:
                out[row[1]] = out.get(row[1], 0) + 1
        return out, unlabeled

    def _delete(self, c: sqlite3.Connection, shas: Sequence[str], why: str) -> int:
        n = 0
        splits = self._removal_counts(c, "removed_by_split")
        for sha in shas:
            row = c.execute("SELECT split FROM samples WHERE sha256 = ?", (sha,)).fetchone()
            if row is None:
                continue
            n += c.execute("DELETE FROM samples WHERE sha256 = ?", (sha,)).rowcount
            split = row[0] or "unlabeled"
            splits[split] = splits.get(split, 0) + 1
        if n:
            counts = self._removal_counts(c)
            counts[why] = counts.get(why, 0) + n
            self._set_removal_counts(c, counts)
            self._set_removal_counts(c, splits, "removed_by_split")
        return n

    @staticmethod
    def _removal_counts(c: sqlite3.Connection, key: str = "removed") -> dict[str, int]:
        row = c.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return {str(k): int(v) for k, v in json.loads(row[0]).items()} if row else {}

    @staticmethod
    def _set_removal_counts(c: sqlite3.Connection, counts: dict[str, int], key: str = "removed") -> None:
        c.execute("INSERT INTO meta (key, value) VALUES (?, ?) "
                  "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (key, dumps(counts)))

    def removal_counts(self, by_split: bool = False) -> dict[str, int]:
        """Samples removed over the data directory's life, by reason (or by split, unlabelled ones under
        ``unlabeled``: kept since the store was made; a rebuild restores the counts by reason only, from the
        journal)."""
        return self._removal_counts(self._conn, "removed_by_split" if by_split else "removed")

    def restore_removal_counts(self, counts: dict[str, int]) -> None:
        """Set the count of removals by reason (a rebuild: from the journal)."""
        with self.transaction() as c:
            self._set_removal_counts(c, counts)

    def labels(self) -> list[str]:
        """Label names in the order they first arrived: a label's index never changes, so a model's
        head grows at the end when a new class appears."""
        return [r[0] for r in self._conn.execute("SELECT name FROM labels ORDER BY id")]

    def _filter(self, split: Split | None, after_batch: int | None, upto_batch: int | None,
                labeled: bool | None = None) -> tuple[str, list]:
        where, args = [], []
        if labeled is not None:
            where.append("s.label_id IS NOT NULL" if labeled else "s.label_id IS NULL")
        if split is not None:
            where.append("s.split = ?")
            args.append(Split(split).value)
        if after_batch is not None:
            where.append("s.batch_id > ?")
            args.append(after_batch)
        if upto_batch is not None:
            where.append("s.batch_id <= ?")
            args.append(upto_batch)
        return (" WHERE " + " AND ".join(where)) if where else "", args

    def count_samples(self, split: Split | None = None, after_batch: int | None = None,
                      upto_batch: int | None = None, labeled: bool | None = None) -> int:
        """Samples in ``split``, from batches in ``(after_batch, upto_batch]``; ``labeled``: only the labelled
        (True) or the unlabelled (False) ones (a split names labelled samples only)."""
        where, args = self._filter(split, after_batch, upto_batch, labeled)
        return self._one("SELECT COUNT(*) FROM samples s" + where, args)[0]

    def label_counts(self, split: Split | None = None, upto_batch: int | None = None) -> dict[str, int]:
        """Samples per label in ``split`` from batches up to ``upto_batch``: every label, in arrival order
        (0 for one with none there)."""
        on, args = "", []
        if split is not None:
            on += " AND s.split = ?"
            args.append(Split(split).value)
        if upto_batch is not None:
            on += " AND s.batch_id <= ?"
            args.append(upto_batch)
        rows = self._conn.execute("SELECT l.name, COUNT(s.sha256) FROM labels l LEFT JOIN samples s "
                                  f"ON s.label_id = l.id{on} GROUP BY l.id ORDER BY l.id", args)
        return {name: n for name, n in rows}

    def samples(self, split: Split | None = None, after_batch: int | None = None,
                upto_batch: int | None = None, labeled: bool | None = None) -> list[Sample]:
        """Samples in ``split``, from batches in ``(after_batch, upto_batch]``, in arrival order; ``labeled``:
        only the labelled (True) or the unlabelled (False) ones."""
        where, args = self._filter(split, after_batch, upto_batch, labeled)
        rows = self._conn.execute(self._SAMPLE + where + " ORDER BY s.batch_id, s.sha256", args)
        return [self._sample(r) for r in rows]

    def unlabeled_samples(self, upto_batch: int | None = None) -> list[Sample]:
        """The unlabelled samples (label and split ``None``) from batches up to ``upto_batch``, in arrival
        order: what semi-supervised training and the label questions read."""
        return self.samples(upto_batch=upto_batch, labeled=False)

    def unlabeled_hashes(self, limit: int = -1) -> list[str]:
        """The unlabelled samples' hashes, oldest first (the order the retention policy removes them in), at
        most ``limit`` (-1: all)."""
        return [r[0] for r in self._conn.execute("SELECT sha256 FROM samples WHERE label_id IS NULL "
                                                 "ORDER BY batch_id, sha256 LIMIT ?", (limit,))]

    def newest_unlabeled_batch(self) -> int:
        """The latest ingest batch that holds an unlabelled sample (0: none holds one)."""
        return self._one("SELECT COALESCE(MAX(batch_id), 0) FROM samples WHERE label_id IS NULL")[0]

    def answered_batches(self) -> dict[str, int]:
        """``{sample sha256: its labelling batch}`` of the samples an owner's answer labelled (``labeled`` events
        whose source is ``answer``, while the event log keeps them) that are still stored."""
        rows = self._conn.execute("SELECT s.sha256, s.batch_id FROM events e JOIN samples s ON s.sha256 = "
                                  "json_extract(e.message, '$.sha256') WHERE e.kind = 'labeled' AND "
                                  "json_extract(e.message, '$.source') = 'answer' AND s.label_id IS NOT NULL")
        return dict(rows)

    def split_label_counts(self) -> dict[tuple[Split, str], int]:
        """Labelled samples per (split, label), labels in arrival order (only pairs that hold samples)."""
        rows = self._conn.execute("SELECT s.split, l.name, COUNT(*) FROM samples s JOIN labels l ON l.id = s.label_id "
                                  "GROUP BY l.id, s.split ORDER BY l.id, s.split DESC")
        return {(Split(split), name): n for split, name, n in rows}

    def hashes(self, label: str, split: Split) -> list[str]:
        """The hashes of one label's samples in ``split``, in arrival order (the retention policy's reading)."""
        rows = self._conn.execute("SELECT s.sha256 FROM samples s JOIN labels l ON l.id = s.label_id "
                                  "WHERE l.name = ? AND s.split = ? ORDER BY s.batch_id, s.sha256",
                                  (label, Split(split).value))
        return [r[0] for r in rows]

    def labels_by_hash(self) -> dict[str, tuple[str | None, str | None]]:
        """``{sample sha256: (label, split)}`` of every sample, ``(None, None)`` for an unlabelled one (for the
        consistency check)."""
        rows = self._conn.execute("SELECT s.sha256, l.name, s.split FROM samples s LEFT JOIN labels l "
                                  "ON l.id = s.label_id")
        return {sha: (label, split) for sha, label, split in rows}

    def blob_hashes(self) -> dict[str, str]:
        """``{sample sha256: blob sha256}`` of every sample (for the consistency check)."""
        return dict(self._conn.execute("SELECT sha256, blob_sha256 FROM samples"))

    def first_sample_time(self) -> float | None:
        """When the first labelled sample (in arrival order) was recorded; None before any."""
        row = self._one("SELECT added_at FROM samples WHERE label_id IS NOT NULL ORDER BY batch_id, sha256 LIMIT 1")
        return None if row is None else row[0]

    def last_batch_id(self) -> int:
        """The latest ingest batch (0: none yet)."""
        return self._one("SELECT COALESCE(MAX(id), 0) FROM ingest_batches")[0]

    # jobs -------------------------------------------------------------------------------------------

    _JOB = ("SELECT id, state, reason, created_at, started_at, finished_at, data_batch_id, checkpoint_dir, error "
            "FROM jobs")

    @staticmethod
    def _job(row: tuple) -> Job:
        return Job(row[0], JobState(row[1]), *row[2:])

    def create_job(self, reason: str, checkpoint_dir: str | None = None) -> Job:
        """Queue a job over every sample recorded so far.

        Raises:
            StoreError: a job is already queued or running (one job at a time).
        """
        with self.transaction() as c:
            active = c.execute("SELECT id, state FROM jobs WHERE state IN ('queued', 'running')").fetchone()
            if active:
                raise StoreError(f"job {active[0]} is still {active[1]}; one job at a time")
            batch = c.execute("SELECT COALESCE(MAX(id), 0) FROM ingest_batches").fetchone()[0]
            job_id = c.execute("INSERT INTO jobs (state, reason, created_at, data_batch_id, checkpoint_dir) "
                               "VALUES ('queued', ?, ?, ?, ?)", (reason, self.clock(), batch, checkpoint_dir)).lastrowid
            self._event(c, EventKind.JOB, {"job": job_id, "state": "queued", "reason": reason})
        return self.get_job(job_id)

    def set_job_state(self, job_id: int, state: JobState, error: str | None = None,
                      checkpoint_dir: str | None = None) -> Job:
        """Move a job along :data:`~edgerev_daemon.storage.records.JOB_TRANSITIONS` (and record an event).

        Raises:
            StoreError: no such job, or the change is not allowed (``done`` and ``failed`` are final).
        """
        state = JobState(state)
        now = self.clock()
        with self.transaction() as c:
            row = c.execute("SELECT state FROM jobs WHERE id = ?", (job_id,)).fetchone()
            if row is None:
                raise StoreError(f"no job {job_id}")
            old = JobState(row[0])
            if state not in JOB_TRANSITIONS[old]:
                raise StoreError(f"job {job_id} cannot go from {old.value} to {state.value}")
            sets, args = ["state = ?"], [state.value]
            if state is JobState.RUNNING:
                sets.append("started_at = COALESCE(started_at, ?)")
                args.append(now)
            if state in (JobState.DONE, JobState.FAILED):
                sets.append("finished_at = ?")
                args.append(now)
            if error is not None:
                sets.append("error = ?")
                args.append(error)
            if checkpoint_dir is not None:
                sets.append("checkpoint_dir = ?")
                args.append(checkpoint_dir)
            c.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id = ?", (*args, job_id))
            message = {"job": job_id, "state": state.value} | ({"error": error} if error is not None else {})
            self._event(c, EventKind.JOB, message)
        return self.get_job(job_id)

    def get_job(self, job_id: int) -> Job | None:
        row = self._one(self._JOB + " WHERE id = ?", (job_id,))
        return None if row is None else self._job(row)

    def active_job(self) -> Job | None:
        """The job queued or running, if any (after a crash: the one to resume)."""
        row = self._one(self._JOB + " WHERE state IN ('queued', 'running')")
        return None if row is None else self._job(row)

    def last_job(self, state: JobState | None = None) -> Job | None:
        """The most recent job (in ``state`` when given)."""
        where, args = (" WHERE state = ?", (JobState(state).value,)) if state is not None else ("", ())
        row = self._one(self._JOB + where + " ORDER BY id DESC LIMIT 1", args)
        return None if row is None else self._job(row)

    def jobs(self, limit: int = 20) -> list[Job]:
        """The latest ``limit`` jobs, newest first."""
        return [self._job(r) for r in self._conn.execute(self._JOB + " ORDER BY id DESC LIMIT ?", (limit,))]

    def new_samples_since_last_job(self) -> int:
        """Labelled samples recorded (or labelled) after the data of the last finished (done) job: what the
        schedule counts (an unlabelled image alone makes no job due)."""
        job = self.last_job(JobState.DONE)
        return self.count_samples(after_batch=job.data_batch_id if job else 0, labeled=True)

    # versions ---------------------------------------------------------------------------------------

    _VERSION = "SELECT id, created_at, job_id, parent_id, promoted, metrics, reason FROM versions"

    @staticmethod
    def _version(row: tuple) -> Version:
        return Version(row[0], row[1], row[2], row[3], bool(row[4]), json.loads(row[5]), row[6])

    def add_version(self, job_id: int | None = None, parent_id: str | None = None, promoted: bool = False,
                    metrics: dict | None = None, reason: str = "") -> Version:
        """Allocate the next version id (``v0001``, ``v0002``, ...) and record it."""
        with self.transaction() as c:
            number = c.execute("SELECT COALESCE(MAX(number), 0) + 1 FROM versions").fetchone()[0]
            vid = f"v{number:04d}"
            c.execute("INSERT INTO versions (id, number, created_at, job_id, parent_id, promoted, metrics, reason) "
                      "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                      (vid, number, self.clock(), job_id, parent_id, int(promoted), dumps(metrics or {}), reason))
            self._event(c, EventKind.VERSION, {"version": vid, "promoted": promoted, "reason": reason})
        return self.get_version(vid)

    def update_version(self, version_id: str, promoted: bool | None = None, metrics: dict | None = None,
                       reason: str | None = None) -> Version:
        """Record the promotion decision (or new metrics) of a version.

        Raises:
            StoreError: no such version.
        """
        with self.transaction() as c:
            if c.execute("SELECT 1 FROM versions WHERE id = ?", (version_id,)).fetchone() is None:
                raise StoreError(f"no model version {version_id}")
            if promoted is not None:
                c.execute("UPDATE versions SET promoted = ? WHERE id = ?", (int(promoted), version_id))
            if metrics is not None:
                c.execute("UPDATE versions SET metrics = ? WHERE id = ?", (dumps(metrics), version_id))
            if reason is not None:
                c.execute("UPDATE versions SET reason = ? WHERE id = ?", (reason, version_id))
            if promoted is not None or reason is not None:
                row = c.execute("SELECT promoted, reason FROM versions WHERE id = ?", (version_id,)).fetchone()
                self._event(c, EventKind.VERSION, {"version": version_id, "promoted": bool(row[0]), "reason": row[1]})
        return self.get_version(version_id)

    def restore_version(self, version_id: str, created_at: float, metrics: dict, reason: str) -> None:
        """Record a promoted version found on disk (a rebuild); its number comes from its name."""
        with self.transaction() as c:
            c.execute("INSERT OR IGNORE INTO versions (id, number, created_at, promoted, metrics, reason) "
                      "VALUES (?, ?, ?, 1, ?, ?)",
                      (version_id, int(version_id[1:]), created_at, dumps(metrics), reason))

    def restore_done_job(self, reason: str, data_batch_id: int) -> None:
        """Record a finished job over the data up to ``data_batch_id`` (a rebuild: the schedule counts
        only later samples as new)."""
        now = self.clock()
        with self.transaction() as c:
            c.execute("INSERT INTO jobs (state, reason, created_at, started_at, finished_at, data_batch_id) "
                      "VALUES ('done', ?, ?, ?, ?, ?)", (reason, now, now, now, data_batch_id))

    def get_version(self, version_id: str) -> Version | None:
        row = self._one(self._VERSION + " WHERE id = ?", (version_id,))
        return None if row is None else self._version(row)

    def versions(self, promoted_only: bool = False) -> list[Version]:
        """All versions, oldest first."""
        where = " WHERE promoted = 1" if promoted_only else ""
        return [self._version(r) for r in self._conn.execute(self._VERSION + where + " ORDER BY number")]

    # events -----------------------------------------------------------------------------------------

    def _event(self, c: sqlite3.Connection, kind: EventKind, message: dict) -> int:
        return c.execute("INSERT INTO events (at, kind, message) VALUES (?, ?, ?)",
                         (self.clock(), EventKind(kind).value, dumps(message))).lastrowid

    def add_event(self, kind: EventKind, message: dict, repeat: bool = False) -> int:
        """Record an event in a transaction of its own; returns its id.

        Args:
            repeat: when the latest event of the store has the same kind and message (a fault that
                lasts), count it again on that row (``repeats``, ``last_at``) instead of adding one.
        """
        with self.transaction() as c:
            if repeat:
                last = c.execute("SELECT id, kind, message FROM events ORDER BY id DESC LIMIT 1").fetchone()
                if last is not None and last[1] == EventKind(kind).value and last[2] == dumps(message):
                    c.execute("UPDATE events SET repeats = repeats + 1, last_at = ? WHERE id = ?",
                              (self.clock(), last[0]))
                    return last[0]
            return self._event(c, kind, message)

    def events(self, kind: EventKind | None = None, after_id: int = 0, limit: int = 100,
               latest: bool = False) -> list[Event]:
        """Events after ``after_id`` (of ``kind`` when given), oldest first, at most ``limit``: the first
        ``limit`` of them, or with ``latest`` the last ``limit``."""
        sql, args = "SELECT id, at, kind, message, repeats, last_at FROM events WHERE id > ?", [after_id]
        if kind is not None:
            sql += " AND kind = ?"
            args.append(EventKind(kind).value)
        rows = list(self._conn.execute(sql + f" ORDER BY id {'DESC' if latest else ''} LIMIT ?", (*args, limit)))
        return [Event(r[0], r[1], EventKind(r[2]), json.loads(r[3]), r[4], r[5]) for r in
                (reversed(rows) if latest else rows)]

    def quarantined_source(self, source: str) -> bool:
        """Whether a file from this inbox path was quarantined (see :meth:`has_source`)."""
        row = self._one("SELECT 1 FROM events WHERE kind = 'quarantine' AND json_extract(message, '$.source') = ? "
                        "LIMIT 1", (source,))
        return row is not None

    def duplicate_recorded(self, sha256: str, source: str) -> bool:
        """Whether a duplicate event for this file (hash and inbox path), or the label it gave a stored
        sample, is recorded (see :meth:`has_source`)."""
        row = self._one("SELECT 1 FROM events WHERE kind IN ('duplicate', 'labeled') "
                        "AND json_extract(message, '$.sha256') = ? AND json_extract(message, '$.source') = ? LIMIT 1",
                        (sha256, source))
        return row is not None

    def labeled_from(self, source: str) -> bool:
        """Whether a file from this inbox path gave a stored sample its label (see :meth:`has_source`)."""
        row = self._one("SELECT 1 FROM events WHERE kind = 'labeled' AND json_extract(message, '$.source') = ? "
                        "LIMIT 1", (source,))
        return row is not None

    def inbox_problems(self) -> dict[str, str]:
        """Inbox folders whose latest report says they cannot be read (folder -> reason)."""
        rows = self._conn.execute(
            "SELECT json_extract(message, '$.folder'), json_extract(message, '$.error') FROM events "
            "WHERE json_extract(message, '$.where') = 'inbox' ORDER BY id")
        latest = dict(rows)  # a later 'readable again' (no error) wins
        return {folder: error for folder, error in latest.items() if error is not None}

    def prune_events(self, keep: int, before: float | None = None) -> int:
        """Delete all but the latest ``keep`` events, and those last seen before ``before`` (seconds since
        the epoch); returns how many went."""
        with self.transaction() as c:
            n = 0
            if before is not None:
                n += c.execute("DELETE FROM events WHERE COALESCE(last_at, at) < ?", (before,)).rowcount
            if keep <= 0:
                return n + c.execute("DELETE FROM events").rowcount
            return n + c.execute("DELETE FROM events WHERE id < (SELECT MIN(id) FROM "
                                 "(SELECT id FROM events ORDER BY id DESC LIMIT ?))", (keep,)).rowcount

    # what only the store knows ----------------------------------------------------------------------

    HISTORY_TABLES = ("jobs", "versions", "events")

    def unjournaled_history(self) -> dict[str, int]:
        """Rows no file on disk can recreate: the job history, the versions that were not promoted (a
        promoted one is a directory with its metrics; a rebuild records it again), the events. A rebuild
        salvages them from a readable old store (:func:`edgerev_daemon.storage.rebuild.rebuild`); from a lost
        one, these are lost (``check`` names them)."""
        return {"jobs": self._one("SELECT COUNT(*) FROM jobs")[0],
                "versions_not_promoted": self._one("SELECT COUNT(*) FROM versions WHERE promoted = 0")[0],
                "events": self._one("SELECT COUNT(*) FROM events")[0]}

    def salvage_history(self, old: sqlite3.Connection) -> dict[str, int]:
        """Copy the jobs, versions and events of another store (``old``, a damaged one being replaced) into
        this one, which holds none yet; returns the rows copied per table. A table that cannot be read
        is skipped (its rows are lost, and the count says so by its absence)."""
        copied: dict[str, int] = {}
        columns = {"jobs": "id, state, reason, created_at, started_at, finished_at, data_batch_id, checkpoint_dir, "
                           "error",
                   "versions": "id, number, created_at, job_id, parent_id, promoted, metrics, reason",
                   "events": "id, at, kind, message, repeats, last_at"}
        order = {"jobs": "id", "versions": "number", "events": "id"}
        for table in self.HISTORY_TABLES:
            try:
                rows = old.execute(f"SELECT {columns[table]} FROM {table} ORDER BY {order[table]}").fetchall()
            except sqlite3.Error:
                continue
            marks = ", ".join("?" * len(columns[table].split(", ")))
            with self.transaction() as c:
                n = 0
                for row in rows:
                    try:
                        n += c.execute(f"INSERT OR IGNORE INTO {table} ({columns[table]}) VALUES ({marks})",
                                       row).rowcount
                    except sqlite3.IntegrityError:  # a damaged row (a version naming a lost job): left out
                        continue
            copied[table] = n
        return copied

    # the version in service -------------------------------------------------------------------------

    def set_in_service(self, version_id: str | None) -> None:
        """Record which version ``current`` links to (what a lost or damaged link is restored from)."""
        with self.transaction() as c:
            if version_id is None:
                c.execute("DELETE FROM meta WHERE key = 'in_service'")
            else:
                c.execute("INSERT INTO meta (key, value) VALUES ('in_service', ?) "
                          "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (version_id,))

    def in_service(self) -> str | None:
        """The version the store last recorded as in service (None: none recorded)."""
        row = self._one("SELECT value FROM meta WHERE key = 'in_service'")
        return None if row is None else row[0]

    # manifests an ingest left part-done -------------------------------------------------------------

    _MANIFEST = "manifest:"  # meta keys: "manifest:" + the manifest's inbox path -> its identity, JSON

    def manifests_read(self) -> dict[str, tuple[int, ...]]:
        """The manifests an ingest left in the inbox with lines still to handle, each with the identity it had
        then (device, inode, size, modification time): their refusals are recorded, and a line of theirs whose
        file is gone was handled (:mod:`edgerev_daemon.intake.ingest`)."""
        rows = self._conn.execute("SELECT key, value FROM meta WHERE key >= ? AND key < ?",
                                  (self._MANIFEST, self._MANIFEST[:-1] + ";"))
        return {key[len(self._MANIFEST):]: tuple(json.loads(value)) for key, value in rows}

    def set_manifest_read(self, source: str, identity: Sequence[int] | None) -> None:
        """Record that manifest ``source`` was read as ``identity`` and left with lines to handle (None: forget it)."""
        with self.transaction() as c:
            if identity is None:
                c.execute("DELETE FROM meta WHERE key = ?", (self._MANIFEST + source,))
            else:
                c.execute("INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT(key) DO UPDATE SET value = "
                          "excluded.value", (self._MANIFEST + source, json.dumps(list(identity))))

    # health -----------------------------------------------------------------------------------------

    def checkpoint(self) -> None:
        """Move the write-ahead log into the database file (before the file is renamed or copied)."""
        self._conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def integrity_problems(self) -> list[str]:
        """``PRAGMA integrity_check`` and ``foreign_key_check`` findings (empty: healthy)."""
        out = [r[0] for r in self._conn.execute("PRAGMA integrity_check") if r[0] != "ok"]
        for table, rowid, parent, _ in self._conn.execute("PRAGMA foreign_key_check"):
            out.append(f"{table} row {rowid} names a missing {parent} row")
        return out

    def counts(self) -> dict[str, int]:
        """Rows per table, samples per split, labelled and unlabelled samples (for ``status``)."""
        out = {t: self._one(f"SELECT COUNT(*) FROM {t}")[0]
               for t in ("samples", "labels", "ingest_batches", "jobs", "versions", "events")}
        for split in Split:
            out[f"samples_{split.value}"] = self.count_samples(split)
        out["samples_labeled"] = self.count_samples(labeled=True)
        out["samples_unlabeled"] = self.count_samples(labeled=False)
        return out
