"""Signals: handlers that only set a flag and wake the loop; bursts coalesced; SIGTERM honoured between
ingest batches and after the training step under way; a storm from another process never wedges the loop.

The in-process tests send real signals to the test process itself (``os.kill(os.getpid(), ...)``) from
inside the code under test, so the moment a signal lands is fixed, not left to the scheduler.
"""

from __future__ import annotations

import inspect
import json
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from edgerev_daemon.service.daemon import CycleReport, Daemon
from edgerev_daemon.service.signals import Requests, Wakeup, handling
from tests.daemon.conftest import Clock
from tests.daemon.running import LIMIT, Running
from tests.daemon.service.test_service import drop, epochs, make_config


def _handled(d: Daemon):
    return handling({signal.SIGTERM: d.request_stop, signal.SIGHUP: d.request_reload}, wakeup=d.requests.wakeup)


def _sigterm_self(d: Daemon) -> None:
    """SIGTERM to this process, returning once its handler has set the stop flag. Which thread takes the
    signal, and when it runs, is the scheduler's choice: on a loaded machine the handler could run only after
    the code under test had passed the point the signal was meant to land in."""
    os.kill(os.getpid(), signal.SIGTERM)
    deadline = time.monotonic() + LIMIT
    while not d.requests.stop:
        assert time.monotonic() < deadline, "SIGTERM was never handled"
        time.sleep(0.001)


def test_a_wakeup_is_never_lost_and_never_blocks():
    w = Wakeup()
    try:
        assert w.wait(0) is False
        for _ in range(200_000):  # far beyond a pipe's capacity: notify must neither block nor fail
            w.notify()
        assert w.wait(LIMIT) is True  # returns at once: the wake-up came before the wait
        assert w.wait(0) is False  # one wait drained them all
    finally:
        w.close()
    w.notify()  # after close (a late signal): nothing happens


def test_requests_set_only_flags():
    r = Requests()
    try:
        r.ask_reload()
        r.ask_reload()
        assert r.reload and not r.stop
        r.ask_stop()
        assert r.stop and r.wakeup.wait(LIMIT) and not r.wakeup.wait(0)
    finally:
        r.close()


def test_handlers_are_restored_and_sighup_can_be_ignored_after():
    """In a fresh process: the test process's own threads (started by earlier tests, without the mask) must
    not be where the signal lands."""
    code = """
import os, signal
from edgerev_daemon.service.signals import Requests, handling
before = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGHUP)
r = Requests()
with handling({signal.SIGTERM: r.ask_stop, signal.SIGHUP: r.ask_reload}, wakeup=r.wakeup,
             ignore_after=(signal.SIGHUP,)):
    os.kill(os.getpid(), signal.SIGHUP)
    assert r.wakeup.wait(600) and r.reload  # received by the signal thread, which wakes the loop
assert signal.getsignal(signal.SIGTERM) == before[0]
assert signal.getsignal(signal.SIGHUP) == signal.SIG_IGN
r.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr


def test_a_signal_landing_in_a_thread_started_before_still_wakes_the_loop_at_once():
    """A thread started before the signals were blocked (a BLAS pool starts when numpy is imported) can
    receive one; its Python handler then waits for the main thread's next bytecode, so the loop must be
    woken by the interpreter itself (it once waited out the whole poll interval before stopping). The
    signal is sent once the main thread sleeps in the wait (read from /proc), to the bystander itself."""
    code = f"""
import signal, threading, time
from edgerev_daemon.service.signals import Requests, handling
main = threading.get_native_id()

def asleep() -> bool:
    with open(f"/proc/self/task/{{main}}/wchan") as f:
        where = f.read()
    if where not in ("", "0"):
        return "poll" in where
    with open(f"/proc/self/task/{{main}}/stat") as f:  # no wchan here: sleeping is the best sign
        return f.read().rsplit(")", 1)[1].split()[0] == "S"

def bystander():
    while not asleep():
        time.sleep(0.001)
    signal.pthread_kill(threading.get_ident(), signal.SIGTERM)  # lands in this thread, by construction

threading.Thread(target=bystander, daemon=True).start()  # before the block: the signals stay unblocked in it
r = Requests()
with handling({{signal.SIGTERM: r.ask_stop}}, wakeup=r.wakeup):
    assert r.wakeup.wait({LIMIT}), "the loop was not woken"
    assert r.stop
r.close()
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=4 * LIMIT)
    assert done.returncode == 0, done.stderr


def test_signals_are_received_in_a_thread_not_by_a_handler_in_the_step_under_way():
    """The signals are blocked in this thread and taken by sigwait in another: no handler frame can nest
    inside the code running here, however many signals arrive."""
    r = Requests()
    with handling({signal.SIGTERM: r.ask_stop, signal.SIGHUP: r.ask_reload}, wakeup=r.wakeup,
                  ignore_after=(signal.SIGHUP,)):
        assert {signal.SIGTERM, signal.SIGHUP} <= signal.pthread_sigmask(signal.SIG_BLOCK, [])
        depth = []

        def deep(n: int) -> None:  # what a training step's stack looks like to a handler
            if n:
                deep(n - 1)
            else:
                for _ in range(5000):
                    os.kill(os.getpid(), signal.SIGHUP)
                depth.append(len(inspect.stack()))

        deep(200)
        assert r.wakeup.wait(600) and r.reload and not r.stop
    assert signal.SIGHUP not in signal.pthread_sigmask(signal.SIG_BLOCK, [])  # the mask is restored
    r.close()


def test_a_burst_of_sighup_is_one_reload(tmp_path, monkeypatch, caplog):
    config, path = make_config(tmp_path)
    with Daemon(config, config_path=path, clock=Clock()) as d, _handled(d):
        for _ in range(2000):
            os.kill(os.getpid(), signal.SIGHUP)
        # the signal thread takes them when it runs: wait until it has (the loop read the flag too early once)
        assert d.requests.wakeup.wait(LIMIT) and d.requests.reload
        cycles = []
        monkeypatch.setattr(d, "cycle", lambda: cycles.append(1) or d.request_stop() or CycleReport())
        with caplog.at_level(logging.INFO, logger="edgerev.daemon"):
            d.serve(poll_seconds=LIMIT)
    assert cycles == [1]
    assert [r.getMessage() for r in caplog.records].count(f"config reloaded from {path}") == 1


def test_sigterm_during_ingest_stops_between_batches(tmp_path, monkeypatch):
    from edgerev_daemon.storage import store

    config, _ = make_config(tmp_path, ingest={"settle_seconds": 0.0, "batch_files": 5})
    drop(config, 40, range(2))
    real = store.Store.record_batch
    running = []

    def then_sigterm(self, *args, **kwargs):  # the first batch commits, then the signal lands
        out = real(self, *args, **kwargs)
        _sigterm_self(running[0])
        return out

    monkeypatch.setattr(store.Store, "record_batch", then_sigterm)
    with Daemon(config, clock=Clock()) as d, _handled(d):
        running.append(d)
        report = d.cycle()
    assert report.ingest["stopped"] and report.ingest["accepted"] == 5 and report.job is None, report.ingest
    assert len(list(config.inbox_path.rglob("*.png"))) == 35  # the rest waits for the next start
    monkeypatch.setattr(store.Store, "record_batch", real)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == 35 and d.store.count_samples() == 40


def test_sigterm_during_training_stops_after_the_step_under_way(tmp_path, monkeypatch):
    """The trainer polls the stop flag after every step: a SIGTERM costs at most the step it lands in
    (and its checkpoint), which is what the unit's TimeoutStopSec has to cover."""
    import edgerev.train.trainer as trainer

    config, _ = make_config(tmp_path, training=epochs(50))
    drop(config, 160, range(2))
    real, calls, running = trainer.train_step, [], []

    def sigterm_in_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            _sigterm_self(running[0])  # lands in the middle of the step
        return real(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", sigterm_in_step_3)
    with Daemon(config, clock=Clock()) as d, _handled(d):
        running.append(d)
        job = d.cycle().job
    assert job == {"job": 1, "status": "stopped", "reason": "stopped at step 3 of 200"}, job
    latest = Path(config.data_dir) / "jobs" / "job-00001" / "checkpoints" / "latest.json"
    assert json.loads(latest.read_text())["step"] == 3 and len(calls) == 3


STORM = """
import os, signal, sys
pid, sent = int(sys.argv[1]), 0
signal.signal(signal.SIGTERM, lambda *a: sys.exit(0))
try:
    while True:
        os.kill(pid, signal.SIGHUP)
        sent += 1
        if sent == 1000:
            print("storming", flush=True)
finally:
    print(sent, flush=True)
"""


@pytest.mark.slow
def test_a_storm_of_sighup_from_another_process_never_wedges_the_loop(tmp_path):
    """SIGHUP without pause from another process: the daemon goes on ingesting and starts its job, a
    SIGTERM in the middle of the storm stops it at a step boundary, and the reloads are coalesced."""
    config, path = make_config(tmp_path, training=epochs(1000))
    with Running(path) as d:
        d.wait_for("serving")
        storm = subprocess.Popen([sys.executable, "-c", STORM, str(d.pid)], stdout=subprocess.PIPE, text=True)
        try:
            assert storm.stdout.readline() == "storming\n"
            drop(config, 160, range(2))
            # ingested (in one cycle or more) and training, under the storm: its first report comes between steps
            d.wait_for("job 1: epoch 1/")
            d.send(signal.SIGTERM)
            d.wait_for("it resumes at the next start")
            d.wait_for("edgerev.daemon: stopped")
        finally:
            storm.terminate()  # before the daemon is reaped: its pid cannot have been reused yet
            sent = int(storm.communicate(timeout=LIMIT)[0].split()[-1])
        assert d.finish() == 0, d.log()[-3000:]
        reloads = d.count("config reloaded")
    assert "stopped at step" in d.log()
    assert sent >= 1000 and 1 <= reloads < sent, (sent, reloads)
