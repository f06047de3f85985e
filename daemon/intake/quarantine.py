"""Moving a rejected file aside: ``quarantine/NAME`` with ``quarantine/NAME.reason.json`` beside it.

The sidecar (reason, time, the file's path in the inbox) is written first, then the file is linked
into place (a hard link: the same file under a second name), then its inbox name removed. A crash
between the steps leaves a reason with no file, or the file under both names; the next scan rejects
it again, into the same name (recognized by its inode), and finishes. Link and removal go from the
inbox folder's descriptor (reached without following links, :mod:`edgerev_daemon.intake.confined`) to the
quarantine's: a symbolic link is moved as the link, and what it points to is never touched. A link
rather than a rename because a folder cannot be linked and ``unlink`` never removes one: a label
folder swapped in for the very name being moved, at any instant, stays where it is. The inode is
checked before the link and after it (what was linked is what was judged).

``NAME`` is the file's recorded name (:func:`~edgerev_daemon.intake.names.shown`: valid UTF-8, no control
characters), cut to :data:`MAX_NAME` bytes with a hash of the whole name when it is longer, so that
``NAME.reason.json`` and the temporary names fit any file system however long the original was.

**Never copied.** When the inbox is on another file system than the data directory, a rename fails
(``EXDEV``) and a copy would cost data-disk space for every rejected file, again after each crash or
restart: it is never made. The file stays in its inbox folder, renamed to the hidden
``.rejected-NAME`` (linked and unlinked the same way; hidden names are never scanned, so it is not
retried), and its reason file in
``quarantine/`` says where it is (``left_in_inbox``). Quarantine costs the data disk a few hundred
bytes per rejected file, whatever the files weigh.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
from pathlib import Path

from edgerev.atomic import atomic_write
from edgerev_daemon.intake import confined
from edgerev_daemon.intake.names import shown, shown_path
from edgerev_daemon.layout import SIDECAR, make_dirs

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


def _free_name(folder: Path, fd: int, name: str, source: str, inode: tuple[int, int]) -> str:
    """``name``, or ``stem-1.ext``, ``stem-2.ext``, ... whichever is free. A name whose sidecar is
    there without its file, for the same inbox path, is free, and so is one that already is this very
    file (``inode``): a crash cut that quarantine short."""
    dot = name.rfind(".")
    stem, ext = (name[:dot], name[dot:]) if dot > 0 else (name, "")
    candidate, n = name, 0
    while True:
        try:
            st = confined.lstat(fd, candidate)
            if (st.st_dev, st.st_ino) == inode:
                return candidate
        except FileNotFoundError:
            pass
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
            st = confined.lstat(dir_fd, parts[-1])  # FileNotFoundError: before any sidecar is written
            if not _same(st, inode):
                raise FileNotFoundError(errno.ENOENT, f"{source} was replaced since it was examined")
            inode = (st.st_dev, st.st_ino)
            dst = _free_name(folder, qfd, safe_name(parts[-1]), source, inode)
            sidecar = {"reason": reason, "at": now, "source": source}
            atomic_write(folder / (dst + SIDECAR), (json.dumps(sidecar, indent=2) + "\n").encode())
            try:
                _link_once(dir_fd, parts[-1], qfd, dst, inode)
            except OSError as e:
                if e.errno != errno.EXDEV:
                    raise
                # the reason says where the file will be before it goes there: a crash cannot hide it unexplained
                hidden = _hidden_name(dir_fd, parts[-1])
                where = shown_path(parts[:-1] + (hidden,))
                sidecar["left_in_inbox"] = where
                atomic_write(folder / (dst + SIDECAR), (json.dumps(sidecar, indent=2) + "\n").encode())
                _link_once(dir_fd, parts[-1], dir_fd, hidden, inode)
                confined.unlink_if(dir_fd, parts[-1], inode)
                os.fsync(dir_fd)
                return f"inbox:{where}"
            os.fsync(qfd)
            confined.unlink_if(dir_fd, parts[-1], inode)
        return f"quarantine/{dst}"
    except confined.NotConfined as e:
        raise FileNotFoundError(errno.ENOENT, f"{source}: {e.strerror}") from None
    finally:
        os.close(qfd)


def _link_once(src_fd: int, src: str, dst_fd: int, dst: str, inode: tuple[int, int]) -> None:
    """Link ``src`` as ``dst`` unless a crash already did; if what got linked is not ``inode`` (swapped
    in between the check and the link), the new name is removed again and the file left alone."""
    try:
        confined.link(src_fd, src, dst_fd, dst)
    except FileExistsError:
        pass  # _free_name only returns a taken name when it is this very file
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        if stat.S_ISDIR(confined.lstat(src_fd, src).st_mode):  # a folder (swapped in) cannot be linked
            raise FileNotFoundError(errno.ENOENT, f"{src} is now a folder") from None
        # a file system without hard links (FAT): one rename, checked after; a folder swapped in during
        # that instant is renamed back (inside the inbox either way)
        confined.rename(src_fd, src, dst_fd, dst)
        st = confined.lstat(dst_fd, dst)
        if (st.st_dev, st.st_ino) != inode:
            confined.rename(dst_fd, dst, src_fd, src)
            raise FileNotFoundError(errno.ENOENT, f"{src} was replaced while it was moved") from None
        return
    st = confined.lstat(dst_fd, dst)
    if (st.st_dev, st.st_ino) != inode:
        os.unlink(dst, dir_fd=dst_fd)
        raise FileNotFoundError(errno.ENOENT, f"{src} was replaced while it was moved")


def quarantined_from(folder: Path, source: str) -> bool:
    """Whether a reason file in ``folder`` names this inbox path (reads them all: for the rare
    manifest entry whose file is gone, after a crash)."""
    return folder.is_dir() and any(_sidecar_source(p) == source for p in folder.glob("*" + SIDECAR))
