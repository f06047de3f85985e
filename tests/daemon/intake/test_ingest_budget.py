"""The storage budget is a bound at every moment: ingest stops past ``storage.target`` of ``storage.max_bytes``,
the rest of a burst waits in the inbox untouched, and later cycles (retention first) take it all.

The data directory is measured from scratch (:class:`DiskUsage`, no cache: bytes on disk) after every commit of
ingest and every removal of the retention policy. Within one ingest the bytes only grow (blobs, quarantined
files, rows), so the measure after each commit is the most its batch ever held; a removal's journal lines and
write-ahead log pages are written before its blobs go, so the measure after its commit is the most it holds.
"""

from __future__ import annotations

import functools
import json
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerev_daemon.intake.ingest import ingest_inbox
from edgerev_daemon.storage.check import check_consistency
from edgerev_daemon.storage.records import EventKind
from edgerev_daemon.storage.retention import enforce
from edgerev_daemon.storage.store import Store
from edgerev_daemon.storage.usage import DiskUsage

from ..conftest import Clock, image_bytes, make_config, open_data_dir, write

SIZE = 96  # a random image of this side stored as a PNG of about 28 KB (on disk too), so a burst is few files
BLOB = 32 << 10  # what each takes with its share of the 256 blob folders (4 KiB each)


@functools.cache
def picture(i: int) -> bytes:
    return image_bytes(i, (SIZE, SIZE))


class Watch:
    """Measures the data directory after every commit of ingest and every removal, and remembers what the
    store recorded from the inbox (stored or quarantined, by inbox path)."""

    def __init__(self, monkeypatch, config) -> None:
        self.layout, self.budget = config.layout, config.storage.max_bytes
        self.most, self.measures, self.recorded = 0, 0, set()
        record, remove = Store.record_batch, Store.remove_samples

        def record_batch(store, samples, events, *args, **kwargs):
            out = record(store, samples, events, *args, **kwargs)
            self.recorded |= {s.source for s in samples}
            self.recorded |= {e["source"] for k, e in events if k is EventKind.QUARANTINE}
            self.measure()
            return out

        def remove_samples(store, *args, **kwargs):
            out = remove(store, *args, **kwargs)
            self.measure()
            return out

        monkeypatch.setattr(Store, "record_batch", record_batch)
        monkeypatch.setattr(Store, "remove_samples", remove_samples)

    def measure(self) -> None:
        total = DiskUsage(self.layout).measure().total
        self.most, self.measures = max(self.most, total), self.measures + 1
        assert total <= self.budget, f"{total} bytes on disk, over storage.max_bytes ({self.budget})"


def burst(inbox: Path, n: int, bad: int = 0, unlabeled: int = 0) -> dict[str, bytes]:
    """``n`` images of three classes (``unlabeled`` of them in ``inbox/unlabeled/``) and ``bad`` files that do not
    decode: what was written, by inbox path."""
    files = {}
    for i in range(n):
        folder = "unlabeled" if i < unlabeled else f"c{i % 3}"
        files[f"{folder}/{i:05d}.png"] = picture(i)
    for i in range(bad):
        files[f"c0/bad-{i}.png"] = b"not an image " * (50 + i)
    for rel, data in files.items():
        write(inbox / rel, data)
    return files


def waiting(inbox: Path) -> dict[str, bytes]:
    return {p.relative_to(inbox).as_posix(): p.read_bytes() for p in inbox.rglob("*") if p.is_file()}


def storage(budget: int, **more) -> dict:
    return {"max_bytes": budget, "max_quarantine_bytes": "64KiB", "keep_newest_per_class": 1, "min_free_space": 0,
            **more}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(budget_kib=st.integers(1024, 2048), extra=st.floats(1.3, 2.2), batch=st.sampled_from([1, 8, 64, 256]),
       bad=st.integers(0, 4), unlabeled=st.integers(0, 20))
def test_no_burst_takes_the_data_directory_past_the_budget(monkeypatch, budget_kib, extra, batch, bad, unlabeled):
    budget = budget_kib * 1024
    n = int(extra * budget / BLOB)  # ``extra`` times what the budget holds
    with tempfile.TemporaryDirectory() as tmp:
        config = make_config(Path(tmp), image_size=SIZE, ingest={"batch_files": batch}, storage=storage(budget))
        d = open_data_dir(config)
        try:
            watch = Watch(monkeypatch, config)
            written = burst(config.inbox_path, n, bad, unlabeled)
            usage = DiskUsage(config.layout)
            before = len(written)
            for cycle in range(3):  # a cycle: the retention pass, then ingest (the whole drain: the daemon's test)
                enforce(config, d.store, d.blobs, usage)
                r = ingest_inbox(config, d.store, d.clock, usage=usage)
                left = waiting(config.inbox_path)
                # nothing lost: what is not recorded waits in the inbox, untouched
                assert set(left) | watch.recorded == set(written) and not set(left) & watch.recorded
                assert all(written[rel] == data for rel, data in left.items())
                assert r.accepted + len(r.quarantined) == before - len(left) > 0, (cycle, r.to_json())
                # it stops only past the target, so the next retention pass has something to remove
                assert r.budget is not None and usage.measure().total > config.storage.target * budget, r.to_json()
                assert f"{len(left)} inbox files wait" in r.budget
                before = len(left)
            assert check_consistency(d.store, d.blobs, inbox=config.inbox_path).clean
            assert watch.measures >= 3
        finally:
            d.store.close()
            d.lock.release()
            monkeypatch.undo()


def test_a_burst_through_the_daemon_waits_in_the_inbox_and_is_taken_by_later_cycles(tmp_path, monkeypatch):
    from edgerev_daemon.service.daemon import Daemon

    budget = 1536 << 10
    config = make_config(tmp_path, image_size=SIZE, storage=storage(budget),
                         schedule={"min_new_samples": 100_000, "max_interval_seconds": 1e9},
                         training={"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}}})
    watch = Watch(monkeypatch, config)
    n = 2 * budget // BLOB
    written = burst(config.inbox_path, n)  # twice what the budget holds
    with Daemon(config, clock=Clock()) as d:
        first = d.cycle()
        assert first.ingest["budget"] is not None and 0 < first.ingest["accepted"] < n, first.ingest
        assert "waits for the storage budget" in first.summary() and first.waiting is None
        assert f"{n - first.ingest['accepted']} inbox files wait" in first.ingest["budget"]
        left = waiting(config.inbox_path)
        assert len(left) == n - first.ingest["accepted"] and all(written[k] == v for k, v in left.items())
        taken = first.ingest["accepted"]
        for _ in range(100):
            r = d.cycle()
            assert r.storage["removed"] > 0 or not r.ingest["accepted"]  # retention made the room it took
            taken += r.ingest["accepted"]
            if not waiting(config.inbox_path):
                break
        assert taken == n and r.ingest["budget"] is None
        assert check_consistency(d.store, d.blobs, inbox=config.inbox_path).clean
    assert budget * config.storage.target < watch.most <= budget


def test_without_a_budget_ingest_takes_everything_and_measures_nothing(datadir, monkeypatch):
    def measure(self):
        raise AssertionError("measured without a budget")

    monkeypatch.setattr(DiskUsage, "measure", measure)
    burst(datadir.inbox, 40)
    r = ingest_inbox(datadir.config, datadir.store, datadir.clock)
    assert r.accepted == 40 and r.budget is None and not waiting(datadir.inbox)


def test_a_manifest_over_the_budget_is_taken_over_cycles_and_no_line_refused_twice(tmp_path, monkeypatch):
    budget = 1536 << 10
    config = make_config(tmp_path, image_size=SIZE, storage=storage(budget))
    d = open_data_dir(config)
    try:
        watch = Watch(monkeypatch, config)
        n = 2 * budget // BLOB
        lines = [{"path": "missing.png", "label": "c0"}]  # refused once, when the manifest is first read
        for i in range(n):
            write(config.inbox_path / ".upload" / f"{i}.png", picture(i))
            lines.append({"path": f".upload/{i}.png", "label": None if i % 4 == 0 else f"c{i % 3}"})
        write(config.inbox_path / "burst.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())
        usage = DiskUsage(config.layout)
        taken, refused, cycles = 0, [], 0
        while cycles < 100:
            cycles += 1
            enforce(config, d.store, d.blobs, usage)  # removes samples stored from the manifest's first lines
            r = ingest_inbox(config, d.store, d.clock, usage=usage)
            taken, refused = taken + r.accepted, refused + r.refused
            if not waiting(config.inbox_path):
                break
            assert r.budget is not None and d.store.manifests_read().keys() == {"burst.jsonl"}
        assert cycles > 2 and taken == n and refused == [("burst.jsonl:1", "no such file in the inbox")]
        assert d.store.manifests_read() == {}  # forgotten once the manifest went
        assert d.store.removal_counts() and watch.most <= budget
    finally:
        d.store.close()
        d.lock.release()
