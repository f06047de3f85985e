"""Self-repair of ``current`` from the store's record of the version in service (at start and in
``rollback``; a folder in its place is moved aside, never deleted), ``check`` of the version in
service against its manifest, and the bounded event log."""

from __future__ import annotations

import json
import logging
import os
import shutil

import pytest

from edgerev.cli import main
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.storage.faults import Conditions
from edgerev_daemon.storage.records import EventKind
from edgerev_daemon.storage.registry import MANIFEST
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import make_config


def _two_versions(tmp_path, in_service: str):
    """Two promoted versions on disk (fake model files: the registry does not look inside), the store
    recording ``in_service`` (as after a rollback, when it is not the newest)."""
    config, path = make_config(tmp_path)
    with Daemon(config, clock=Clock()) as d:
        for name in ("v0001", "v0002"):
            d.registry.write(name, {"model.safetensors": name.encode() * 10, "model.json": b"{}",
                                    "model.onnx": b"onnx " + name.encode()})
            v = d.store.add_version(promoted=False, metrics={}, reason="test")
            d.store.update_version(v.id, promoted=True)
        d.registry.switch(in_service)
        d.store.set_in_service(in_service)
    return config, path


def _break(link, how: str) -> None:
    link.unlink()
    if how == "dangling":
        os.symlink("versions/v0009", link)
    elif how == "folder":
        link.mkdir()
        (link / "notes.txt").write_text("a person's file")
    elif how == "file":
        link.write_text("not a link")


@pytest.mark.parametrize("how", ["missing", "dangling", "folder", "file"])
def test_a_broken_current_is_restored_at_start(tmp_path, caplog, how):
    config, _ = _two_versions(tmp_path, "v0001")
    link = config.layout.root / "current"
    _break(link, how)
    caplog.set_level(logging.WARNING)
    with Daemon(config, clock=Clock()) as d:
        assert d.registry.current() == "v0001"  # what the store recorded, not the newest
        (event,) = [e for e in d.store.events(EventKind.ERROR) if e.message["where"] == "current"]
        assert "restored to v0001" in event.message["error"]
    assert any("restored to v0001" in r.getMessage() for r in caplog.records)
    if how == "folder":
        assert (config.layout.root / "current.moved-aside-1" / "notes.txt").read_text() == "a person's file"
    if how == "file":
        assert (config.layout.root / "current.moved-aside-1").read_text() == "not a link"


def test_rollback_repairs_current_first(tmp_path, capsys):
    config, path = _two_versions(tmp_path, "v0002")
    _break(config.layout.root / "current", "folder")
    assert main(["daemon", "rollback", "--config", str(path), "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"from": "v0002", "to": "v0001"}
    assert os.readlink(config.layout.root / "current") == "versions/v0001"
    _break(config.layout.root / "current", "missing")
    with Daemon(config, clock=Clock()) as d:
        assert d.registry.current() == "v0001"  # the rollback was recorded as the version in service


def test_check_verifies_the_version_in_service(tmp_path, capsys):
    config, path = _two_versions(tmp_path, "v0002")
    folder = config.layout.root / "versions" / "v0002"
    manifest = json.loads((folder / MANIFEST).read_text())
    assert set(manifest["files"]) == {"model.safetensors", "model.json", "model.onnx"}
    assert main(["daemon", "check", "--config", str(path)]) == 0
    capsys.readouterr()
    (folder / "model.onnx").write_bytes(b"bit rot")
    assert main(["daemon", "check", "--config", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["service"] == ["v0002/model.onnx does not match its SHA-256 in "
                                                              "manifest.json"]
    (folder / "model.onnx").unlink()
    assert main(["daemon", "check", "--config", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["service"] == ["v0002 lacks model.onnx"]
    shutil.copy(config.layout.root / "versions" / "v0001" / "model.onnx", folder / "model.onnx")
    (config.layout.root / "current").unlink()
    assert main(["daemon", "check", "--config", str(path), "--json"]) == 1
    assert json.loads(capsys.readouterr().out)["service"][0].endswith("current is missing")


def test_events_are_bounded_by_age_and_count_at_every_cycle(tmp_path):
    config, _ = make_config(tmp_path, events={"keep_count": 100, "keep_days": 1})
    clock = Clock()
    with Daemon(config, clock=clock) as d:
        for i in range(250):
            d.store.add_event(EventKind.INFO, {"message": f"m{i}"})
        d.cycle()  # no job ran: pruned anyway
        events = d.store.events(limit=1000)
        assert len(events) <= 100 and events[-1].message == {"message": "m249"}
        clock.advance(2 * 86400)
        d.store.add_event(EventKind.INFO, {"message": "fresh"})
        d.cycle()
        assert [e.message for e in d.store.events(limit=1000)] == [{"message": "fresh"}]


def test_a_lasting_condition_is_one_event_and_its_recording_never_raises(datadir, caplog):
    caplog.set_level(logging.INFO)
    calls = []
    cond = Conditions(lambda k, m, r: calls.append(1) or datadir.store.add_event(k, m, repeat=r), datadir.clock)
    for _ in range(100):
        cond.begin("storage", "No space left on device")
    (event,) = datadir.store.events()
    assert event.repeats == 100 and event.last_at is not None
    assert sum("storage: No space left" in r.getMessage() for r in caplog.records) == 1

    def full(*args):
        raise OSError(28, "No space left on device")

    broken = Conditions(full, datadir.clock)
    assert broken.begin("storage", "full") and not broken.begin("storage", "full")  # nothing raised
    assert broken.end("storage") and not broken.end("storage")
