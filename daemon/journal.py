"""The sample journal: an append-only, fsynced record of every stored sample beside the SQLite store.

SQLite is an index. What it knows about a sample that nothing else knows (its label, where it came
from, its split, the ingest batch it arrived in) is also written here, one JSON object per line::

    {"journal": "edgerev-samples", "format": 1, "image_size": 32}                 first line: the header
    {"batch": 3, "sha256": "...", "label": "cat", "split": "train", "width": 640, "height": 480,
     "blob_sha256": "...", "source": "cat/IMG_0001.jpg", "added_at": 1790000000.0}

so that ``edgerev daemon rebuild`` can recreate the store from this file and the blobs (like git's
objects and index) when the store is lost, emptied or damaged.

Crash safety, in the order of one ingest batch:

1. the batch's blobs are made durable (:meth:`~edgerev_daemon.blobs.BlobStore.sync`);
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgerev.atomic import fsync_dir

NAME = "journal.jsonl"
FORMAT = 1
KIND = "edgerev-samples"
_CHUNK = 65536


@dataclass(frozen=True)
class JournalRecord:
    """One stored sample, as the journal keeps it (the store's ``samples`` row with its label name)."""

    batch: int
    sha256: str
    label: str
    split: str
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
            r = cls(int(obj["batch"]), str(obj["sha256"]), str(obj["label"]), str(obj["split"]), int(obj["width"]),
                    int(obj["height"]), str(obj["blob_sha256"]), str(obj["source"]), float(obj["added_at"]))
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"not a sample record ({e})") from None
        if len(r.sha256) != 64 or len(r.blob_sha256) != 64 or r.split not in ("train", "heldout"):
            raise ValueError("not a sample record (bad hash or split)")
        return r


@dataclass
class JournalContents:
    """What :meth:`Journal.read` found: the header, the records in order, lines that did not parse
    (1-based numbers; the torn last line of a power cut is counted apart, in ``torn_tail``)."""

    header: dict = field(default_factory=dict)
    records: list[JournalRecord] = field(default_factory=list)
    bad_lines: list[int] = field(default_factory=list)
    torn_tail: bool = False

    @property
    def image_size(self) -> int | None:
        size = self.header.get("image_size")
        return size if isinstance(size, int) else None

    def samples(self) -> dict[str, JournalRecord]:
        """``{sha256: first record}``: a sample journaled twice (a crash before its commit) is one sample."""
        out: dict[str, JournalRecord] = {}
        for r in self.records:
            out.setdefault(r.sha256, r)
        return out


def header_line(image_size: int | None) -> bytes:
    return (json.dumps({"journal": KIND, "format": FORMAT, "image_size": image_size}) + "\n").encode()


class Journal:
    """The journal file of one data directory (``DATA_DIR/journal.jsonl``)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)

    def exists(self) -> bool:
        return self.path.is_file()

    def create(self, image_size: int | None, records: list[JournalRecord]) -> None:
        """Write a new journal holding ``records`` (temporary file, fsync, rename, fsync of the folder)."""
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        try:
            with open(tmp, "wb") as f:
                f.write(header_line(image_size) + b"".join(r.line() for r in records))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        finally:
            tmp.unlink(missing_ok=True)
        fsync_dir(self.path.parent)

    def append(self, records: list[JournalRecord]) -> None:
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
                out.records.append(JournalRecord.from_obj(obj))
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
