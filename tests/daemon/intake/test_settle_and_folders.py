"""Settling by observation (any clock), and inbox folders that cannot be listed (reported once)."""

from __future__ import annotations

import errno
import os
from dataclasses import replace

import pytest

from edgerev_daemon import EventKind, ingest_inbox
from edgerev_daemon.intake import confined
from edgerev_daemon.intake.watch import InboxWatch
from edgerev_daemon.service.status import format_status, status

from ..conftest import image_bytes

YEAR = 365 * 86400.0


def settling(datadir, seconds: float = 30.0):
    return replace(datadir.config, ingest=replace(datadir.config.ingest, settle_seconds=seconds))


@pytest.mark.parametrize("mtime_offset", [YEAR, -YEAR, 0.0])
def test_a_file_settles_whatever_its_modification_time_says(datadir, mtime_offset):
    cfg, watch = settling(datadir), InboxWatch()
    path = datadir.drop("cat/a.png", image_bytes(1))
    os.utime(path, (datadir.clock() + mtime_offset,) * 2)  # from the future, the far past, or now
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch)
    assert (r.accepted, r.unsettled) == (0, 1)
    datadir.clock.advance(29)
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).accepted == 0
    datadir.clock.advance(1)
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).accepted == 1


def test_a_file_still_growing_waits_until_it_stays_the_same(datadir):
    cfg, watch = settling(datadir), InboxWatch()
    path = datadir.drop("cat/a.png", image_bytes(2)[:50])
    os.utime(path, (1.0, 1.0))  # an old time, as a copy that keeps times would show
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).unsettled == 1
    datadir.clock.advance(30)
    path.write_bytes(image_bytes(2))  # the copy went on meanwhile
    os.utime(path, (1.0, 1.0))
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).accepted == 0
    datadir.clock.advance(30)
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch)
    assert (r.accepted, r.quarantined) == (1, [])


def test_a_clock_going_backwards_restarts_the_wait(datadir):
    cfg, watch = settling(datadir), InboxWatch()
    datadir.drop("cat/a.png", image_bytes(3))
    ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch)
    datadir.clock.advance(-3600)
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).accepted == 0
    datadir.clock.advance(30)
    assert ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch).accepted == 1


def test_one_call_waits_once_and_ingests_settled_files(datadir):
    cfg = settling(datadir)
    datadir.drop("cat/a.png", image_bytes(4))
    waits = []

    def wait(seconds):  # the injected sleep: the daemon's clock moves on
        waits.append(seconds)
        datadir.clock.advance(seconds)

    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, wait=wait)
    assert (r.accepted, r.unsettled, waits) == (1, 0, [30.0])
    datadir.drop("cat/b.png", image_bytes(5))
    watch = InboxWatch()
    ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch, wait=wait)
    datadir.drop("cat/c.png", image_bytes(6))
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch, wait=wait)
    assert r.unsettled == 1 and len(waits) == 2  # a long-running watch waits only on its first scan


def fail_to_open(monkeypatch, name: str, error: int) -> None:
    real = confined.open_dir

    def open_dir(parent_fd, folder):
        if folder == name:
            raise OSError(error, os.strerror(error))
        return real(parent_fd, folder)

    monkeypatch.setattr(confined, "open_dir", open_dir)


def test_an_unreadable_folder_is_reported_once_and_again_after_it_cleared(datadir, monkeypatch):
    datadir.drop("cat/locked/a.png", image_bytes(7))
    datadir.drop("cat/b.png", image_bytes(8))
    watch = InboxWatch()
    fail_to_open(monkeypatch, "locked", errno.EACCES)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch)
    assert r.accepted == 1 and r.problems == [("cat/locked", "cannot open the folder: Permission denied")]
    for _ in range(3):  # not repeated at every poll
        assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch).problems == []
    errors = [e.message for e in datadir.store.events(EventKind.ERROR)]
    assert errors == [{"where": "inbox", "folder": "cat/locked", "error": "cannot open the folder: Permission denied"}]
    s = status(datadir.config)
    assert s["inbox_problems"] == {"cat/locked": "cannot open the folder: Permission denied"}
    assert "inbox folder cat/locked skipped: cannot open the folder: Permission denied" in format_status(s)
    monkeypatch.undo()
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch)
    assert r.accepted == 1 and status(datadir.config)["inbox_problems"] == {}
    datadir.drop("cat/locked/c.png", image_bytes(9))
    fail_to_open(monkeypatch, "locked", errno.EIO)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch)
    assert r.problems == [("cat/locked", "cannot open the folder: Input/output error")]


def test_a_folder_that_vanishes_is_skipped_and_the_rest_goes_on(datadir, monkeypatch):
    datadir.drop("cat/gone/a.png", image_bytes(10))
    datadir.drop("cat/b.png", image_bytes(11))
    fail_to_open(monkeypatch, "gone", errno.ENOENT)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert (r.accepted, r.problems) == (1, [])


@pytest.mark.skipif(os.geteuid() == 0, reason="root lists any folder: the injected variants above cover it")
def test_a_real_folder_without_permission(datadir):
    locked = datadir.inbox / "cat" / "locked"
    datadir.drop("cat/locked/a.png", image_bytes(12))
    datadir.drop("cat/b.png", image_bytes(13))
    locked.chmod(0)
    try:
        watch = InboxWatch()
        r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch)
        assert r.accepted == 1 and [f for f, _ in r.problems] == ["cat/locked"]
        assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock, watch=watch).problems == []
    finally:
        locked.chmod(0o755)


def test_a_daemons_first_cycle_waits_once_then_polls_observe(tmp_path):
    from edgerev_daemon.service.daemon import Daemon

    from ..service.test_service import drop
    from ..service.test_service import make_config as service_config

    config, _ = service_config(tmp_path, ingest={"settle_seconds": 0.05})
    drop(config, 3, range(1))
    with Daemon(config) as d:  # `edgerev daemon once` is this first cycle
        r = d.cycle()
        assert (r.ingest["accepted"], r.ingest["unsettled"]) == (3, 0)
        drop(config, 1, range(1), start=100)
        r = d.cycle()  # later cycles do not wait: the file is seen once, taken at a later poll
        assert (r.ingest["accepted"], r.ingest["unsettled"]) == (0, 1)
