"""Moving a rejected file aside: ``quarantine/NAME`` with ``quarantine/NAME.reason.json`` beside it.

The sidecar (reason, time, the file's path in the inbox) is written first, then the file is renamed
into place: a crash between the two leaves a reason with no file and the file still in the inbox,
where the next scan rejects it again, into the same name. The rename goes from the inbox folder's
descriptor (reached without following links, :mod:`edgerev_daemon.confined`) to the quarantine's: a
symbolic link is moved as the link, and what it points to is never touched.

``NAME`` is the file's recorded name (:func:`~edgerev_daemon.names.shown`: valid UTF-8, no control
characters), cut to :data:`MAX_NAME` bytes with a hash of the whole name when it is longer, so that
``NAME.reason.json`` and the temporary names fit any file system however long the original was.

**Never copied.** When the inbox is on another file system than the data directory, a rename fails
(``EXDEV``) and a copy would cost data-disk space for every rejected file, again after each crash or
restart: it is never made. The file stays in its inbox folder, renamed to the hidden
``.rejected-NAME`` (hidden names are never scanned, so it is not retried), and its reason file in
``quarantine/`` says where it is (``left_in_inbox``). Quarantine costs the data disk a few hundred
bytes per rejected file, whatever the files weigh.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
from pathlib import Path

from edgerev.atomic import atomic_write
from edgerev_daemon import confined
from edgerev_daemon.layout import make_dirs
from edgerev_daemon.names import shown, shown_path

SIDECAR = ".reason.json"
REJECTED_PREFIX = ".rejected-"
MAX_NAME = 160  # bytes: leaves room for the sidecar suffix and temporary prefixes under NAME_MAX (255)


def _sidecar_source(path: Path) -> str | None:
    try:
        return json.loads(path.read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def safe_name(name: str) -> str:
    """The quarantine name of inbox file ``name``: its shown form, at most :data:`MAX_NAME` bytes."""
    text = shown(name)
    if len(text.encode()) <= MAX_NAME:
        return text
    dot = text.rfind(".")
    ext = text[dot:] if 0 < dot and len(text) - dot <= 16 else ""
    digest = hashlib.sha256(os.fsencode(name) if isinstance(name, str) else name).hexdigest()[:16]
    stem = text[: len(text) - len(ext)].encode()[: MAX_NAME - len(ext) - 18].decode("utf-8", "ignore")
    return f"{stem}~{digest}{ext}"


def _exists(fd: int, name: str) -> bool:
    try:
        confined.lstat(fd, name)
        return True
    except FileNotFoundError:
        return False


def _free_name(folder: Path, fd: int, name: str, source: str) -> str:
    """``name``, or ``stem-1.ext``, ``stem-2.ext``, ... whichever is free. A name whose sidecar is
    there without its file, for the same inbox path, is free: a crash cut that quarantine short."""
    dot = name.rfind(".")
    stem, ext = (name[:dot], name[dot:]) if dot > 0 else (name, "")
    candidate, n = name, 0
    while True:
        if not _exists(fd, candidate):
            if not _exists(fd, candidate + SIDECAR) or _sidecar_source(folder / (candidate + SIDECAR)) == source:
                return candidate
        n += 1
        candidate = f"{stem}-{n}{ext}"


def _hidden_name(dir_fd: int, name: str) -> str:
    """A free hidden ``.rejected-...`` name for ``name`` in the same folder."""
    base = REJECTED_PREFIX + safe_name(name)
    hidden, n = base, 0
    while _exists(dir_fd, hidden):
        n += 1
        hidden = f"{base}-{n}"
    return hidden


def _same(st: os.stat_result, inode: tuple[int, int] | None) -> bool:
    return inode is None or (st.st_dev, st.st_ino) == inode


def quarantine(root_fd: int, parts: tuple[str, ...], folder: Path, reason: str, source: str, now: float,
               inode: tuple[int, int] | None = None) -> str:
    """Move inbox file ``parts`` (from the inbox open as ``root_fd``) into ``folder`` with its reason
    beside it; returns where it went: ``quarantine/NAME``, or ``inbox:PATH`` for a file left in the
    inbox under a hidden name (another file system).

    Args:
        source: the file's recorded path relative to the inbox (written in the sidecar).
        now: the time recorded in the sidecar.
        inode: device and inode of what was judged. Anything else found under that name (a label
            folder swapped in for the link that was judged) is not moved; should it be swapped in
            between the check and the rename, it is renamed back at once.

    Raises:
        FileNotFoundError: the file vanished (or a folder on its way was swapped for a link).
        OSError: the quarantine cannot be written (the file stays in the inbox, retried later).
    """
    make_dirs(folder)
    qfd = confined.open_root(folder)
    try:
        with confined.parent(root_fd, parts) as dir_fd:
            if not _same(confined.lstat(dir_fd, parts[-1]), inode):  # FileNotFoundError: before any sidecar
                raise FileNotFoundError(errno.ENOENT, f"{source} was replaced since it was examined")
            dst = _free_name(folder, qfd, safe_name(parts[-1]), source)
            sidecar = {"reason": reason, "at": now, "source": source}
            atomic_write(folder / (dst + SIDECAR), (json.dumps(sidecar, indent=2) + "\n").encode())
            try:
                confined.rename(dir_fd, parts[-1], qfd, dst)
                if not _same(confined.lstat(qfd, dst), inode):  # swapped in after the check: give it back
                    confined.rename(qfd, dst, dir_fd, parts[-1])
                    os.unlink(dst + SIDECAR, dir_fd=qfd)
                    raise FileNotFoundError(errno.ENOENT, f"{source} was replaced while it was moved")
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # the reason says where the file will be before it goes there: a crash cannot hide it unexplained
                hidden = _hidden_name(dir_fd, parts[-1])
                where = shown_path(parts[:-1] + (hidden,))
                sidecar["left_in_inbox"] = where
                atomic_write(folder / (dst + SIDECAR), (json.dumps(sidecar, indent=2) + "\n").encode())
                confined.rename(dir_fd, parts[-1], dir_fd, hidden)
                os.fsync(dir_fd)
                return f"inbox:{where}"
        os.fsync(qfd)
        return f"quarantine/{dst}"
    except confined.NotConfined as e:
        raise FileNotFoundError(errno.ENOENT, f"{source}: {e.strerror}") from None
    finally:
        os.close(qfd)


def quarantined_from(folder: Path, source: str) -> bool:
    """Whether a reason file in ``folder`` names this inbox path (reads them all: for the rare
    manifest entry whose file is gone, after a crash)."""
    return folder.is_dir() and any(_sidecar_source(p) == source for p in folder.glob("*" + SIDECAR))
