"""Consistency of the store and the blob folder: what the soak and crash tests assert, and what a
``check`` command prints.

Problems (``ok`` is false): a sample whose blob is missing, a blob whose bytes do not hash to what
the sample row recorded (damaged on disk), and anything ``PRAGMA integrity_check`` or
``foreign_key_check`` reports. Garbage (harmless, removable with :func:`remove_garbage` while the
daemon's lock is held): orphan blobs that no sample names (written by a batch that a crash cut short
and whose file then left the inbox) and stray files (a crash's temporary files).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

from edgerev_daemon.blobs import BlobStore
from edgerev_daemon.store import Store


@dataclass
class CheckReport:
    samples: int = 0
    blobs: int = 0
    missing: list[str] = field(default_factory=list)    # sample hashes without a blob
    corrupt: list[str] = field(default_factory=list)    # sample hashes whose blob's bytes changed
    orphans: list[str] = field(default_factory=list)    # blob keys no sample names
    strays: list[Path] = field(default_factory=list)    # other files in the blob folder
    database: list[str] = field(default_factory=list)   # integrity and foreign-key findings

    @property
    def ok(self) -> bool:
        """No sample lost or damaged and a sound database (garbage allowed)."""
        return not (self.missing or self.corrupt or self.database)

    @property
    def clean(self) -> bool:
        """:attr:`ok` and no garbage either."""
        return self.ok and not (self.orphans or self.strays)

    def to_json(self) -> dict:
        return {"ok": self.ok, "clean": self.clean, "samples": self.samples, "blobs": self.blobs,
                "missing": self.missing, "corrupt": self.corrupt, "orphans": self.orphans,
                "strays": [str(p) for p in self.strays], "database": self.database}


def check_consistency(store: Store, blobs: BlobStore, verify: bool = True) -> CheckReport:
    """Compare every sample row with its blob and the blob folder with the rows.

    Args:
        verify: hash every blob (reads them all); ``False`` checks only that each exists.
    """
    expected = store.blob_hashes()
    report = CheckReport(samples=len(expected), database=store.integrity_problems())
    on_disk: set[str] = set()
    for key, path in blobs.scan():
        if key is None:
            report.strays.append(path)
            continue
        on_disk.add(key)
        if key not in expected:
            report.orphans.append(key)
        elif verify and hashlib.sha256(path.read_bytes()).hexdigest() != expected[key]:
            report.corrupt.append(key)
    report.blobs = len(on_disk)
    report.missing = sorted(k for k in expected if k not in on_disk)
    return report


def remove_garbage(report: CheckReport, blobs: BlobStore) -> int:
    """Delete the orphans and strays a report found; returns how many files went. Call it only while
    holding the data directory's lock: an orphan may be a blob of a batch not yet committed."""
    n = 0
    for key in report.orphans:
        blobs.remove(key)
        n += 1
    for path in report.strays:
        if path.is_file() or path.is_symlink():
            path.unlink()
            n += 1
    return n
