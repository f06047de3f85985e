"""Storage faults are weather: a full disk or an I/O error while writing a blob, the journal or SQLite
keeps the daemon up, is logged once (and once when it clears), keeps status served, and ingest
resumes by itself; below ``storage.min_free_space`` ingest waits before the disk is full at all.
Injected faults always run; the same on a real full file system (a 2 MiB tmpfs) when this process
may mount one."""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
from pathlib import Path

import pytest

from edgerev_daemon.service import daemon as service_mod
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.status import status
from edgerev_daemon.storage import faults
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.check import check_consistency
from edgerev_daemon.storage.journal import Journal
from edgerev_daemon.storage.records import EventKind
from edgerev_daemon.storage.store import Store
from tests.daemon.conftest import Clock, tmpfs
from tests.daemon.service.test_service import drop, make_config


def _config(tmp_path, floor=0, **over):
    config, _ = make_config(tmp_path, storage={"min_free_space": floor}, **over)
    return config


def _inbox_files(config) -> int:
    return sum(1 for p in config.inbox_path.rglob("*") if p.is_file())


def _lines(caplog, text: str) -> int:
    return sum(text in r.getMessage() for r in caplog.records if r.name == "edgerev.daemon")


def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def _eio(*args, **kwargs):
    raise OSError(errno.EIO, "Input/output error")


def _sqlite_full(*args, **kwargs):
    raise sqlite3.OperationalError("database or disk is full")


FAULTS = {
    "blob": (BlobStore, "write", _enospc),
    "journal": (Journal, "append", _eio),
    "sqlite": (Store, "record_batch", _sqlite_full),
}


@pytest.mark.parametrize("where", sorted(FAULTS))
def test_an_injected_storage_fault_is_logged_once_and_ingest_resumes(tmp_path, monkeypatch, caplog, where):
    config = _config(tmp_path)
    drop(config, 4, range(2))
    caplog.set_level(logging.INFO)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == 4  # the journal exists from here on
        drop(config, 10, range(2), start=100)
        cls, name, fault = FAULTS[where]
        monkeypatch.setattr(cls, name, fault)
        if where == "sqlite":  # the error path cannot write its event either: it must not fail
            monkeypatch.setattr(Store, "add_event", _sqlite_full)
        for _ in range(5):
            r = d.cycle()
            assert r.waiting == "storage" and r.job is None
        assert _lines(caplog, "storage:") == 1
        assert status(config)["samples"]["total"] == 4  # status is still served
        assert _inbox_files(config) == 10  # nothing lost, nothing removed
        monkeypatch.undo()
        r = d.cycle()
        assert r.waiting is None and r.ingest["accepted"] == 10
        assert _lines(caplog, "storage cleared") == 1
        errors = d.store.events(EventKind.ERROR)
        if where == "sqlite":
            assert errors == []  # it could not be recorded; the log line went out
        else:
            assert len(errors) == 1 and errors[0].repeats == 5 and errors[0].message["where"] == "storage"
        report = check_consistency(d.store, d.blobs, inbox=config.inbox_path)
        assert report.ok and report.samples == 14
    assert _inbox_files(config) == 0


def test_below_the_free_space_floor_ingest_waits_and_resumes(tmp_path, monkeypatch, caplog):
    config = _config(tmp_path, floor="64MiB")
    drop(config, 6, range(2))
    caplog.set_level(logging.INFO)
    free = {"bytes": 10 << 20}
    monkeypatch.setattr(faults, "free_bytes", lambda path: free["bytes"])
    monkeypatch.setattr(service_mod, "free_bytes", lambda path: free["bytes"])
    with Daemon(config, clock=Clock()) as d:
        for _ in range(3):
            assert d.cycle().waiting == "disk space"
        assert _inbox_files(config) == 6 and d.store.count_samples() == 0
        s = status(config)
        assert s["disk"] == {"free_bytes": 10 << 20, "min_free_bytes": 64 << 20, "below_floor": True}
        assert _lines(caplog, "below storage.min_free_space") == 1
        free["bytes"] = 1 << 30
        r = d.cycle()
        assert r.waiting is None and r.ingest["accepted"] == 6
        assert _lines(caplog, "disk space cleared") == 1
        (event,) = d.store.events(EventKind.ERROR)
        assert event.repeats == 3


def test_a_start_on_a_full_disk_comes_up_and_waits(tmp_path, monkeypatch, caplog):
    config = _config(tmp_path)
    drop(config, 3, range(1))
    with Daemon(config, clock=Clock()) as d:
        d.cycle()
    drop(config, 3, range(1), start=50)
    caplog.set_level(logging.INFO)
    monkeypatch.setattr(service_mod, "replay", _sqlite_full)  # the start-up repair cannot write
    monkeypatch.setattr(Store, "add_event", _sqlite_full)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().waiting == "storage" and d.cycle().waiting == "storage"
        assert _lines(caplog, "start-up repair waits") == 1
        monkeypatch.undo()
        r = d.cycle()
        assert r.waiting is None and r.ingest["accepted"] == 3


def test_the_floor_key_is_validated(tmp_path):
    from edgerev.config import ConfigError

    with pytest.raises(ConfigError, match=r"^storage.min_free_space: "):
        make_config(tmp_path, storage={"min_free_space": "lots"})
    with pytest.raises(ConfigError, match=r"^events.keep_count: must be at least 100"):
        make_config(tmp_path, events={"keep_count": 5})


# a real full file system ------------------------------------------------------------------------


@pytest.fixture
def small_fs(tmp_path):
    """A 2 MiB tmpfs, mounted for the test (root only: skipped elsewhere; the injected tests above
    cover the same paths)."""
    with tmpfs(tmp_path / "small", "2m") as mount:
        yield mount


def _fill(folder: Path) -> Path:
    """Write until the file system is full; returns the filler file."""
    filler = folder / "filler"
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT | os.O_EXCL)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError as e:
        assert e.errno == errno.ENOSPC
    finally:
        os.close(fd)
    return filler


def test_a_real_full_disk_is_weather(small_fs, tmp_path, caplog):
    config, _ = make_config(tmp_path, data_dir=str(small_fs / "data"), inbox=str(tmp_path / "inbox"),
                            storage={"min_free_space": 0})
    drop(config, 5, range(2))
    caplog.set_level(logging.INFO)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == 5
        drop(config, 40, range(2), start=100)
        filler = _fill(small_fs)
        for _ in range(3):
            d.cycle()  # never raises
        assert _lines(caplog, "storage:") == 1
        stored = d.store.count_samples()
        assert stored + _inbox_files(config) == 45  # each file stored or still waiting
        filler.unlink()
        r = d.cycle()
        assert r.waiting is None and d.store.count_samples() == 45 and _inbox_files(config) == 0
        assert _lines(caplog, "storage cleared") == 1
        assert check_consistency(d.store, d.blobs, inbox=config.inbox_path).ok


def test_a_real_full_disk_at_start_and_the_floor(small_fs, tmp_path, caplog):
    config, _ = make_config(tmp_path, data_dir=str(small_fs / "data"), inbox=str(tmp_path / "inbox"),
                            storage={"min_free_space": "1MiB"})
    drop(config, 5, range(2))
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == 5
    filler = _fill(small_fs)
    drop(config, 5, range(2), start=100)
    caplog.set_level(logging.INFO)
    with Daemon(config, clock=Clock()) as d:  # comes up on a full disk
        assert d.cycle().waiting in ("disk space", "storage")
        assert status(config)["disk"]["below_floor"]
        filler.unlink()
        assert d.cycle().ingest["accepted"] == 5
        assert d.store.count_samples() == 10
