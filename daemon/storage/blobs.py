"""Content-addressed image files: ``blobs/ab/cdef....png`` for the key ``abcdef...``.

The key is the SHA-256 of the file that was dropped in the inbox (what dedupe compares); the blob
holds the *normalized* image (RGB, the model's input size, PNG), whose own SHA-256 the store records
so the consistency check can tell a damaged blob from a good one.

A blob is written to a temporary name in its folder and renamed over its final name, so a reader
never sees half a file. Durability is batched: :meth:`BlobStore.sync` makes every blob written since
the last call durable, file and folder entry, before ingest commits the rows that name them. On Linux
that is one ``syncfs`` of the data directory's file system per batch instead of one ``fsync`` per
file and per folder (on a busy or slow disk, an SD card, each ``fsync`` costs milliseconds: ten
times the rest of ingest); elsewhere it falls back to those ``fsync`` calls. A power cut before the
sync can leave a torn blob, but no row names it yet, and ingesting the file again rewrites it: writing
a blob that exists rewrites the same bytes.
"""

from __future__ import annotations

import os
import re
import threading
from collections.abc import Iterator
from pathlib import Path

from edgerev.atomic import fsync_dir
from edgerev_daemon.layout import make_dirs

SUFFIX = ".png"
_HEX = re.compile(r"[0-9a-f]{64}")
TMP_MARK = ".tmp-"


class BlobStore:
    """The blob folder of one data directory."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self._unsynced: list[Path] = []

    def path(self, key: str) -> Path:
        if not _HEX.fullmatch(key):
            raise ValueError(f"not a SHA-256 hex digest: {key!r}")
        return self.root / key[:2] / (key[2:] + SUFFIX)

    def write(self, key: str, data: bytes) -> Path:
        """Write ``data`` as blob ``key`` (durable after the next :meth:`sync`); returns its path."""
        path = self.path(key)
        folder = path.parent
        if not folder.is_dir():
            make_dirs(folder)  # durable at once: new folders are rare (256 at most)
        tmp = folder / f".{path.name}{TMP_MARK}{os.getpid()}-{threading.get_ident()}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        finally:
            if tmp.exists():
                tmp.unlink()
        self._unsynced.append(path)
        return path

    def sync(self) -> None:
        """Make every blob written since the last call durable, with its folder entry.

        Raises:
            OSError: the file system reported a write-back error (the blobs may not be on disk).
        """
        if not self._unsynced:
            return
        if _syncfs is not None:
            _syncfs(self.root)
        else:
            for path in self._unsynced:
                with open(path, "rb") as f:
                    os.fsync(f.fileno())
            for folder in {p.parent for p in self._unsynced}:
                fsync_dir(folder)
        self._unsynced.clear()

    def read(self, key: str) -> bytes:
        return self.path(key).read_bytes()

    def exists(self, key: str) -> bool:
        return self.path(key).is_file()

    def remove(self, key: str) -> None:
        self.path(key).unlink(missing_ok=True)

    def scan(self) -> Iterator[tuple[str | None, Path]]:
        """Every file under the blob folder: ``(key, path)`` for a blob, ``(None, path)`` for anything
        else (a temporary file left by a crash, a stranger)."""
        if not self.root.is_dir():
            return
        for folder in sorted(self.root.iterdir()):
            if not folder.is_dir():
                yield None, folder
                continue
            for path in sorted(folder.iterdir()):
                key = folder.name + path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else ""
                yield (key if _HEX.fullmatch(key) and path.is_file() else None), path


def _load_syncfs():
    """``syncfs(2)`` through libc (Linux; the os module has no binding), or ``None``."""
    import ctypes
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int]

    def syncfs(path: Path) -> None:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            if fn(fd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err), str(path))
        finally:
            os.close(fd)

    return syncfs


_syncfs = _load_syncfs()
