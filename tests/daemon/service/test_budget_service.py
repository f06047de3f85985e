"""The storage budget in the running service: checked at every cycle, shown in status, the HTTP page and
/metrics, ingest held while it cannot be met, a removal a crash cut short finished at start, a budget the
disk cannot hold named at start. No job trains here (the schedule never comes due)."""

from __future__ import annotations

import pytest

from edgerev_daemon.config import config_from_dict
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.demo import write_images
from edgerev_daemon.service.http import format_html, format_metrics
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage.check import check_consistency
from edgerev_daemon.storage.records import EventKind
from edgerev_daemon.storage.retention import enforce
from edgerev_daemon.storage.store import Store
from edgerev_daemon.storage.usage import DiskUsage
from tests.daemon.conftest import Clock

BASE = {
    "image_size": 16,
    "ingest": {"settle_seconds": 0.0},
    "schedule": {"min_new_samples": 100_000, "max_interval_seconds": 1e9},
    "training": {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}}},
}


def config_for(tmp_path, **storage):
    return config_from_dict({**BASE, "data_dir": str(tmp_path / "data"),
                             "storage": {"min_free_space": 0, **storage}})


def test_each_cycle_keeps_the_budget_and_status_shows_it(tmp_path):
    config = config_for(tmp_path, max_samples=60, keep_newest_per_class=3)
    write_images(config.inbox_path, 120, range(3), num_classes=3, size=16)
    with Daemon(config, clock=Clock()) as d:
        first = d.cycle()
        assert first.ingest["accepted"] == 120 and first.storage["removed"] == 0
        second = d.cycle()
        assert second.storage["removed"] == 69 and second.storage["over"] is None and second.waiting is None
        assert d.store.count_samples() == 51
        assert check_consistency(d.store, d.blobs, inbox=config.inbox_path).clean
    s = status(config)
    assert s["storage"]["removed"] == {"max_samples": 69} and s["storage"]["samples"] == 51
    assert s["storage"]["usage"]["blobs"] > 0 and s["storage"]["over"] is None
    assert "51 of 60 samples; removed by the retention policy: 69 (max_samples)" in format_status(s)
    assert "removed by the retention policy" in format_html(s)
    metrics = format_metrics(s)
    assert 'edgerev_samples_removed_total{why="max_samples"} 69' in metrics
    train, held = s["samples"]["train"], s["samples"]["heldout"]
    kept_total = sum(int(line.rsplit(" ", 1)[1]) for line in metrics.splitlines()
                     if line.startswith("edgerev_samples_total{"))
    assert kept_total == train + held + 69  # the counter counts what was removed too: it never goes down
    assert 'edgerev_storage_bytes{part="blobs"}' in metrics and "edgerev_storage_over 0" in metrics
    removed = [e for e in s["events"] if e["kind"] == "removed"]
    assert removed and removed[-1]["message"]["why"] == "max_samples"


def test_ingest_waits_while_only_protected_samples_remain(tmp_path):
    config = config_for(tmp_path, max_samples=30, keep_newest_per_class=40)
    write_images(config.inbox_path, 60, range(2), num_classes=2, size=16)
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == 60
        write_images(config.inbox_path, 4, range(2), num_classes=2, size=16, start=100)
        r = d.cycle()
        assert r.waiting == "storage budget" and r.ingest == {} and "only protected samples remain" in r.storage["over"]
        assert d.store.count_samples() == 60 and sum(1 for p in config.inbox_path.rglob("*.png")) == 4
        assert "storage budget" in d.conditions.active
    s = status(config)
    assert "over its bounds" in format_status(s) and "edgerev_storage_over 1" in format_metrics(s)


def test_the_start_finishes_a_removal_a_crash_cut_short(tmp_path, monkeypatch):
    config = config_for(tmp_path, max_samples=30, keep_newest_per_class=2)
    write_images(config.inbox_path, 60, range(2), num_classes=2, size=16)
    with Daemon(config, clock=Clock()) as d:
        d.cycle()

        class Crash(BaseException):
            pass

        def crash(self, c, shas, why):
            raise Crash

        monkeypatch.setattr(Store, "_delete", crash)
        with pytest.raises(Crash):
            enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        monkeypatch.undo()
        assert check_consistency(d.store, d.blobs).removing
    with Daemon(config, clock=Clock()) as d:
        assert d.store.count_samples() == 25
        report = check_consistency(d.store, d.blobs, inbox=config.inbox_path)
        assert report.clean and not report.removing
        assert d.store.events(kind=EventKind.REMOVED)[-1].message["finished"]


def test_a_budget_the_disk_cannot_hold_is_said_at_start(tmp_path, caplog):
    config = config_for(tmp_path, max_bytes="1000TiB")
    with Daemon(config, clock=Clock()) as d:
        errors = [e.message for e in d.store.events(kind=EventKind.ERROR)]
    assert any(m.get("where") == "storage budget" and "cannot fit the disk" in m["error"] for m in errors)
    assert "cannot fit the disk" in caplog.text


def test_check_and_rebuild_say_what_only_the_store_holds(tmp_path, capsys):
    import yaml

    from edgerev.cli import main

    data = {**BASE, "data_dir": str(tmp_path / "data"),
            "storage": {"min_free_space": 0, "max_samples": 30, "keep_newest_per_class": 2}}
    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump(data))
    config = config_from_dict(data)
    write_images(config.inbox_path, 60, range(2), num_classes=2, size=16)
    with Daemon(config, clock=Clock()) as d:
        d.cycle()
        d.cycle()
        events = len(d.store.events(limit=10_000))
    capsys.readouterr()
    assert main(["daemon", "check", "--config", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"only the store holds {events} events" in out and "a rebuild copies them" in out
    assert main(["daemon", "rebuild", "--config", str(path), "--move-aside"]) == 0
    out = capsys.readouterr().out
    assert f"copied from the old store: 0 jobs, 0 versions, {events} events" in out
    assert "removed by the retention policy before: 35 (max_samples)" in out


def test_a_full_disk_under_a_removal_is_a_condition_that_clears(tmp_path, monkeypatch):
    import errno

    from edgerev_daemon.storage.journal import Journal

    config = config_for(tmp_path, max_samples=30, keep_newest_per_class=2)
    write_images(config.inbox_path, 60, range(2), num_classes=2, size=16)
    with Daemon(config, clock=Clock()) as d:
        d.cycle()
        real = Journal.append

        def full(self, records):
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(Journal, "append", full)
        d.cycle()
        assert "storage budget removal" in d.conditions.active and d.store.count_samples() == 60
        monkeypatch.setattr(Journal, "append", real)
        r = d.cycle()
        assert r.storage["removed"] == 35 and "storage budget removal" not in d.conditions.active
        assert check_consistency(d.store, d.blobs, inbox=config.inbox_path).clean
