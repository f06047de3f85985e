"""Signal handling that cannot wedge the service: flags plus a self-pipe.

A Python signal handler runs in the main thread between two bytecodes of whatever that thread was doing,
and a new signal can interrupt the handler itself. A handler that takes a lock (``threading.Event.set``,
``logging``) therefore deadlocks on the lock its own thread already holds when the signal lands inside
``Event.clear``/``Event.wait`` or a log call; every further signal nests one more blocked handler until
``RecursionError``. A burst of SIGHUP did exactly that to the service.

So the handlers here only assign a boolean and write one byte to a non-blocking pipe: no lock, no
allocation that can block, no logging. And they do not run as Python signal handlers in the thread that
trains: :func:`handling` blocks the signals and one thread receives them with ``sigwait``, calling the
handler there. A Python handler can be re-entered at its first bytecode by the next signal, so a storm
from another process nested handler frames on top of the training step under way until RecursionError
(seen in the storm test); ``sigwait`` takes one signal at a time and nests nothing.
The loop waits on the read end with ``poll`` and a timeout, drains it, and does the logging and the
reload itself. A burst of N signals leaves at most a pipe full of bytes, drained in one read: the reload
it asks for runs once (coalesced), and SIGTERM's flag is seen at the next check whatever came before it.
"""

from __future__ import annotations

import os
import select
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType


class Wakeup:
    """A self-pipe: :meth:`notify` (safe in a signal handler) makes the next :meth:`wait` return at once."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)

    @property
    def write_fd(self) -> int:
        """The pipe's non-blocking write end (for ``signal.set_wakeup_fd``)."""
        return self._write

    def notify(self) -> None:
        """Wake the waiter; takes no lock and never blocks (a full pipe already holds a wake-up)."""
        try:
            os.write(self._write, b"\0")
        except (BlockingIOError, OSError):  # full (a wake-up is pending) or closed (the daemon is gone)
            pass

    def wait(self, timeout: float) -> bool:
        """Sleep up to ``timeout`` seconds or until notified; drain every pending wake-up.

        Returns:
            True when woken by :meth:`notify` (once, however many notifications piled up).
        """
        poller = select.poll()  # not select.select: that one fails on a descriptor numbered 1024 or above
        poller.register(self._read, select.POLLIN)
        ready = poller.poll(max(0.0, timeout) * 1000.0)
        woken = False
        while ready:
            try:
                woken |= bool(os.read(self._read, 4096))
            except BlockingIOError:
                break
        return woken

    def close(self) -> None:
        for fd in (self._read, self._write):
            try:
                os.close(fd)
            except OSError:
                pass
        self._read = self._write = -1


class Requests:
    """What the signal handlers ask of the service, and the pipe that wakes it to look.

    Created before the service opens its data directory, so that a signal during the start (recovery can
    take a while) is kept for the loop instead of killing the process with the default action.
    """

    def __init__(self) -> None:
        self.stop = False
        self.reload = False
        self.wakeup = Wakeup()

    def ask_stop(self) -> None:
        """Ask the service to stop (safe in a signal handler: a flag and a byte, no lock)."""
        self.stop = True
        self.wakeup.notify()

    def ask_reload(self) -> None:
        """Ask the service to re-read its config (safe in a signal handler)."""
        self.reload = True
        self.wakeup.notify()

    def close(self) -> None:
        self.wakeup.close()


Handler = Callable[[], None]


@contextmanager
def handling(handlers: dict[signal.Signals, Handler], *, wakeup: Wakeup,
             ignore_after: tuple[signal.Signals, ...] = ()) -> Iterator[None]:
    """Install ``handlers`` (each called with no argument; it must only set flags and notify a
    :class:`Wakeup`) for the block, then put the previous ones back.

    Args:
        handlers: what each signal calls.
        ignore_after: signals ignored after the block instead of getting their previous handler back:
            a reload asked for while the service is already stopping has nothing left to reload, and
            the default action of SIGHUP would kill a process that is exiting cleanly.
        wakeup: woken by the interpreter itself (``signal.set_wakeup_fd``) whichever thread a signal
            lands in. Threads started before the block keep the signals unblocked (a BLAS library starts
            its pool when numpy is imported): a signal delivered to one of them runs the Python handler
            in the main thread only once that thread wakes, so without this a stop waited out the
            whole poll interval. Required: a caller that left it out once (a test in a process where an
            earlier test had left a thread running) slept through a burst of 2000 SIGHUP for its whole
            600 s wait.

    Also turns on ``siginterrupt(False)`` so a signal does not make a system call of another thread (the
    status page's) fail with EINTR; the main thread's ``poll`` is woken all the same (Linux never restarts
    it) and the byte the handler writes makes the next one return at once.
    """
    previous = {}
    waiter = None
    blocked = None
    old_fd = None
    try:
        for signum, fn in handlers.items():
            previous[signum] = signal.signal(signum, _call(fn))
            signal.siginterrupt(signum, False)
        old_fd = signal.set_wakeup_fd(wakeup.write_fd, warn_on_full_buffer=False)
        # Then take the signals off every thread started from here on (threads inherit the mask) and
        # receive them in one thread with sigwait: no handler frame runs at all, so a storm of thousands
        # of signals cannot nest handlers inside the training step under way (a Python handler can be
        # re-entered at its first bytecode, and a storm nested them into a RecursionError). The Python
        # handlers above stay for a thread started earlier that a signal may still reach.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, set(handlers))
        waiter = _Waiter(handlers)
        waiter.start()
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, signal.SIG_IGN if signum in ignore_after else old)
        if old_fd is not None:
            signal.set_wakeup_fd(old_fd)
        if waiter is not None:
            waiter.stop()
        if blocked is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


class _Waiter(threading.Thread):
    """Receives the blocked signals with ``sigwait`` and calls their handlers, one at a time."""

    def __init__(self, handlers: dict[signal.Signals, Handler]) -> None:
        super().__init__(name="edgerev-signals", daemon=True)
        self.handlers = handlers
        self._stopping = False

    def run(self) -> None:
        while True:
            signum = signal.sigwait(set(self.handlers))
            if self._stopping:
                return
            self.handlers[signal.Signals(signum)]()

    def stop(self) -> None:
        self._stopping = True
        signal.pthread_kill(self.ident, next(iter(self.handlers)))  # wakes its sigwait; consumed there
        self.join()


def _call(fn: Handler) -> Callable[[int, FrameType | None], None]:
    def handler(signum: int, frame: FrameType | None) -> None:
        fn()

    return handler
