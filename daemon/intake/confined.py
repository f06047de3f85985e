"""File operations confined to one folder tree: every step relative to a directory descriptor.

Anyone who can write to the inbox can replace a folder with a symbolic link at any instant, between
any two system calls of the daemon. A path string is resolved again by every call that takes it, so
checking a path and then using it is a race the daemon would lose. Here nothing takes a path: a
folder is opened from its parent's descriptor with ``O_DIRECTORY | O_NOFOLLOW`` (a link fails to open
instead of being followed), a file with ``O_NOFOLLOW | O_NONBLOCK`` (a FIFO never blocks the open),
and removals and renames name one entry of a folder held open (``dir_fd``, ``src_dir_fd``,
``dst_dir_fd``). Whatever is swapped, the daemon only ever reaches entries of folders it opened by
walking down from the root descriptor, never following a link.

A removal also checks identity: the entry is removed only if it is still the very file that was read
(device, inode, size, modification time), so a file replaced under the same name stays. The check
and the unlink are two calls on one open folder: a file renamed into that folder between them could
be removed in place of the one read, but only ever an entry of an inbox folder, never a file outside.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator
from contextlib import contextmanager

DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
FILE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC

Identity = tuple[int, int, int, int]


class NotConfined(OSError):
    """A component on the way is a symbolic link or not a folder (it was swapped, or never was one)."""


def identity(st: os.stat_result) -> Identity:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def open_root(path: str | os.PathLike) -> int:
    """A descriptor of the root folder itself (configured by the operator: a link to it is followed)."""
    return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


def open_dir(parent_fd: int, name: str) -> int:
    """The folder ``name`` inside ``parent_fd``, never through a link.

    Raises:
        NotConfined: ``name`` is a link or not a folder.
        FileNotFoundError, PermissionError, OSError: as ``os.open``.
    """
    try:
        return os.open(name, DIR_FLAGS, dir_fd=parent_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotConfined(e.errno, f"{'symbolic link' if e.errno == errno.ELOOP else 'not a folder'}") from None
        raise


@contextmanager
def parent(root_fd: int, parts: tuple[str, ...]) -> Iterator[int]:
    """The descriptor of the folder holding ``parts[-1]``, walked down from ``root_fd`` (closed on exit)."""
    fds: list[int] = []
    try:
        fd = root_fd
        for name in parts[:-1]:
            fd = open_dir(fd, name)
            fds.append(fd)
        yield fd
    finally:
        for fd in reversed(fds):
            os.close(fd)


def lstat(dir_fd: int, name: str) -> os.stat_result:
    return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)


def open_file(dir_fd: int, name: str) -> int:
    """A regular file ``name`` in ``dir_fd`` opened for reading: no link followed, never blocking.

    Raises:
        NotConfined: ``name`` is a link (or the open met something that is not a regular file).
    """
    try:
        fd = os.open(name, FILE_FLAGS, dir_fd=dir_fd)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise NotConfined(e.errno, "symbolic link") from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotConfined(errno.EINVAL, "not a regular file")
    return fd


def remove_if_same(root_fd: int, parts: tuple[str, ...], ident: Identity) -> bool:
    """Delete ``parts`` if it is still the file with identity ``ident``; ``False`` when it changed
    (a new file under the same name stays for the next scan) or vanished."""
    try:
        with parent(root_fd, parts) as fd:
            if identity(lstat(fd, parts[-1])) != ident:
                return False
            os.unlink(parts[-1], dir_fd=fd)
            return True
    except (FileNotFoundError, NotConfined):
        return False


def link(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """A second name ``dst`` for the entry ``src`` itself (a link is linked, not followed). A folder
    cannot be linked (``EPERM``), so whatever is swapped in, a folder is never moved this way;
    ``EXDEV`` across file systems."""
    os.link(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)


def unlink_if(dir_fd: int, name: str, inode: tuple[int, int] | None) -> None:
    """Remove ``name`` if it is (still) the entry with that device and inode. ``unlink`` never
    removes a folder, so a folder swapped in meanwhile stays whatever happens."""
    try:
        st = lstat(dir_fd, name)
        if inode is None or (st.st_dev, st.st_ino) == inode:
            os.unlink(name, dir_fd=dir_fd)
    except FileNotFoundError:
        pass  # gone already (moved by a rename where links are not supported)


def rename(src_fd: int, src: str, dst_fd: int, dst: str) -> None:
    """Rename one entry between two open folders (``EXDEV`` across file systems: never copied here)."""
    os.rename(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd)
