"""Never destroy what cannot be recreated: a lost, emptied or damaged store is refused at start (no
blob deleted), ``check`` tells a store that lost rows from a healthy one, and ``rebuild`` recreates
samples, labels, splits, batches and versions from the journal, the blobs and the version folders."""

from __future__ import annotations

import json
import os
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from edgerev.cli import main
from edgerev_daemon.errors import StoreError
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.store import Store
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import drop, make_config

CHILD = Path(__file__).parents[1] / "ingest_child.py"


def _blobs(config) -> set[str]:
    return {k for k, _ in BlobStore(config.layout.blobs).scan() if k is not None}


def _snapshot(config) -> tuple:
    with Store(config.layout.database) as s:
        return ({(x.sha256, x.label, x.split, x.batch_id, x.blob_sha256, x.source) for x in s.samples()}, s.labels())


def _fake_version(config, name: str, data_batch_id: int) -> None:
    """A complete version folder (the registry does not look inside the model files)."""
    Registry(config.layout.root).write(name, {"model.safetensors": b"w" + name.encode(), "model.json": b"{}",
                                              "model.onnx": b"onnx" + name.encode(),
                                              "metrics.json": json.dumps({"data_batch_id": data_batch_id}).encode()})


def _ingested(tmp_path, n=40):
    config, path = make_config(tmp_path, ingest={"settle_seconds": 0.0, "batch_files": 16})
    drop(config, n, range(3))
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().ingest["accepted"] == n
    return config, path


def _break(config, how: str) -> None:
    db = config.layout.database
    for suffix in ("-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    if how == "missing":
        db.unlink()
    elif how == "empty":
        db.write_bytes(b"")
    elif how == "garbage":
        db.write_bytes(b"\x00\x13 not a database, a disk sector of something else" * 200)


@pytest.mark.parametrize("how", ["missing", "empty", "garbage"])
def test_a_lost_store_is_refused_at_start_and_rebuilt_whole(tmp_path, capsys, how):
    config, path = _ingested(tmp_path)
    blobs, (samples, labels) = _blobs(config), _snapshot(config)
    _fake_version(config, "v0001", 2)
    Registry(config.layout.root).switch("v0001")
    _break(config, how)

    with pytest.raises(StoreError) as e:
        Daemon(config, config_path=path, clock=Clock())
    message = str(e.value)
    assert "\n" not in message and "edgerev daemon rebuild --config" in message and "40 blobs" in message
    assert _blobs(config) == blobs  # nothing deleted
    assert main(["daemon", "status", "--config", str(path)]) == 2
    assert "rebuild" in capsys.readouterr().err
    assert main(["daemon", "check", "--config", str(path)]) == 2
    assert "rebuild" in capsys.readouterr().err

    args = ["daemon", "rebuild", "--config", str(path), "--json"]
    if how != "missing":
        assert main(args) == 2  # an existing store is replaced only when told
        assert "--move-aside" in capsys.readouterr().err
        args.append("--move-aside")
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 40 and report["versions"] == ["v0001"] and report["unlabeled_blobs"] == 0
    if how != "missing":
        assert report["moved_aside"] and (config.layout.root / report["moved_aside"][0]).is_file()
    assert _snapshot(config) == (samples, labels)  # labels in their order, splits and batches as they were
    assert main(["daemon", "check", "--config", str(path)]) == 0
    with Daemon(config, clock=Clock()) as d:
        assert d.registry.current() == "v0001" and d.store.get_version("v0001").promoted
        assert d.store.new_samples_since_last_job() == 40 - 32  # v0001 was trained on batches up to 2
        assert d.cycle().ingest["accepted"] == 0
    assert _blobs(config) == blobs


def test_check_tells_a_store_that_lost_rows(tmp_path, capsys):
    config, path = _ingested(tmp_path)
    assert main(["daemon", "check", "--config", str(path)]) == 0
    capsys.readouterr()
    conn = sqlite3.connect(config.layout.database)
    conn.execute("DELETE FROM samples WHERE batch_id = 2")  # e.g. a write-ahead log lost in a power cut
    conn.commit()
    conn.close()
    assert main(["daemon", "check", "--config", str(path), "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert not report["ok"] and len(report["lost"]) == 16 and report["samples"] == 24
    assert report["orphans"] == []  # the lost samples' blobs are not garbage
    # the next start records them again from the journal; nothing was deleted on the way
    with Daemon(config, clock=Clock()) as d:
        assert d.store.count_samples() == 40
    assert len(_blobs(config)) == 40
    assert main(["daemon", "check", "--config", str(path)]) == 0


def test_rebuild_refuses_without_a_journal_and_keeps_unlabeled_blobs(tmp_path, capsys):
    config, path = _ingested(tmp_path, n=8)
    _break(config, "missing")
    config.layout.root.joinpath("journal.jsonl").rename(config.layout.root / "journal.old")
    assert main(["daemon", "rebuild", "--config", str(path)]) == 2
    assert "cannot be rebuilt" in capsys.readouterr().err
    assert len(_blobs(config)) == 8


def test_a_journal_line_is_durable_before_its_inbox_file_is_deleted(tmp_path):
    """kill -9 right after the journal's fsync of the second batch (the first created the journal),
    before its commit: the next start records that batch from the journal; ingest then finds the
    files stored and only removes them."""
    config, path = make_config(tmp_path, image_size=32)  # the child ingests at the default size
    drop(config, 12, range(2))
    child = subprocess.run([sys.executable, str(CHILD), str(config.layout.root), "8", "journal:1"],
                           capture_output=True, text=True, timeout=120)
    assert child.returncode == -9, child.stderr
    journal = config.layout.root / "journal.jsonl"
    assert len(journal.read_text().splitlines()) == 1 + 12
    with Store(config.layout.database) as s:
        assert s.count_samples() == 8
    assert len([p for p in config.inbox_path.rglob("*") if p.is_file()]) == 4  # the last batch's files stay
    with Daemon(config, clock=Clock()) as d:
        assert d.store.count_samples() == 12  # replayed from the journal
        r = d.cycle().ingest
        assert (r["accepted"], r["leftovers"]) == (0, 4)
    assert [p for p in config.inbox_path.rglob("*") if p.is_file()] == []


def test_a_torn_journal_line_from_a_power_cut_does_not_break_rebuild(tmp_path, capsys):
    config, path = _ingested(tmp_path, n=10)
    journal = config.layout.root / "journal.jsonl"
    with open(journal, "ab") as f:
        f.write(b'{"batch": 9, "sha256": "ab')  # the last write of a power cut
    _break(config, "missing")
    assert main(["daemon", "rebuild", "--config", str(path), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["samples"] == 10 and report["torn_tail"] and report["bad_lines"] == []
    with Daemon(config, clock=Clock()) as d:
        drop(config, 2, range(1), start=500)
        assert d.cycle().ingest["accepted"] == 2
    lines = journal.read_bytes().split(b"\n")
    assert lines[-1] == b"" and all(json.loads(x) for x in lines[:-1])  # the torn line was cut, not kept
    assert os.path.getsize(journal) > 0


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cut=st.floats(0.0, 1.0), flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), max_size=4))
@example(cut=1.0, flips=[(1.0, 128)])  # a flipped byte in a schema name: SQLite's message was not UTF-8
@example(cut=1.0, flips=[(0.90625, 128)])  # one in a sample's hash: not UTF-8, which the start's check does not read
def test_whatever_happens_to_the_store_file_no_blob_is_deleted(tmp_path_factory, cut, flips):
    """The store file truncated at any byte and with bytes flipped anywhere: the start is refused with
    the rebuild command, or the store comes up holding every journaled sample; no blob ever goes."""
    root = tmp_path_factory.mktemp("store")
    config, path = _ingested(root, n=12)
    blobs = _blobs(config)
    db = config.layout.database
    data = bytearray(db.read_bytes()[: int(cut * db.stat().st_size)])
    for where, xor in flips:
        if data:
            data[min(len(data) - 1, int(where * len(data)))] ^= xor
    db.write_bytes(bytes(data))
    try:
        with Daemon(config, config_path=path, clock=Clock()) as d:
            assert d.store.count_samples() == 12
    except StoreError as e:
        assert "edgerev daemon rebuild --config" in str(e) and "\n" not in str(e)
    assert _blobs(config) == blobs
