"""Unlabelled images: stored like labelled ones (settle, decode, dedupe, quarantine, journal, rebuild, check,
the budget), labelled later without being stored twice, and kept out of training and the held-out set until
then. The kill -9 test of a mixed inbox is in test_unlabeled_crash.py."""

from __future__ import annotations

import hashlib
import json
import sqlite3
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerev_daemon import EventKind, check_consistency, ingest_inbox
from edgerev_daemon.errors import StoreError
from edgerev_daemon.intake.manifest import LineRefused, parse_line
from edgerev_daemon.learning.jobs import job_data, load_samples
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage.journal import Labeling
from edgerev_daemon.storage.rebuild import replay
from edgerev_daemon.storage.records import JobState, NewSample, Split
from edgerev_daemon.storage.retention import choose, enforce, finish_removals
from edgerev_daemon.storage.schema import MIGRATIONS
from edgerev_daemon.storage.store import Store, split_of
from edgerev_daemon.storage.usage import DiskUsage

from ..conftest import Clock, image_bytes, make_config, open_data_dir, rebuilt_store, write


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(store: Store) -> set[tuple]:
    """What a rebuild must reproduce of every sample."""
    return {(s.sha256, s.label, s.split, s.batch_id, s.blob_sha256, s.source) for s in store.samples()}


def rebuilt(config, tmp_path: Path) -> tuple[set[tuple], list[str]]:
    """The samples and labels a rebuild recreates from a copy of the data directory (the original untouched)."""
    with rebuilt_store(config, tmp_path) as s:
        return snapshot(s), s.labels()


def ingest(d, **kwargs):
    return ingest_inbox(d.config, d.store, clock=d.clock, **kwargs)


@pytest.fixture
def d(datadir):
    """The daemon conftest's data directory, under the short name these tests use."""
    return datadir


# stored like labelled images ----------------------------------------------------------------------------


def test_unlabelled_images_are_stored_deduped_and_quarantined_like_labelled_ones(d, tmp_path):
    a, b, c = image_bytes(1), image_bytes(2), image_bytes(3)
    d.drop("unlabeled/a.png", a)
    d.drop("unlabeled/deeper/b.jpg", image_bytes(2, fmt="JPEG"))
    d.drop("unlabeled/z-again.png", a)            # a true duplicate of an unlabelled image
    d.drop("unlabeled/broken.png", b"not an image")
    d.drop("unlabelled/c.png", c)                 # the other spelling is the same folder
    d.drop("cat/x.png", b)
    d.drop("loose.png", image_bytes(4))           # outside any folder: still refused
    r = ingest(d)
    assert (r.accepted, r.unlabeled, r.labeled, r.duplicates) == (4, 3, 0, 1)
    reasons = dict(r.quarantined)
    assert "corrupt" in reasons["unlabeled/broken.png"] or "not a PNG" in reasons["unlabeled/broken.png"]
    assert "not in a label folder" in reasons["loose.png"]
    assert d.store.labels() == ["cat"]  # 'unlabeled' never becomes a class
    unlabeled = d.store.unlabeled_samples()
    assert {s.source for s in unlabeled} == {"unlabeled/a.png", "unlabeled/deeper/b.jpg", "unlabelled/c.png"}
    assert all(s.label is None and s.split is None and not s.labeled for s in unlabeled)
    assert d.store.count_samples(labeled=False) == 3 and d.store.count_samples(labeled=True) == 1
    assert d.store.count_samples(Split.TRAIN) + d.store.count_samples(Split.HELDOUT) == 1
    dup = d.store.events(kind=EventKind.DUPLICATE)[0].message
    assert dup["source"] == "unlabeled/z-again.png" and dup["label"] is None and dup["label_conflict"] is False
    records = d.store.journal.read().records
    assert sum(1 for x in records if x.label is None and x.split is None) == 3
    report = check_consistency(d.store, d.blobs, inbox=d.inbox)
    assert report.clean and report.journal == 4
    assert rebuilt(d.config, tmp_path) == (snapshot(d.store), ["cat"])
    assert not any(d.inbox.rglob("*.png")) or [p.name for p in d.inbox.rglob("*.png")] == ["loose.png"]


def test_an_unlabelled_file_waits_until_it_settles(tmp_path):
    config = make_config(tmp_path, ingest={"settle_seconds": 5})
    d = open_data_dir(config, Clock(1e9))  # the clock is behind the file's time: it has not settled
    try:
        d.drop("unlabeled/a.png", image_bytes(1))
        r = ingest(d)
        assert r.accepted == 0 and r.unsettled == 1 and (d.inbox / "unlabeled/a.png").exists()
    finally:
        d.store.close()
        d.lock.release()


# labelled later ---------------------------------------------------------------------------------------


def test_the_same_image_dropped_under_a_label_labels_it_without_storing_it_twice(d, tmp_path):
    a = image_bytes(7)
    d.drop("unlabeled/a.png", a)
    assert ingest(d).unlabeled == 1
    first = d.store.get_sample(sha(a))
    blobs_before = sorted(k for k, _ in d.blobs.scan())
    d.drop("cat/a.png", a)
    r = ingest(d)
    assert (r.accepted, r.labeled, r.duplicates, r.leftovers) == (0, 1, 0, 0)
    s = d.store.get_sample(sha(a))
    assert s.label == "cat" and s.split == split_of(s.sha256, d.config.heldout_fraction)
    assert s.source == "unlabeled/a.png" and s.batch_id > first.batch_id  # new data as of the labelling batch
    assert sorted(k for k, _ in d.blobs.scan()) == blobs_before and d.store.count_samples() == 1
    event = d.store.events(kind=EventKind.LABELED)[-1].message
    assert event == {"sha256": s.sha256, "label": "cat", "split": s.split.value, "source": "cat/a.png",
                     "sample_source": "unlabeled/a.png"}
    lines = d.store.journal.read().lines
    assert isinstance(lines[-1], Labeling) and lines[-1].label == "cat" and lines[-1].batch == s.batch_id
    assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
    assert rebuilt(d.config, tmp_path) == (snapshot(d.store), ["cat"])
    # once labelled: another label is a conflict, no label is a plain duplicate
    d.drop("dog/a.png", a)
    d.drop("unlabeled/a2.png", a)
    r = ingest(d)
    assert (r.labeled, r.duplicates) == (0, 2)
    dups = {e.message["source"]: e.message["label_conflict"] for e in d.store.events(kind=EventKind.DUPLICATE)}
    assert dups == {"dog/a.png": True, "unlabeled/a2.png": False}
    assert d.store.get_sample(sha(a)).label == "cat"


def test_an_unlabelled_image_and_its_labelled_copy_in_one_batch_are_one_labelled_sample(d, tmp_path):
    a, b = image_bytes(8), image_bytes(9)
    d.drop(".up/a.png", a)
    d.drop(".up/b.png", b)
    # a manifest is read before the folders: its unlabelled lines come first in the batch
    d.drop("m.jsonl", b'{"path": ".up/a.png"}\n{"path": ".up/b.png", "label": null}\n')
    d.drop("cat/a-copy.png", a)
    r = ingest(d)
    assert (r.accepted, r.unlabeled, r.labeled, r.duplicates, r.batches) == (2, 1, 1, 0, 1)
    s = d.store.get_sample(sha(a))
    assert (s.label, s.source, s.split) == ("cat", ".up/a.png", split_of(s.sha256, d.config.heldout_fraction))
    assert d.store.get_sample(sha(b)).label is None
    assert [e.message["source"] for e in d.store.events(kind=EventKind.LABELED)] == ["cat/a-copy.png"]
    assert list(d.inbox.rglob("*.png")) == [] and not (d.inbox / "m.jsonl").exists()
    assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
    assert rebuilt(d.config, tmp_path) == (snapshot(d.store), ["cat"])


def test_a_manifest_line_with_a_label_labels_a_stored_image(d):
    a = image_bytes(10)
    d.drop("unlabeled/a.png", a)
    ingest(d)
    d.drop(".later/a.png", a)
    d.drop("later.jsonl", b'{"path": ".later/a.png", "label": "owl"}\n')
    r = ingest(d)
    assert r.labeled == 1 and d.store.get_sample(sha(a)).label == "owl"
    assert not (d.inbox / "later.jsonl").exists()


def test_label_sample_by_hash_or_prefix_journaled_and_refused_with_reasons(d, tmp_path):
    imgs = [image_bytes(20 + i) for i in range(4)]
    for i, data in enumerate(imgs):
        d.drop(f"unlabeled/{i}.png", data)
    d.drop("cat/x.png", image_bytes(30))
    ingest(d)
    h = [sha(x) for x in imgs]
    s = d.store.label_sample(h[0][:8], "dog", d.config.heldout_fraction)
    assert s.sha256 == h[0] and s.label == "dog" and s.split == split_of(h[0], d.config.heldout_fraction)
    assert d.store.label_sample(h[0].upper(), "dog", 0.5) == s  # the same label again: nothing changes
    assert d.store.label_sample(h[1], "cat", 0.5, source="answer 7").label == "cat"
    event = d.store.events(kind=EventKind.LABELED)[-1].message
    assert event["source"] == "answer 7" and event["sample_source"] == "unlabeled/1.png"
    with pytest.raises(StoreError, match="already labelled 'dog'"):
        d.store.label_sample(h[0], "cat", 0.5)
    for bad, why in (("unlabeled", "means no label"), ("../x", "not a valid name"), ("", "not a valid name")):
        with pytest.raises(StoreError, match=why):
            d.store.label_sample(h[2], bad, 0.5)
    for ref, why in (("abc", "at least 6"), ("zzzzzzzz", "hexadecimal"), ("0" * 64, "never stored")):
        with pytest.raises(StoreError, match=why):
            d.store.label_sample(ref, "cat", 0.5)
    # a sample the retention policy removed is refused with that reason
    d.store.remove_samples([h[3]], "max_bytes")
    d.blobs.remove(h[3])
    with pytest.raises(StoreError, match=r"no sample .* removed by the retention policy \(max_bytes\)"):
        d.store.label_sample(h[3][:10], "cat", 0.5)
    assert d.store.get_sample(h[2]).label is None  # nothing a refusal touched
    assert d.store.labels() == ["cat", "dog"]
    assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
    assert rebuilt(d.config, tmp_path) == (snapshot(d.store), ["cat", "dog"])


def test_an_ambiguous_prefix_is_refused(d):
    shas = ["abcdef" + "0" * 58, "abcdef" + "1" * 58]
    d.store.record_batch([NewSample(x, None, 8, 8, x, f"unlabeled/{i}.png") for i, x in enumerate(shas)], [], 0.1)
    with pytest.raises(StoreError, match="more than one"):
        d.store.label_sample("abcdef", "cat", 0.1)
    assert d.store.label_sample("abcdef1", "cat", 0.1).sha256 == shas[1]


# manifests, with and without labels -----------------------------------------------------------------------

LABELS = st.sampled_from([None, "absent", "cat", "dog", "unlabeled"])


@given(label=LABELS)
def test_a_manifest_line_may_leave_the_label_out(label):
    obj = {"path": "up/x.png"} | ({} if label == "absent" else {"label": label})
    assert parse_line(json.dumps(obj)).label == (None if label == "absent" else label)


@pytest.mark.parametrize("line", ['{"path": "x.png", "label": 3}', '{"path": "x.png", "label": ["cat"]}',
                                  '{"label": "cat"}'])
def test_a_label_that_is_not_a_string_or_null_is_refused(line):
    with pytest.raises(LineRefused):
        parse_line(line)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(lines=st.lists(st.tuples(st.integers(0, 3), LABELS), min_size=1, max_size=10),
       batch_files=st.integers(1, 4), manifests=st.integers(1, 2))
def test_manifests_with_and_without_labels_store_each_image_once_with_its_first_label(tmp_path, lines, batch_files,
                                                                                       manifests):
    """Each image's first given label wins: stored with it, or given to the unlabelled sample later (one
    labelling event per file that labelled); the rest are duplicates. Check and rebuild agree."""
    with tempfile.TemporaryDirectory(dir=tmp_path) as tmp:
        config = make_config(Path(tmp), ingest={"settle_seconds": 0, "batch_files": batch_files})
        d = open_data_dir(config)
        try:
            data = [image_bytes(40 + i) for i in range(4)]
            texts = [""] * manifests
            expected: dict[str, str | None] = {}
            stored_once: set[str] = set()
            labelings = 0
            for n, (i, label) in enumerate(lines):
                d.drop(f".up/{n}.png", data[i])
                obj = {"path": f".up/{n}.png"} | ({} if label == "absent" else {"label": label})
                texts[n * manifests // len(lines)] += json.dumps(obj) + "\n"
                given_label = None if label in ("absent", None, "unlabeled") else label
                h = sha(data[i])
                if h not in stored_once:
                    stored_once.add(h)
                    expected[h] = given_label
                elif expected[h] is None and given_label is not None:
                    expected[h] = given_label
                    labelings += 1
            for m, text in enumerate(texts):
                if text:
                    d.drop(f"m{m}.jsonl", text.encode())
            r = ingest(d)
            assert r.refused == [] and r.quarantined == []
            got = {s.sha256: s.label for s in d.store.samples()}
            assert got == expected
            for s in d.store.samples():
                assert s.split == (None if s.label is None else split_of(s.sha256, config.heldout_fraction))
            assert r.labeled == labelings == len(d.store.events(kind=EventKind.LABELED))
            assert r.duplicates == len(lines) - len(expected) - labelings
            assert list(d.inbox.iterdir()) == [d.inbox / ".up"] and list((d.inbox / ".up").iterdir()) == []
            assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
            assert rebuilt(config, Path(tmp))[0] == snapshot(d.store)
        finally:
            d.store.close()
            d.lock.release()


# never trained on, never judged on, until labelled ----------------------------------------------------------


def test_unlabelled_samples_enter_no_job_until_labelled_and_then_count_as_new(d):
    for i in range(12):
        d.drop(f"cat/{i}.png", image_bytes(100 + i))
        d.drop(f"dog/{i}.png", image_bytes(200 + i))
    for i in range(10):
        d.drop(f"unlabeled/{i}.png", image_bytes(300 + i))
    ingest(d)
    assert d.store.new_samples_since_last_job() == 24  # unlabelled images make no job due
    job = d.store.create_job("test")
    train, held, _ = job_data(d.store, d.blobs, job, 0)
    assert len(train) + len(held) == 24
    d.store.set_job_state(job.id, JobState.RUNNING)
    d.store.set_job_state(job.id, JobState.DONE)
    assert d.store.new_samples_since_last_job() == 0
    # labelled after the job: new data for the next one, in the split its hash gives
    unl = d.store.unlabeled_samples()
    for s in unl[:4]:
        d.store.label_sample(s.sha256, "cat", d.config.heldout_fraction)
    assert d.store.new_samples_since_last_job() == 4
    job2 = d.store.create_job("test 2")
    train2, held2, _ = job_data(d.store, d.blobs, job2, job.data_batch_id, known=("cat", "dog"))
    heldout = [s for s in unl[:4] if split_of(s.sha256, d.config.heldout_fraction) is Split.HELDOUT]
    assert len(train2) == 4 - len(heldout) and len(held2) == len(held) + len(heldout)
    assert {s.sha256 for s in d.store.samples(Split.HELDOUT)} & {s.sha256 for s in unl[4:]} == set()
    with pytest.raises(ValueError, match="unlabelled"):
        load_samples(unl[4:6], d.blobs, d.store.labels())


# the budget -----------------------------------------------------------------------------------------------


def _record(d, n_unlabeled: int, per_label: dict[str, int], batches: int = 3) -> None:
    """Unlabelled and labelled samples spread over ``batches`` batches, real blobs, no inbox."""
    items = [None] * n_unlabeled + [x for x, n in per_label.items() for _ in range(n)]
    start = d.store.count_samples() + d.store.removal_counts().get("max_samples", 0)  # new bytes at every call
    for b in range(batches):
        new = []
        for k in range(b, len(items), batches):
            label = items[k]
            data = f"{start + k}-{label}".encode() * 64
            h = sha(data)
            d.blobs.write(h, data)
            new.append(NewSample(h, label, 8, 8, sha(data), f"{label or 'unlabeled'}/{k}.png"))
        d.blobs.sync()
        d.store.record_batch(new, [], d.config.heldout_fraction)


def test_the_budget_removes_unlabelled_samples_first_oldest_first_counted_and_explained(tmp_path):
    config = make_config(tmp_path, storage={"min_free_space": 0, "max_samples": 100, "target": 0.8,
                                            "keep_newest_per_class": 3})
    d = open_data_dir(config)
    try:
        _record(d, 60, {"cat": 40, "dog": 20})
        unl = d.store.unlabeled_samples()
        oldest = [s.sha256 for s in sorted(unl, key=lambda s: (s.batch_id, s.sha256))]
        expected = {s.sha256 for s in choose(d.store.samples(), 120 - 75, config.heldout_fraction, 3, 0.5)}
        assert expected == set(oldest[:45])  # the pure policy: unlabelled, oldest first
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.removed == 45 and d.store.count_samples() == 75 and report.over is None
        assert {s.sha256 for s in d.store.unlabeled_samples()} == set(oldest[45:])
        assert d.store.count_samples(labeled=True) == 60  # no labelled sample went
        event = d.store.events(kind=EventKind.REMOVED)[-1].message
        assert (event["samples"], event["unlabeled"], event["by_label"]) == (45, 45, {})
        assert d.store.removal_counts(by_split=True) == {"unlabeled": 45}
        assert d.store.removal_counts() == {"max_samples": 45}
        assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
        assert rebuilt(config, tmp_path)[0] == snapshot(d.store)
        # past the unlabelled ones, labelled samples go by the class-aware policy
        _record(d, 0, {"cat": 40})
        expected = {s.sha256 for s in choose(d.store.samples(), 115 - 75, config.heldout_fraction, 3, 0.5)}
        assert set(oldest[45:]) <= expected
        before = set(d.store.blob_hashes())
        assert enforce(config, d.store, d.blobs, DiskUsage(config.layout)).removed == 40
        assert before - set(d.store.blob_hashes()) == expected and d.store.count_samples(labeled=False) == 0
        event = d.store.events(kind=EventKind.REMOVED)[-1].message
        assert event["unlabeled"] == 15 and sum(event["by_label"].values()) == 25
    finally:
        d.store.close()
        d.lock.release()


def test_no_unlabelled_sample_goes_while_a_job_may_read_the_samples(tmp_path):
    config = make_config(tmp_path, storage={"min_free_space": 0, "max_samples": 50})
    d = open_data_dir(config)
    try:
        _record(d, 60, {"cat": 10})
        d.store.create_job("reads everything")
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.removed == 0 and "job 1 reads the samples" in report.over
        assert d.store.count_samples(labeled=False) == 60
    finally:
        d.store.close()
        d.lock.release()


# crash between the labelling's journal line and its commit -------------------------------------------------


class Crash(BaseException):
    """Stands for the process dying (no handler in the code catches it)."""


def test_a_labelling_journaled_but_not_committed_is_replayed_and_check_tells_it(d, tmp_path, monkeypatch):
    a = image_bytes(50)
    d.drop("unlabeled/a.png", a)
    ingest(d)
    d.drop("cat/a.png", a)
    real = type(d.store.journal).append

    def append_then_crash(self, records):
        real(self, records)
        raise Crash

    monkeypatch.setattr(type(d.store.journal), "append", append_then_crash)
    with pytest.raises(Crash):
        ingest(d)
    monkeypatch.undo()
    assert d.store.get_sample(sha(a)).label is None and (d.inbox / "cat/a.png").exists()
    report = check_consistency(d.store, d.blobs, inbox=d.inbox)
    assert report.ok and report.labeling == [sha(a)] and report.relabeled == []
    assert replay(d.store, d.blobs) == 1  # what the next start does
    assert d.store.get_sample(sha(a)).label == "cat"
    assert d.store.events(kind=EventKind.LABELED)[-1].message["replayed"] == "from the journal"
    r = ingest(d)  # the file that gave the label is a leftover now: removed, no second event
    assert (r.leftovers, r.labeled, r.duplicates) == (1, 0, 0) and not (d.inbox / "cat/a.png").exists()
    assert len(d.store.events(kind=EventKind.LABELED)) == 1
    assert check_consistency(d.store, d.blobs, inbox=d.inbox).clean
    assert rebuilt(d.config, tmp_path)[0] == snapshot(d.store)


def test_check_reports_a_label_the_journal_does_not_know(d):
    d.drop("unlabeled/a.png", image_bytes(51))
    ingest(d)
    with sqlite3.connect(d.config.layout.database) as c:
        c.execute("INSERT INTO labels (name, added_at) VALUES ('cat', 0)")
        c.execute("UPDATE samples SET label_id = (SELECT id FROM labels WHERE name = 'cat'), split = 'train'")
    report = check_consistency(d.store, d.blobs, inbox=d.inbox)
    assert not report.ok and report.relabeled == [sha(image_bytes(51))]


# stores made before unlabelled images -----------------------------------------------------------------------


def _v2_store(path: Path, labels: list[str]) -> list[str]:
    """A database at schema version 2 (what the previous edgerev wrote), one sample per label."""
    c = sqlite3.connect(path, isolation_level=None)
    c.execute("CREATE TABLE schema_version (version INTEGER PRIMARY KEY, applied_at REAL NOT NULL)")
    for v, statements in enumerate(MIGRATIONS[:2], 1):
        for s in statements:
            c.execute(s)
        c.execute("INSERT INTO schema_version VALUES (?, 0)", (v,))
    c.execute("INSERT INTO ingest_batches (at, accepted, duplicates, quarantined, refused) VALUES (1, 2, 0, 0, 0)")
    shas = []
    for i, label in enumerate(labels):
        c.execute("INSERT INTO labels (name, added_at) VALUES (?, 1)", (label,))
        h = sha(label.encode())
        c.execute("INSERT INTO samples VALUES (?, ?, 'train', 8, 8, ?, ?, 1, 1)", (h, i + 1, h, f"{label}/x.png"))
        shas.append(h)
    c.close()
    return shas


def test_a_store_from_before_is_migrated_with_its_samples_in_order(tmp_path):
    path = tmp_path / "store.sqlite"
    shas = _v2_store(path, ["cat", "dog"])
    with Store(path) as s:
        assert [x.sha256 for x in s.samples()] == sorted(shas) and s.labels() == ["cat", "dog"]
        assert all(x.labeled and x.split is Split.TRAIN for x in s.samples())
        s.check_labels()  # nothing reserved: fine
        s.record_batch([NewSample("f" * 64, None, 8, 8, "f" * 64, "unlabeled/y.png")], [], 0.1)
        assert s.count_samples(labeled=False) == 1 and s.integrity_problems() == []
        with pytest.raises(sqlite3.IntegrityError):  # a label without a split (or the reverse) cannot be stored
            s._conn.execute("UPDATE samples SET split = NULL WHERE sha256 = ?", (shas[0],))


def test_a_store_with_a_class_named_unlabeled_is_refused_with_the_way_out(tmp_path):
    config = make_config(tmp_path)
    config.layout.root.mkdir(parents=True)
    _v2_store(config.layout.database, ["cat", "unlabeled"])
    d = open_data_dir(config)
    try:
        with pytest.raises(StoreError, match=r"1 under 'unlabeled'.*start a new data directory"):
            ingest(d)
        assert d.store.get_sample(sha(b"unlabeled")).label == "unlabeled"  # nothing changed
        assert status(config, events=0)["samples"]["total"] == 2  # status still reads it
    finally:
        d.store.close()
        d.lock.release()


# status -----------------------------------------------------------------------------------------------------


def test_status_counts_labelled_and_unlabelled_samples(d):
    for i in range(3):
        d.drop(f"unlabeled/{i}.png", image_bytes(60 + i))
    d.drop("cat/x.png", image_bytes(70))
    ingest(d)
    s = status(d.config, events=0)
    n = s["samples"]
    assert (n["total"], n["labeled"], n["unlabeled"], n["train"] + n["heldout"]) == (4, 1, 3, 1)
    assert s["counts"]["samples_unlabeled"] == 3 and s["counts"]["samples_labeled"] == 1
    line = next(x for x in format_status(s).splitlines() if x.startswith("samples:"))
    assert line.startswith(f"samples: 4: 1 labelled ({n['train']} train, {n['heldout']} held out), 3 unlabelled;")


def test_a_removal_of_unlabelled_samples_cut_short_is_finished_at_start(tmp_path, monkeypatch):
    config = make_config(tmp_path, storage={"min_free_space": 0, "max_samples": 50})
    d = open_data_dir(config)
    try:
        _record(d, 30, {"cat": 30})
        real = type(d.store.journal).append

        def append_then_crash(self, records):
            real(self, records)
            raise Crash

        monkeypatch.setattr(type(d.store.journal), "append", append_then_crash)
        with pytest.raises(Crash):
            enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        monkeypatch.undo()
        report = check_consistency(d.store, d.blobs, inbox=d.inbox)
        assert report.ok and len(report.removing) == 60 - 42 and d.store.count_samples(labeled=False) == 30
        assert rebuilt(config, tmp_path)[0] == {x for x in snapshot(d.store) if x[0] not in report.removing}
        assert finish_removals(d.store, d.blobs) == 18  # what the next start does
        assert d.store.count_samples(labeled=False) == 12 and d.store.count_samples(labeled=True) == 30
        assert d.store.events(kind=EventKind.REMOVED)[-1].message["unlabeled"] == 18
        assert check_consistency(d.store, d.blobs, inbox=d.inbox).ok
        assert rebuilt(config, tmp_path)[0] == snapshot(d.store)
    finally:
        d.store.close()
        d.lock.release()


@pytest.mark.slow
def test_a_daemon_cycle_trains_and_judges_on_labelled_samples_only(tmp_path):
    """The real loop: 60 unlabelled images beside 160 labelled ones make no job due by themselves, and the job
    the labelled ones make trains on the labelled training split alone and is judged on the labelled held-out."""
    from edgerev_daemon.service.daemon import Daemon
    from tests.daemon.service.test_service import drop
    from tests.daemon.service.test_service import make_config as service_config

    config, _ = service_config(tmp_path)
    for i in range(60):
        write(config.inbox_path / "unlabeled" / f"{i:03d}.png", image_bytes(900 + i, (16, 16)))
    with Daemon(config, clock=Clock()) as daemon:
        r = daemon.cycle()
        assert r.ingest["unlabeled"] == 60 and r.due is None and r.job is None  # 60 unlabelled: no job
        drop(config, 160, range(2))
        r = daemon.cycle()
        assert r.job is not None and r.job.get("version") == "v0001", r.job
        store = daemon.store
        metrics = store.get_version("v0001").metrics
        train, held = store.count_samples(Split.TRAIN), store.count_samples(Split.HELDOUT)
        assert train + held == 160 and store.count_samples(labeled=False) == 60
        assert metrics["training"]["train_samples"] <= train  # a share of the training split is validation
        assert metrics["evaluation"]["heldout_samples"]["all"] == held
        assert "unlabeled" not in metrics["classes"] and len(metrics["classes"]) == 2


def test_the_docs_say_what_the_config_does_with_unlabelled_images():
    """Every page that speaks of unlabelled images says what the defaults do: jobs learn from them with
    pseudo-labels (``training.semi`` is on in the daemon's defaults and every preset) and they make no job
    due. Pages once said they were 'not trained on' or 'enter no training', beside a config that trains."""
    import re

    from edgerev_daemon.config import DaemonConfig, load_config

    root = Path(__file__).resolve().parents[3]
    assert DaemonConfig(data_dir="x").training.semi.enabled
    presets = sorted((root / "configs" / "daemon").glob("*.yaml"))
    assert presets and all(load_config(p).training.semi.enabled for p in presets), presets
    pages = [root / "README.md", root / "daemon" / "README.md", *sorted((root / "docs").rglob("*.md"))]
    wrong = re.compile(r"not trained on|enter no training|never trained on|no training until", re.I)
    said = []
    for page in pages:
        text = " ".join(page.read_text().split())
        for sentence in re.split(r"(?<=[.:;])\s", text):
            if re.search(r"unlabell?ed", sentence, re.I) and wrong.search(sentence):
                said.append(f"{page.relative_to(root)}: {sentence[:160]}")
    assert not said, said
    for name in ("README.md", "docs/guides/device.md", "docs/guides/daemon.md"):
        text = " ".join((root / name).read_text().split())
        assert "pseudo-labels" in text and "training.semi" in text, name
    for name in ("docs/guides/device.md", "docs/guides/daemon.md"):
        assert "make no job due" in " ".join((root / name).read_text().split()), name
