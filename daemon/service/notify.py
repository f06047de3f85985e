"""systemd's notification protocol, written to ``$NOTIFY_SOCKET`` directly (no dependency).

Under ``Type=notify`` the service says ``READY=1`` once it holds its data directory and serves,
``STATUS=...`` after every cycle (what ``systemctl status edgerev`` shows), ``STOPPING=1`` when a stop
begins, and ``WATCHDOG=1`` while it is alive: from the loop between cycles and from the checks that
training and ingest make at every step and batch, so a wedged loop stops the pings and systemd restarts
the service after ``WatchdogSec=``. Outside systemd (no ``NOTIFY_SOCKET``) every call does nothing.

The socket is a datagram Unix socket; a name starting with ``@`` is in the abstract namespace. The
watchdog interval comes from ``WATCHDOG_USEC`` (when ``WATCHDOG_PID`` is unset or names this process);
pings are sent at most every half interval, so calling :meth:`Notifier.watchdog` at every training step
costs one clock read.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable, Mapping


class Notifier:
    """The service manager's socket, if there is one.

    Args:
        environ: where ``NOTIFY_SOCKET``, ``WATCHDOG_USEC`` and ``WATCHDOG_PID`` are read (tests pass their own).
        clock: monotonic seconds, for the watchdog's rate.
    """

    def __init__(self, environ: Mapping[str, str] = os.environ,
                 clock: Callable[[], float] = time.monotonic) -> None:
        path = environ.get("NOTIFY_SOCKET", "")
        self.address = ("\0" + path[1:]) if path.startswith("@") else path
        self.clock = clock
        usec = environ.get("WATCHDOG_USEC", "")
        pid = environ.get("WATCHDOG_PID", "")
        mine = not pid or (pid.isdigit() and int(pid) == os.getpid())
        self.watchdog_seconds = int(usec) / 1e6 if usec.isdigit() and int(usec) > 0 and mine else None
        self._last_ping = float("-inf")
        self.sent = 0
        self.failed = 0

    @property
    def enabled(self) -> bool:
        return bool(self.address)

    def send(self, **fields: str) -> bool:
        """Send ``KEY=value`` lines (keys upper-cased); False outside systemd or when the send failed
        (a notification is advice: its failure never stops the service)."""
        if not self.address:
            return False
        text = "\n".join(f"{k.upper()}={' '.join(str(v).split())}" for k, v in fields.items())
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
                s.sendto(text.encode("utf-8", "backslashreplace"), self.address)
        except OSError:
            self.failed += 1
            return False
        self.sent += 1
        return True

    def ready(self, status: str) -> bool:
        return self.send(ready="1", status=status)

    def status(self, status: str) -> bool:
        return self.send(status=status)

    def stopping(self, status: str = "stopping") -> bool:
        return self.send(stopping="1", status=status)

    def watchdog(self) -> bool:
        """``WATCHDOG=1``, at most every half interval; False when none was due or there is no watchdog."""
        if self.watchdog_seconds is None:
            return False
        now = self.clock()
        if now - self._last_ping < self.watchdog_seconds / 2:
            return False
        self._last_ping = now
        return self.send(watchdog="1")
