"""One daemon per data directory: a second one, in another process, is refused with the holder's pid;
a holder killed with SIGKILL leaves no stale lock behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from edgerev_daemon import DataDirLock, LockError

HOLD = """
import sys
from edgerev_daemon.service.lock import DataDirLock
lock = DataDirLock(sys.argv[1]).acquire()
print("locked", flush=True)
sys.stdin.read()  # hold until the test closes stdin or kills us
"""

TRY = """
import sys
from edgerev_daemon import DataDirLock, LockError
try:
    DataDirLock(sys.argv[1]).acquire()
except LockError as e:
    print(e)
    sys.exit(3)
print("acquired")
"""


def _try_in_another_process(data_dir) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", TRY, str(data_dir)], capture_output=True, text=True, timeout=60)


def test_second_instance_in_another_process_is_refused(tmp_path):
    data = tmp_path / "data"
    with DataDirLock(data):
        r = _try_in_another_process(data)
    assert r.returncode == 3, r.stderr
    assert r.stdout.strip() == f"another edgerev daemon (pid {os.getpid()}) holds {data}"
    assert _try_in_another_process(data).stdout.strip() == "acquired"  # released on exit


def test_lock_dies_with_a_killed_holder(tmp_path):
    data = tmp_path / "data"
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(LockError, match=f"pid {holder.pid}"):
            DataDirLock(data).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()
    with DataDirLock(data) as lock:  # the lock file is still there, the lock is not
        assert lock.held and data.joinpath("daemon.lock").read_text().strip() == str(os.getpid())
    assert not lock.held


def test_same_process_second_handle_is_refused_too(tmp_path):
    first = DataDirLock(tmp_path).acquire()
    assert first.acquire() is first  # re-acquiring one's own handle is a no-op
    with pytest.raises(LockError, match="another edgerev daemon"):
        DataDirLock(tmp_path).acquire()
    first.release()
    DataDirLock(tmp_path).acquire().release()
