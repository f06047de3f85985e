"""Where the daemon keeps things inside its data directory.

```
DATA_DIR/
  daemon.lock          single-instance lock (flock), holds the owner's pid
  store.sqlite         the SQLite store (with -wal and -shm beside it): an index, rebuilt from the journal
  journal.jsonl        every stored sample, appended and fsynced before its commit (see journal.py)
  blobs/ab/cdef...png  normalized images, named by the SHA-256 of the file that was dropped
  quarantine/          rejected files, each with NAME.reason.json beside it
  inbox/               default inbox (the config may put it elsewhere)
  versions/vNNNN/      promoted models, each with a manifest.json of its files' SHA-256
  current -> versions/vNNNN
```

Everything the daemon writes stays under ``DATA_DIR`` (the inbox aside, which it only reads and
empties), so a service sandbox needs exactly one writable path.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from edgerev.atomic import fsync_dir

#: the reason file beside each quarantined file: ``quarantine/NAME`` + ``SIDECAR``
SIDECAR = ".reason.json"


@dataclass(frozen=True)
class Layout:
    """Paths inside one data directory."""

    root: Path

    @property
    def lock(self) -> Path:
        return self.root / "daemon.lock"

    @property
    def database(self) -> Path:
        return self.root / "store.sqlite"

    @property
    def journal(self) -> Path:
        return self.root / "journal.jsonl"

    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def quarantine(self) -> Path:
        return self.root / "quarantine"

    @property
    def default_inbox(self) -> Path:
        return self.root / "inbox"

    @property
    def jobs(self) -> Path:
        return self.root / "jobs"

    def job_dir(self, job_id: int) -> Path:
        """A job's folder (its checkpoints, progress and model): named by the job alone, so that a data directory
        moved elsewhere still finds it."""
        return self.jobs / f"job-{job_id:05d}"

    def managed_dirs(self) -> tuple[Path, ...]:
        """The folders the daemon creates and owns (an inbox must never lie inside one)."""
        return (self.blobs, self.quarantine)


def make_dirs(path: Path) -> None:
    """``mkdir -p`` that makes every folder it creates durable (fsyncs each new folder's parent)."""
    missing = []
    p = path
    while not p.exists():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            os.mkdir(d)
        except FileExistsError:
            continue
        fsync_dir(d.parent)


def prepare(layout: Layout, inbox: Path) -> None:
    """Create the data directory's folders and the inbox (call after the paths were validated)."""
    make_dirs(layout.root)
    for d in (*layout.managed_dirs(), inbox):
        make_dirs(d)
