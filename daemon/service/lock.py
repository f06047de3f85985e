"""One daemon per data directory: an exclusive ``flock`` on ``DATA_DIR/daemon.lock``.

The kernel drops the lock when the process ends, however it ends (``kill -9``, a power cut), so a
stale lock file never keeps the next daemon out: only a live holder does. The holder writes its pid
into the file for the refusal message. The file is never deleted (deleting it would let a second
process lock a new file while the first still holds the old one). ``flock`` is not reliable on
network file systems: keep the data directory on a local disk.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

from edgerev_daemon.errors import LockError
from edgerev_daemon.layout import Layout, make_dirs


class DataDirLock:
    """``with DataDirLock(data_dir): ...``, or :meth:`acquire` and :meth:`release`."""

    def __init__(self, data_dir: str | Path) -> None:
        self.data_dir = Path(data_dir)
        self.path = Layout(self.data_dir).lock
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def acquire(self) -> DataDirLock:
        """Take the lock without waiting.

        Raises:
            LockError: another process holds it (the message names its pid).
        """
        if self._fd is not None:
            return self
        make_dirs(self.data_dir)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            _flock_soon(fd)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LockError(f"another edgerev daemon (pid {holder}) holds {self.data_dir}") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._fd = fd
        return self

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # closing the only descriptor releases the flock

    def __enter__(self) -> DataDirLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()


def _flock_soon(fd: int, tries: int = 5, pause: float = 0.05) -> None:
    """Take the exclusive lock, trying a few times: a ``status`` reader probes the lock with a shared
    one for an instant, which must not make a starting daemon refuse to start."""
    import time

    for k in range(tries):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if k == tries - 1:
                raise
            time.sleep(pause)
