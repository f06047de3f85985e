"""systemd notifications on a real datagram socket: READY, STATUS, STOPPING and a rate-limited watchdog."""

from __future__ import annotations

import os
import socket
import threading

import pytest

from edgerev_daemon.service.notify import Notifier
from tests.daemon.conftest import Clock, image_bytes, make_config, write


@pytest.fixture
def listener(tmp_path):
    path = tmp_path / "notify.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(str(path))
    s.settimeout(600)  # a bound for a broken run only: each message is awaited, never a fixed time
    yield path, s
    s.close()


def received(s: socket.socket) -> dict[str, str]:
    return dict(line.split("=", 1) for line in s.recv(4096).decode().splitlines())


def test_fields_reach_the_socket_one_line_each(listener):
    path, s = listener
    n = Notifier({"NOTIFY_SOCKET": str(path)})
    assert n.enabled and n.ready("serving /data\nwith a newline")
    assert received(s) == {"READY": "1", "STATUS": "serving /data with a newline"}
    assert n.status("ingest 3 stored") and received(s) == {"STATUS": "ingest 3 stored"}
    assert n.stopping() and received(s) == {"STOPPING": "1", "STATUS": "stopping"}


def test_an_abstract_socket_name(tmp_path):
    name = f"edgerev-test-{os.getpid()}"
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.bind("\0" + name)
        s.settimeout(600)
        assert Notifier({"NOTIFY_SOCKET": "@" + name}).status("hello")
        assert received(s) == {"STATUS": "hello"}


def test_the_watchdog_pings_at_half_its_interval(listener):
    path, s = listener
    clock = Clock(now=100.0)
    n = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "10000000"}, clock=clock)
    assert n.watchdog_seconds == 10.0
    assert n.watchdog() and received(s) == {"WATCHDOG": "1"}
    clock.advance(4.9)
    assert not n.watchdog()  # called at every training step: most calls send nothing
    clock.advance(0.1)
    assert n.watchdog() and received(s) == {"WATCHDOG": "1"}
    other = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "10000000", "WATCHDOG_PID": "1"})
    assert other.watchdog_seconds is None and not other.watchdog()  # meant for another process


def test_outside_systemd_or_with_a_dead_socket_nothing_fails(tmp_path):
    assert not Notifier({}).enabled and not Notifier({}).ready("x") and not Notifier({}).watchdog()
    gone = Notifier({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens.sock")})
    assert not gone.ready("x") and gone.failed == 1


def test_the_daemon_says_ready_status_and_stopping(listener, tmp_path):
    """serve() in this thread (SQLite stays in its thread); a reader thread stops it once a cycle reported."""
    from edgerev_daemon.service.daemon import Daemon

    path, s = listener
    config = make_config(tmp_path)
    for i in range(6):
        write(config.inbox_path / "a" / f"{i}.png", image_bytes(i))
    notifier = Notifier({"NOTIFY_SOCKET": str(path), "WATCHDOG_USEC": "600000000"})
    messages: list[dict[str, str]] = []
    with Daemon(config, clock=Clock(), notifier=notifier) as daemon:
        def read() -> None:
            while not any("STOPPING" in m for m in messages):
                messages.append(received(s))
                if "STATUS" in messages[-1] and "READY" not in messages[-1]:
                    daemon.request_stop()  # a flag and a byte: what a signal handler does

        reader = threading.Thread(target=read)
        reader.start()
        daemon.serve(poll_seconds=3600)
        reader.join(600)
    assert messages[0]["READY"] == "1" and messages[0]["STATUS"].startswith("serving ")
    assert {"WATCHDOG": "1"} in messages
    status = next(m["STATUS"] for m in messages if "STATUS" in m and "READY" not in m)
    assert status.startswith("ingest 6 stored; next job: 6 new samples")
    assert messages[-1] == {"STOPPING": "1", "STATUS": "stopping"}
