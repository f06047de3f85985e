"""``edgerev daemon run`` in a process of its own, for tests that send it real signals.

Tests wait on what the daemon says (a line of its log), never on the clock: a reader thread collects
the lines and wakes every waiter on each one. The bound on a wait only applies when something is truly
broken (a loaded machine makes everything slower, never wrong).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

LIMIT = 600.0  # seconds before a wait gives up: far beyond any healthy run, even on a loaded machine


class Running:
    """The daemon on ``config_path``; a context manager that kills it if the test leaves early.

    ``command``: another command line that runs the daemon (a script that hooks into it first).
    """

    def __init__(self, config_path: Path, poll: float = 0.2, command: list[str] | None = None) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("JOURNAL_STREAM", None)
        command = command or [sys.executable, "-m", "edgerev", "daemon", "run", "--config", str(config_path),
                              "--poll", str(poll)]
        self.proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                                     text=True, errors="replace", env=env)
        self.lines: list[str] = []
        self._ended = False
        self._changed = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def _read(self) -> None:
        for line in self.proc.stderr:
            with self._changed:
                self.lines.append(line.rstrip("\n"))
                self._changed.notify_all()
        with self._changed:
            self._ended = True
            self._changed.notify_all()

    def wait_for(self, text: str, after: int = 0) -> int:
        """Index of the first log line from ``after`` on that contains ``text``, once it is written."""
        deadline = time.monotonic() + LIMIT
        with self._changed:
            while True:
                for i in range(after, len(self.lines)):
                    if text in self.lines[i]:
                        return i
                left = deadline - time.monotonic()
                if self._ended or left <= 0:
                    break
                self._changed.wait(left)
        self.proc.kill()
        pytest.fail(f"the daemon never logged {text!r} ({'it exited' if self._ended else 'gave up'}):\n"
                    + "\n".join(self.lines[-40:]))

    def count(self, text: str) -> int:
        with self._changed:
            return sum(text in line for line in self.lines)

    def send(self, signum: int) -> None:
        self.proc.send_signal(signum)

    def finish(self) -> int:
        """Wait for the process to exit (its log read to the end); its exit status."""
        try:
            code = self.proc.wait(timeout=LIMIT)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail("the daemon did not exit:\n" + "\n".join(self.lines[-40:]))
        self._reader.join(LIMIT)
        return code

    def log(self) -> str:
        with self._changed:
            return "\n".join(self.lines)

    def __enter__(self) -> Running:
        return self

    def __exit__(self, *exc) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self._reader.join(LIMIT)
