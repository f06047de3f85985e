"""The SQLite store: settings, migrations, transactions, the hash split, and the samples, jobs,
versions and events API the service loop builds on."""

from __future__ import annotations

import hashlib
import sqlite3

import pytest

from edgerev_daemon import EventKind, JobState, Split, Store, StoreError, split_of
from edgerev_daemon.storage import schema as schema_mod
from edgerev_daemon.storage.records import NewSample

from ..conftest import Clock


def sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def sample(i: int, label: str = "cat") -> NewSample:
    return NewSample(sha(i), label, 32, 32, sha(-i - 1), f"{label}/{i}.png")


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "store.sqlite", clock=Clock(1000.0))
    yield s
    s.close()


def test_connection_settings(store):
    c = store._conn
    assert c.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert c.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert c.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert c.execute("PRAGMA busy_timeout").fetchone()[0] == 10000
    assert store.integrity_problems() == []


def test_migrations_apply_once_and_record_their_version(tmp_path):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    with Store(path) as s:
        rows = s._conn.execute("SELECT version FROM schema_version ORDER BY version").fetchall()
        assert [r[0] for r in rows] == list(range(1, schema_mod.LATEST + 1))


def test_newer_database_is_refused(tmp_path):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    conn = sqlite3.connect(path)
    conn.execute("INSERT INTO schema_version VALUES (?, 0)", (schema_mod.LATEST + 1,))
    conn.commit()
    conn.close()
    with pytest.raises(StoreError, match=f"schema version {schema_mod.LATEST + 1}, newer than"):
        Store(path)


def test_a_failing_migration_leaves_the_old_version(tmp_path, monkeypatch):
    path = tmp_path / "s.sqlite"
    Store(path).close()
    broken = (*schema_mod.MIGRATIONS, ("CREATE TABLE extra (x INTEGER)", "THIS IS NOT SQL"))
    monkeypatch.setattr(schema_mod, "MIGRATIONS", broken)
    monkeypatch.setattr(schema_mod, "LATEST", len(broken))
    with pytest.raises(StoreError, match="cannot open the store"):
        Store(path)
    conn = sqlite3.connect(path)
    assert conn.execute("SELECT MAX(version) FROM schema_version").fetchone()[0] == len(broken) - 1
    assert conn.execute("SELECT 1 FROM sqlite_master WHERE name = 'extra'").fetchone() is None
    conn.close()


def test_not_a_database_is_one_error(tmp_path):
    (tmp_path / "s.sqlite").write_bytes(b"this is not SQLite" * 100)
    with pytest.raises(StoreError, match="cannot open the store"):
        Store(tmp_path / "s.sqlite")


def test_transaction_rolls_back_on_error(store):
    with pytest.raises(ZeroDivisionError):
        with store.transaction() as c:
            c.execute("INSERT INTO meta (key, value) VALUES ('x', '1')")
            raise ZeroDivisionError
    assert store._conn.execute("SELECT COUNT(*) FROM meta").fetchone()[0] == 0
    assert not store._conn.in_transaction
    with store.transaction() as c:  # usable again
        c.execute("INSERT INTO meta (key, value) VALUES ('x', '1')")


def test_readers_are_not_blocked_by_a_writer_and_writers_wait(tmp_path):
    path = tmp_path / "s.sqlite"
    with Store(path) as a, Store(path, busy_timeout=0) as b:
        a.record_batch([sample(1)], [], 0.1)
        with a.transaction() as c:
            c.execute("INSERT INTO meta (key, value) VALUES ('x', '1')")
            assert b.count_samples() == 1  # WAL: the reader sees the last commit while a write is open
            with pytest.raises(sqlite3.OperationalError, match="locked"):
                b.add_event(EventKind.INFO, {"message": "second writer"})


def test_split_is_a_pure_function_of_the_hash():
    hashes = [sha(i) for i in range(20000)]
    held = [h for h in hashes if split_of(h, 0.1) is Split.HELDOUT]
    assert 0.09 < len(held) / len(hashes) < 0.11
    assert all(split_of(h, 0.1) is Split.HELDOUT for h in held)  # same answer every time
    # a larger fraction only moves train samples into held-out, never the other way
    assert set(held) <= {h for h in hashes if split_of(h, 0.2) is Split.HELDOUT}


def test_split_is_stored_and_never_moves(tmp_path):
    with Store(tmp_path / "s.sqlite") as s:
        s.record_batch([sample(i) for i in range(200)], [], 0.1)
        before = {x.sha256: x.split for x in s.samples()}
        assert before == {sha(i): split_of(sha(i), 0.1) for i in range(200)}
        s.record_batch([sample(i) for i in range(200, 300)], [], 0.5)  # the fraction changed later
        after = {x.sha256: x.split for x in s.samples()}
        assert all(after[h] is before[h] for h in before)
        assert s.count_samples(Split.HELDOUT) + s.count_samples(Split.TRAIN) == 300


def test_record_batch_is_all_or_nothing(store):
    store.record_batch([sample(1)], [], 0.1)
    with pytest.raises(sqlite3.IntegrityError):
        store.record_batch([sample(2, "dog"), sample(1)], [(EventKind.INFO, {"message": "x"})], 0.1)
    assert store.count_samples() == 1 and store.labels() == ["cat"] and store.events() == []
    assert store.last_batch_id() == 1


def test_samples_labels_and_batches(store):
    b1 = store.record_batch([sample(1, "dog"), sample(2, "cat")], [], 0.1)
    b2 = store.record_batch([sample(3, "bird"), sample(4, "cat")], [(EventKind.INFO, {"message": "hi"})], 0.1,
                            duplicates=1)
    assert store.labels() == ["dog", "cat", "bird"]  # first arrival order: indices never change
    assert store.count_samples(after_batch=b1) == 2 and store.count_samples(upto_batch=b1) == 2
    got = store.get_sample(sha(3))
    assert (got.label, got.source, got.batch_id, got.added_at) == ("bird", "bird/3.png", b2, 1000.0)
    assert [s.sha256 for s in store.samples(after_batch=b1)] == sorted([sha(3), sha(4)])
    assert store.has_source("cat/2.png") and not store.has_source("cat/9.png")
    assert store.get_sample(sha(99)) is None
    assert store.counts()["samples"] == 4


def test_image_size_is_fixed_at_first_use(store):
    store.check_image_size(32)
    store.check_image_size(32)
    with pytest.raises(StoreError, match="stored images are 32x32, the config asks for image_size 64"):
        store.check_image_size(64)


def test_jobs_one_at_a_time_with_legal_transitions(store):
    store.record_batch([sample(1)], [], 0.1)
    job = store.create_job("200 new samples")
    assert job.state is JobState.QUEUED and job.data_batch_id == 1
    with pytest.raises(StoreError, match="job 1 is still queued; one job at a time"):
        store.create_job("again")
    store.clock.advance(5)
    job = store.set_job_state(job.id, JobState.RUNNING, checkpoint_dir="jobs/1")
    assert job.started_at == 1005.0 and job.checkpoint_dir == "jobs/1"
    # killed while running: back to queued at start-up, resumed; the first start time stays
    store.set_job_state(job.id, JobState.QUEUED)
    store.clock.advance(5)
    assert store.set_job_state(job.id, JobState.RUNNING).started_at == 1005.0
    assert store.active_job().id == job.id
    done = store.set_job_state(job.id, JobState.DONE)
    assert done.finished_at == 1010.0 and store.active_job() is None
    with pytest.raises(StoreError, match="cannot go from done to running"):
        store.set_job_state(job.id, JobState.RUNNING)
    with pytest.raises(StoreError, match="no job 7"):
        store.set_job_state(7, JobState.RUNNING)
    failed = store.set_job_state(store.create_job("interval").id, JobState.FAILED, error="out of memory")
    assert failed.error == "out of memory" and store.last_job().id == failed.id
    assert store.last_job(JobState.DONE).id == job.id and [j.id for j in store.jobs()] == [2, 1]
    states = [e.message["state"] for e in store.events(EventKind.JOB)]
    assert states == ["queued", "running", "queued", "running", "done", "queued", "failed"]


def test_the_database_itself_allows_one_active_job(store):
    store.create_job("first")
    with pytest.raises(sqlite3.IntegrityError):
        with store.transaction() as c:
            c.execute("INSERT INTO jobs (state, reason, created_at, data_batch_id) VALUES ('running', 'x', 0, 0)")


def test_new_samples_are_counted_from_the_last_finished_job(store):
    assert store.new_samples_since_last_job() == 0
    store.record_batch([sample(i) for i in range(3)], [], 0.1)
    assert store.new_samples_since_last_job() == 3
    job = store.create_job("first")
    store.record_batch([sample(i) for i in range(3, 5)], [], 0.1)  # arrives while the job runs
    store.set_job_state(job.id, JobState.RUNNING)
    store.set_job_state(job.id, JobState.DONE)
    assert store.new_samples_since_last_job() == 2


def test_versions(store):
    job = store.create_job("first")
    v1 = store.add_version(job_id=job.id, promoted=True, metrics={"acc": 0.5}, reason="first model")
    v2 = store.add_version(job_id=job.id, parent_id=v1.id, metrics={"acc": 0.4})
    assert (v1.id, v2.id) == ("v0001", "v0002") and v2.parent_id == "v0001" and not v2.promoted
    v2 = store.update_version("v0002", promoted=False, reason="old classes 3.1 points worse (tolerance 2)")
    assert v2.reason.startswith("old classes") and v2.metrics == {"acc": 0.4}
    assert [v.id for v in store.versions()] == ["v0001", "v0002"]
    assert [v.id for v in store.versions(promoted_only=True)] == ["v0001"]
    with pytest.raises(StoreError, match="no model version v0009"):
        store.update_version("v0009", promoted=True)
    assert [e.message["version"] for e in store.events(EventKind.VERSION)] == ["v0001", "v0002", "v0002"]


def test_events_filter_page_and_prune(store):
    ids = [store.add_event(EventKind.INFO, {"message": f"m{i}"}) for i in range(5)]
    store.add_event(EventKind.ERROR, {"where": "ingest", "error": "disk full"})
    assert [e.message["message"] for e in store.events(EventKind.INFO, after_id=ids[1], limit=2)] == ["m2", "m3"]
    assert store.events(EventKind.ERROR)[0].to_json()["kind"] == "error"
    latest = store.events(EventKind.INFO, limit=2, latest=True)  # the last two, still oldest first
    assert [e.message["message"] for e in latest] == ["m3", "m4"]
    assert store.prune_events(keep=2) == 4
    assert [e.kind for e in store.events()] == [EventKind.INFO, EventKind.ERROR]
