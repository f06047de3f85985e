"""A piece of work in a child process that a stop ends at once (the ONNX export, a stage profile).

Some calls take longer than a stop may (several seconds to minutes on a small CPU) and cannot be asked
a stop flag in between: ``torch.onnx.export``, the measurement of a model's stage profile. The daemon runs
them as ``python -m edgerev_daemon.<module>`` and waits, asking its stop flag meanwhile (which also pings
systemd's watchdog); a stop kills the child and raises :class:`~edgerev_daemon.errors.Stopped`. The child
writes its result atomically, so a killed one leaves nothing half written. It is spawned, not forked: a
fork of a process whose OpenMP pool and other threads have run is not safe. It also ends by itself when
the daemon dies (kill -9): :func:`end_with_parent` watches its standard input, whose other end only the
daemon holds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

from edgerev_daemon.errors import Stopped

POLL_SECONDS = 0.2  # how often the wait asks the stop flag


def run(command: list[str], log: Path, stop: Callable[[], bool], what: str,
        lines: Callable[[str], None] | None = None) -> int:
    """Run ``command`` with its standard error in ``log``; its exit status.

    Args:
        lines: given each whole line the child writes to its standard error, as it comes (the daemon logs a long
            child's progress; None: the lines stay in ``log`` alone).

    Raises:
        Stopped: ``stop()`` said so before the child ended (``what`` names the phase); the child is killed.
    """
    if stop():
        raise Stopped(what)
    with open(log, "wb") as err:
        child = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=err)
    seen = 0  # bytes of the log passed on to ``lines``

    def relay() -> None:
        nonlocal seen
        if lines is None:
            return
        with open(log, "rb") as f:
            f.seek(seen)
            text = f.read()
        whole = text[:text.rfind(b"\n") + 1]  # a line still being written waits for its end
        seen += len(whole)
        for line in whole.decode(errors="replace").splitlines():
            lines(line)

    try:
        while True:
            try:
                code = child.wait(POLL_SECONDS)
                relay()
                return code
            except subprocess.TimeoutExpired:
                relay()
                if stop():
                    raise Stopped(what) from None
    finally:
        if child.poll() is None:  # stopped (or anything else raised here): the child goes with it
            child.kill()
            child.wait()
        child.stdin.close()


def tail(log: Path, lines: int = 5) -> str:
    """The last lines of a child's error output, on one line."""
    try:
        return " | ".join(log.read_text(errors="replace").strip().splitlines()[-lines:])
    except OSError:
        return ""


def end_with_parent() -> None:
    """In the child: exit when the daemon's end of standard input closes (the daemon died)."""

    def watch() -> None:
        sys.stdin.buffer.read()
        os._exit(3)

    threading.Thread(target=watch, daemon=True).start()


def run_main(main: Callable[[], int], errors: type[BaseException]) -> None:
    """In the child: ``main()``'s status, or 1 with ``edgerev: <reason>`` on stderr for one of ``errors`` (the
    daemon reads that line as the reason); then :func:`finish`."""
    try:
        status = main()
    except errors as e:
        print(f"edgerev: {e}", file=sys.stderr)
        status = 1
    finish(status)


def finish(status: int) -> None:
    """In the child: exit with ``status`` (not through sys.exit: the watching thread cannot be joined)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)
