"""The sample journal: an append-only, fsynced record of every stored sample beside the SQLite store.

SQLite is an index. What it knows about a sample that nothing else knows (its label, where it came
from, its split, the ingest batch it arrived in) is also written here, one JSON object per line::

    {"journal": "edgerev-samples", "format": 1, "image_size": 32}                 first line: the header
    {"batch": 3, "sha256": "...", "label": "cat", "split": "train", "width": 640, "height": 480,
     "blob_sha256": "...", "source": "cat/IMG_0001.jpg", "added_at": 1790000000.0}

so that ``edgerev daemon rebuild`` can recreate the store from this file and the blobs (like git's
objects and index) when the store is lost, emptied or damaged. An unlabelled sample's record has
``"label": null, "split": null``; the label it gets later is a line of its own, journaled like a record
(inside the transaction, fsynced before its commit)::

    {"labeled": "<sha256>", "label": "cat", "split": "heldout", "batch": 9, "source": "cat/IMG_0001.jpg",
     "at": 1790000500.0}

from which line on the sample is labelled, in that split, and new data as of that batch.

A sample the retention policy removes
(:mod:`edgerev_daemon.storage.retention`) gets a line of its own, ``{"removed": "<sha256>", "why": "policy",
"at": ...}``; the sample is gone from the journal's view from that line on (a later record of the same
hash, the file dropped again, brings it back).

Removal, in the order of one batch of removals (the mirror of ingest):

1. inside the SQLite transaction that deletes the rows, before its ``COMMIT``, the removal lines are
   appended and fsynced; 2. ``COMMIT``; 3. only then are the blobs deleted.

A crash before step 1 changes nothing. Between 1 and 2 the journal says *removed* while the store still
holds the rows: the decision is made, and the next start finishes it (rows, then blobs:
:func:`edgerev_daemon.storage.retention.finish_removals`); ``check`` reports those samples as *removing*, not as
a problem, and ``rebuild`` leaves them out, so the two agree. Between 2 and 3 the blobs are orphans
that neither the store nor the journal names: garbage, deleted at the next start.

Compaction (:meth:`Journal.compact`) rewrites the file as the samples it holds now, each once, without
the removal lines (a labelling line is folded into its sample's record: label, split, batch); the header
carries the count of removals by reason it drops, so nothing the journal said is lost but the removed
samples' own lines and what gave a label. It writes a temporary file, fsyncs it, renames it
over the journal and fsyncs the folder: a crash leaves the old file or the new one, and both read as
the same samples. It runs between transactions, holding the data directory's lock, so no append can
fall between the read and the rename.

Crash safety, in the order of one ingest batch:

1. the batch's blobs are made durable (:meth:`~edgerev_daemon.storage.blobs.BlobStore.sync`);
2. inside the SQLite transaction, before its ``COMMIT``, the batch's lines are appended with one
   ``write`` and ``fsync``-ed (:meth:`Journal.append`); if that fails the transaction rolls back and
   the journal is cut back to its old length, so a failed write leaves no partial line;
3. ``COMMIT``; 4. only then are the inbox files deleted.

A line is therefore durable before its inbox file can go. A power cut during step 2 can leave a torn
last line (no newline): :meth:`Journal.read` ignores it and the next append cuts it off first. A
crash between steps 2 and 3 leaves lines the store lacks while their files are still in the inbox:
*pending*, recorded by the next start (or ingested again; the sample's hash is its key, so a record
that appears twice is one sample). Lines the store lacks whose files have left the inbox mean the
store lost rows.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from edgerev.atomic import fsync_dir

NAME = "journal.jsonl"
FORMAT = 3  # 2: removal lines and the header's count of removals; 3: unlabelled samples and labelling lines
KIND = "edgerev-samples"
_CHUNK = 65536


@dataclass(frozen=True)
class JournalRecord:
    """One stored sample, as the journal keeps it (the store's ``samples`` row with its label name);
    ``label`` and ``split`` are ``None`` for an unlabelled sample."""

    batch: int
    sha256: str
    label: str | None
    split: str | None
    width: int
    height: int
    blob_sha256: str
    source: str
    added_at: float

    def line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()

    @classmethod
    def from_obj(cls, obj: object) -> JournalRecord:
        """Raises ``ValueError`` for anything but a complete record."""
        if not isinstance(obj, dict):
            raise ValueError("not a JSON object")
        try:
            label, split = obj["label"], obj["split"]
            r = cls(int(obj["batch"]), str(obj["sha256"]), None if label is None else str(label),
                    None if split is None else str(split), int(obj["width"]), int(obj["height"]),
                    str(obj["blob_sha256"]), str(obj["source"]), float(obj["added_at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a sample record ({e})") from None
        if len(r.sha256) != 64 or len(r.blob_sha256) != 64:
            raise ValueError("not a sample record (bad hash)")
        if (r.label is None) != (r.split is None) or r.split not in ("train", "heldout", None):
            raise ValueError("not a sample record (a label without a split, or a bad split)")
        return r


@dataclass(frozen=True)
class Labeling:
    """A stored unlabelled sample given ``label`` (in ``split``, new data as of ingest batch ``batch``) at
    ``at``; ``source``: what gave it (an inbox path, or an answer)."""

    labeled: str
    label: str
    split: str
    batch: int
    source: str
    at: float

    def line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()

    @classmethod
    def from_obj(cls, obj: dict) -> Labeling:
        """Raises ``ValueError`` for anything but a complete labelling line."""
        try:
            r = cls(str(obj["labeled"]), str(obj["label"]), str(obj["split"]), int(obj["batch"]),
                    str(obj["source"]), float(obj["at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a labelling ({e})") from None
        if len(r.labeled) != 64 or obj["label"] is None or r.split not in ("train", "heldout"):
            raise ValueError("not a labelling (bad hash, label or split)")
        return r


@dataclass(frozen=True)
class Removal:
    """A sample removed (``why``: a :class:`~edgerev_daemon.storage.records.RemovalReason` value) at ``at``."""

    removed: str
    why: str
    at: float

    def line(self) -> bytes:
        return (json.dumps(asdict(self), sort_keys=True, separators=(",", ":"), ensure_ascii=True) + "\n").encode()

    @classmethod
    def from_obj(cls, obj: dict) -> Removal:
        """Raises ``ValueError`` for anything but a complete removal line."""
        try:
            r = cls(str(obj["removed"]), str(obj["why"]), float(obj["at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a removal ({e})") from None
        if len(r.removed) != 64:
            raise ValueError("not a removal (bad hash)")
        return r


@dataclass
class JournalContents:
    """What :meth:`Journal.read` found: the header, the sample records, labellings and removals in order
    (``lines``; ``records`` holds the sample records alone), lines that did not parse (1-based numbers; the
    torn last line of a power cut is counted apart, in ``torn_tail``)."""

    header: dict = field(default_factory=dict)
    records: list[JournalRecord] = field(default_factory=list)
    lines: list[JournalRecord | Removal | Labeling] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    torn_tail: bool = False

    @property
    def image_size(self) -> int | None:
        size = self.header.get("image_size")
        return size if isinstance(size, int) else None

    def samples(self) -> dict[str, JournalRecord]:
        """``{sha256: record}`` of the samples the journal holds now: a sample journaled twice (a crash
        before its commit) is one sample (its first record); a labelling line gives it its label, split and
        batch; a removal line ends it."""
        out: dict[str, JournalRecord] = {}
        for r in self.lines:
            if isinstance(r, Removal):
                out.pop(r.removed, None)
            elif isinstance(r, Labeling):
                if r.labeled in out:
                    out[r.labeled] = replace(out[r.labeled], label=r.label, split=r.split, batch=r.batch)
            else:
                out.setdefault(r.sha256, r)
        return out

    def labelings(self) -> dict[str, Labeling]:
        """The labelling line of each sample the journal holds now that got its label after it arrived (a
        removal ends what a line said: the same image dropped again is a sample of its own)."""
        out: dict[str, Labeling] = {}
        for r in self.lines:
            if isinstance(r, Removal):
                out.pop(r.removed, None)
            elif isinstance(r, Labeling):
                out[r.labeled] = r
        return out

    def removed(self) -> set[str]:
        """Hashes whose last line is a removal (the store may still hold some: a crash before the commit)."""
        last: dict[str, bool] = {}
        for r in self.lines:
            if isinstance(r, Removal):
                last[r.removed] = True
            elif isinstance(r, JournalRecord):
                last[r.sha256] = False
        return {sha for sha, gone in last.items() if gone}

    def removal_counts(self) -> dict[str, int]:
        """Removals by reason over the journal's whole life: the header's (lines compaction dropped) and
        the removal lines since."""
        counts = self.header.get("removed")
        out = {str(k): int(v) for k, v in counts.items()} if isinstance(counts, dict) else {}
        for r in self.lines:
            if isinstance(r, Removal):
                out[r.why] = out.get(r.why, 0) + 1
        return out


def header_line(image_size: int | None, removed: dict[str, int] | None = None) -> bytes:
    header = {"journal": KIND, "format": FORMAT, "image_size": image_size}
    if removed:
        header["removed"] = dict(sorted(removed.items()))
    return (json.dumps(header) + "\n").encode()


class Journal:
    """The journal file of one data directory (``DATA_DIR/journal.jsonl``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.is_file()

    def create(self, image_size: int | None, records: list[JournalRecord],
               removed: dict[str, int] | None = None) -> None:
        """Write a new journal holding ``records`` (temporary file, fsync, rename, fsync of the folder);
        ``removed``: the count of removals by reason its header carries."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header_line(image_size, removed) + b"".join(r.line() for r in records))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)

    def header(self) -> dict:
        """The first line alone (cheap: what :func:`edgerev_daemon.storage.retention.compact_journal` asks at every
        removal); empty when missing or not a header."""
        try:
            with open(self.path, "rb") as f:
                obj = json.loads(f.readline())
        except (OSError, ValueError):
            return {}
        return obj if isinstance(obj, dict) and obj.get("journal") == KIND else {}

    def compact(self, contents: JournalContents | None = None) -> tuple[int, int]:
        """Rewrite the journal as the samples it holds now (see the module's docstring for why a crash at
        any point leaves an equivalent journal); returns its size in bytes before and after. Lines that
        did not parse are kept out, as :meth:`read` already ignores them. Call it only when the store
        holds none of the removed samples (:func:`edgerev_daemon.storage.retention.compact_journal` sees to it):
        afterwards the journal no longer says they were removed.

        Args:
            contents: what :meth:`read` returned just before (read again when not given).
        """
        before = self.path.stat().st_size
        contents = contents if contents is not None else self.read()
        self.create(contents.image_size, list(contents.samples().values()), contents.removal_counts())
        return before, self.path.stat().st_size

    def append(self, records: list[JournalRecord | Removal | Labeling]) -> None:
        """Append ``records`` durably (one write, one fsync); on any failure the file is cut back to the
        length it had, so no partial line stays behind.

        Raises:
            OSError: the write or the fsync failed (disk full, I/O error).
        """
        if not records:
            return
        data = b"".join(r.line() for r in records)
        fd = os.open(self.path, os.O_RDWR | os.O_APPEND | os.O_CLOEXEC)
        try:
            size = _cut_torn_tail(fd)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            except BaseException:
                os.ftruncate(fd, size)  # frees what was written: works on a full disk too
                raise
        finally:
            os.close(fd)

    def read(self) -> JournalContents:
        """Every complete line; a missing file reads as empty."""
        out = JournalContents()
        try:
            data = self.path.read_bytes()
        except FileNotFoundError:
            return out
        lines = data.split(b"\n")
        if lines and lines[-1] != b"":
            out.torn_tail = True  # the last write of a power cut: never acknowledged, never committed
        for number, raw in enumerate(lines[:-1], start=1):
            try:
                obj = json.loads(raw)
                if number == 1 and isinstance(obj, dict) and obj.get("journal") == KIND:
                    out.header = obj
                    continue
                if isinstance(obj, dict) and "removed" in obj:
                    out.lines.append(Removal.from_obj(obj))
                    continue
                if isinstance(obj, dict) and "labeled" in obj:
                    out.lines.append(Labeling.from_obj(obj))
                    continue
                record = JournalRecord.from_obj(obj)
                out.records.append(record)
                out.lines.append(record)
            except ValueError:
                out.bad_lines.append(number)
        return out


def _cut_torn_tail(fd: int) -> int:
    """Cut the file back to its last newline (a torn line from a power cut); returns the new length."""
    size = os.fstat(fd).st_size
    end = size
    while end > 0:
        start = max(0, end - _CHUNK)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            keep = start + i + 1
            break
        end = start
    else:
        keep = 0
    if keep != size:
        os.ftruncate(fd, keep)
    return keep
