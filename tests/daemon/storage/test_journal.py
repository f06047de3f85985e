"""The sample journal: every stored sample is journaled before its commit, a torn last line (a power
cut) never breaks reading or appending, and a failed write leaves no partial line."""

from __future__ import annotations

import errno
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerev_daemon import ingest_inbox
from edgerev_daemon.storage.journal import Journal, JournalRecord

from ..conftest import image_bytes


def record(i: int, label: str = "cat") -> JournalRecord:
    return JournalRecord(1 + i // 3, f"{i:064x}", label, "train" if i % 4 else "heldout", 32, 24, f"{i + 7:064x}",
                         f"{label}/{i}.png", 1000.0 + i)


def test_every_stored_sample_is_journaled_with_its_label_split_and_batch(datadir):
    for i in range(5):
        datadir.drop(f"{'cat' if i % 2 else 'dog'}/{i}.png", image_bytes(500 + i))
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    contents = datadir.store.journal.read()
    assert contents.image_size == datadir.config.image_size and not contents.torn_tail and not contents.bad_lines
    journaled = contents.samples()
    stored = {s.sha256: s for s in datadir.store.samples()}
    assert set(journaled) == set(stored) and len(stored) == 5
    for sha, s in stored.items():
        r = journaled[sha]
        assert (r.label, r.split, r.batch, r.source, r.blob_sha256, r.width) == \
               (s.label, s.split.value, s.batch_id, s.source, s.blob_sha256, s.width)


def test_a_store_without_journal_gets_one_holding_every_sample_first(datadir):
    """A data directory written before the journal existed (or whose journal was deleted)."""
    for i in range(3):
        datadir.drop(f"cat/{i}.png", image_bytes(510 + i))
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    datadir.store.journal.path.unlink()
    datadir.drop("dog/new.png", image_bytes(520))
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert set(datadir.store.journal.read().samples()) == {s.sha256 for s in datadir.store.samples()}
    assert datadir.store.count_samples() == 4


def test_a_failed_journal_write_rolls_the_batch_back_and_leaves_no_partial_line(datadir, monkeypatch):
    datadir.drop("cat/0.png", image_bytes(530))
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    before = datadir.store.journal.path.read_bytes()
    datadir.drop("cat/1.png", image_bytes(531))
    real_write = os.write

    def half_then_full(fd, data):  # a write that gets half way, then the disk is full
        if b'"sha256"' in bytes(data):
            real_write(fd, bytes(data)[: len(data) // 2])
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", half_then_full)
    with pytest.raises(OSError, match="No space left"):
        ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    monkeypatch.undo()
    assert datadir.store.journal.path.read_bytes() == before  # cut back: no torn line
    assert datadir.store.count_samples() == 1 and (datadir.inbox / "cat/1.png").is_file()
    assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock).accepted == 1
    assert len(datadir.store.journal.read().samples()) == 2


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 12), cut=st.floats(0.0, 1.0), more=st.integers(0, 3))
def test_a_torn_tail_at_any_byte_never_breaks_reading_or_appending(tmp_path_factory, n, cut, more):
    path = tmp_path_factory.mktemp("j") / "journal.jsonl"
    j = Journal(path)
    j.create(32, [record(i) for i in range(n)])
    data = path.read_bytes()
    at = int(cut * len(data))
    path.write_bytes(data[:at])  # a power cut at any byte of the file
    got = j.read()
    assert got.bad_lines == []
    complete = data[:at].count(b"\n") - (1 if data[:at].count(b"\n") >= 1 else 0)  # minus the header
    assert got.records == [record(i) for i in range(max(0, complete))]
    assert got.torn_tail == (at > 0 and data[at - 1:at] != b"\n")
    j.append([record(100 + k) for k in range(more)])
    again = j.read()
    assert again.bad_lines == [] and (not again.torn_tail or more == 0)  # an append cuts the torn line first
    assert again.records == [record(i) for i in range(max(0, complete))] + [record(100 + k) for k in range(more)]
