"""Moving a rejected file aside: ``quarantine/NAME`` with ``quarantine/NAME.reason.json`` beside it.

The sidecar (reason, time, the file's path in the inbox) is written first, then the file is renamed
into place: a crash between the two leaves a reason with no file and the file still in the inbox,
where the next scan rejects it again, into the same name. The file is moved, never copied and deleted, when the inbox
and the data directory share a file system; across file systems it is copied, fsynced, renamed into
place, and only then deleted from the inbox. A symbolic link is moved as the link: what it points
to is never touched.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from edgerev.atomic import atomic_write, fsync_dir
from edgerev_daemon.layout import make_dirs

SIDECAR = ".reason.json"


def _sidecar_source(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def _free_name(folder: Path, name: str, source: str) -> Path:
    """``name``, or ``stem-1.ext``, ``stem-2.ext``, ... whichever is free. A name whose sidecar is
    there without its file, for the same inbox path, is free: a crash cut that quarantine short."""
    dot = name.rfind(".")
    stem, ext = (name[:dot], name[dot:]) if dot > 0 else (name, "")
    candidate, n = name, 0
    while True:
        path, sidecar = folder / candidate, folder / (candidate + SIDECAR)
        if not (path.exists() or path.is_symlink()):
            if not sidecar.exists() or _sidecar_source(sidecar) == source:
                return path
        n += 1
        candidate = f"{stem}-{n}{ext}"


def _move(src: Path, dst: Path) -> None:
    try:
        os.rename(src, dst)
    except OSError as e:
        if e.errno != errno.EXDEV:
            raise
        tmp = dst.with_name(f".{dst.name}.tmp-{os.getpid()}")
        try:
            shutil.copy2(src, tmp, follow_symlinks=False)
            if not tmp.is_symlink():
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())
            os.replace(tmp, dst)
        finally:
            if tmp.exists() or tmp.is_symlink():
                tmp.unlink()
        fsync_dir(dst.parent)
        os.unlink(src)


def quarantine(path: Path, folder: Path, reason: str, source: str, now: float) -> Path:
    """Move ``path`` into ``folder`` with its reason beside it; returns where it went.

    Args:
        source: the file's path relative to the inbox (recorded in the sidecar).
        now: the time recorded in the sidecar.
    """
    make_dirs(folder)
    dst = _free_name(folder, path.name, source)
    sidecar = {"reason": reason, "at": now, "source": source, "original": str(path)}
    atomic_write(dst.with_name(dst.name + SIDECAR), (json.dumps(sidecar, indent=2) + "\n").encode())
    _move(path, dst)
    fsync_dir(folder)
    return dst


def quarantined_from(folder: Path, source: str) -> bool:
    """Whether a reason file in ``folder`` names this inbox path (reads them all: for the rare
    manifest entry whose file is gone, after a crash)."""
    return folder.is_dir() and any(_sidecar_source(p) == source for p in folder.glob("*" + SIDECAR))
