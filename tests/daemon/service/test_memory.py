"""Freed memory goes back to the system after every cycle (:mod:`edgerev_daemon.service.memory`): the daemon's
RSS follows what it holds, not the largest job it ever ran."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from edgerev_daemon.learning.jobs import JobOutcome
from edgerev_daemon.service import daemon as service
from edgerev_daemon.service import memory
from edgerev_daemon.service.daemon import Daemon
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import drop, make_config


def _rss() -> int:
    return int(re.search(r"^VmRSS:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) * 1024


def test_a_cycle_gives_memory_back_after_its_job(tmp_path, monkeypatch):
    events = []

    def job(config, store, blobs, job, start, base_batch, halt, report=None):
        events.append("job")
        return JobOutcome("stopped", tmp_path / "run", "stopped at step 1 of 2")

    monkeypatch.setattr(service, "run_job", job)
    monkeypatch.setattr(service, "give_back", lambda: events.append("give back"))
    config, _ = make_config(tmp_path)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().job is None and events == ["give back"]  # a cycle without a job gives back too
        drop(config, 100, range(2))  # SMALL's min_new_samples: a job is due after this ingest
        assert d.cycle().job["status"] == "stopped"
    assert events == ["give back", "job", "give back"]


@pytest.mark.skipif(memory.MALLOC_TRIM is None or not Path("/proc/self/status").exists(),
                    reason="glibc's malloc_trim and /proc are Linux's")
def test_freed_heap_memory_leaves_the_rss():
    """Blocks freed under one still in use stay in the heap (``free`` only trims its top): the RSS keeps
    them until :func:`give_back`."""
    blocks = [b"\1" * 100_000 for _ in range(800)]  # 80 MB of heap blocks (each below the mmap threshold)
    keep = b"\2" * 100_000  # allocated after them: the top of the heap stays in use
    memory.give_back()
    held = _rss()
    del blocks
    freed = _rss()
    memory.give_back()
    after = _rss()
    assert held - freed < 20_000_000, "free() gave the blocks back by itself: this test would test nothing"
    assert freed - after > 60_000_000, (held, freed, after)
    assert keep[0] == 2


def test_give_back_does_nothing_without_glibc(monkeypatch):
    monkeypatch.setattr(memory, "MALLOC_TRIM", None)  # musl, macOS: no malloc_trim among the loaded symbols
    memory.give_back()
