"""The storage budget: the retention policy's choice, removal and compaction, and a crash at every step.

Samples are recorded the way ingest records them (a blob written and synced, then one transaction with its
journal lines) without decoding images, so a test holds hundreds of real files in well under a second.
In-process crashes raise an exception that no handler catches at each step; the kill -9 tests run the
removal in a process of its own (retention_child.py) and kill it at each step and at random lines.
"""

from __future__ import annotations

import hashlib
import os
import random
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev_daemon import check_consistency, remove_garbage
from edgerev_daemon.storage.journal import Journal
from edgerev_daemon.storage.rebuild import rebuild
from edgerev_daemon.storage.records import EventKind, NewSample, Sample, Split
from edgerev_daemon.storage.retention import (
    choose,
    compact_journal,
    enforce,
    finish_removals,
    fits_disk,
    reservoir_key,
)
from edgerev_daemon.storage.store import split_of
from edgerev_daemon.storage.usage import DiskUsage

from ..conftest import make_config, open_data_dir, rebuilt_store

CHILD = Path(__file__).parents[1] / "retention_child.py"
BLOB = 3000  # bytes of each fake blob: about a 32x32 PNG


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so no handler in the code catches it."""


def fill(d, per_label: dict[str, int], batches: int = 4, seed: int = 0) -> list[str]:
    """Record ``per_label`` samples over ``batches`` ingest batches (blobs written and synced first)."""
    rng = random.Random(seed)
    items = [label for label, n in per_label.items() for _ in range(n)]
    rng.shuffle(items)
    shas = []
    for b in range(batches):
        chunk = items[b::batches]
        new = []
        for i, label in enumerate(chunk):
            data = rng.randbytes(BLOB)
            sha = hashlib.sha256(data + b"source").hexdigest()
            d.blobs.write(sha, data)
            new.append(NewSample(sha, label, 32, 32, hashlib.sha256(data).hexdigest(), f"{label}/{b}-{i}.png"))
            shas.append(sha)
        d.blobs.sync()
        d.store.record_batch(new, [], d.config.heldout_fraction)
        d.clock.advance(3600)
    return shas


def stored(d) -> set[str]:
    return set(d.store.blob_hashes())


def rebuilt(config, tmp_path: Path) -> set[str]:
    """The samples a rebuild recreates, from a copy of the data directory (the original is left alone)."""
    with rebuilt_store(config, tmp_path) as s:
        return set(s.blob_hashes())


def budget_config(tmp_path, **storage):
    return make_config(tmp_path, storage={"min_free_space": 0, **storage})


# the policy -------------------------------------------------------------------------------------------


def _samples(per_label: dict[str, int], heldout_fraction: float, seed: int) -> list[Sample]:
    rng = random.Random(seed)
    out = []
    for label, n in per_label.items():
        for i in range(n):
            sha = hashlib.sha256(f"{seed}-{label}-{i}".encode()).hexdigest()
            out.append(Sample(sha, label, split_of(sha, heldout_fraction), 32, 32, sha, f"{label}/{i}", 0.0,
                              rng.randrange(1, 50)))
    out.sort(key=lambda s: (s.batch_id, s.sha256))
    return out


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(0, 80), min_size=1, max_size=6), share=st.floats(0.05, 0.9),
       keep=st.integers(1, 10), reservoir=st.floats(0, 1), heldout=st.sampled_from([0.1, 0.2, 0.5]),
       seed=st.integers(0, 10**6))
def test_the_policy_keeps_every_class_its_newest_and_the_heldout_share(counts, share, keep, reservoir, heldout,
                                                                      seed):
    per_label = {f"c{i}": n for i, n in enumerate(counts)}
    samples = _samples(per_label, heldout, seed)
    count = int(len(samples) * share)
    victims = choose(samples, count, heldout, keep, reservoir)
    gone = {s.sha256 for s in victims}
    assert len(gone) == len(victims) <= count
    kept = [s for s in samples if s.sha256 not in gone]
    for split in Split:
        for label in per_label:
            mine = [s for s in samples if s.label == label and s.split == split]
            newest = mine[-keep:]
            assert all(s.sha256 not in gone for s in newest)  # the newest per class and split stay
    protected = sum(min(keep, sum(1 for s in samples if s.label == label and s.split == split))
                    for label in per_label for split in Split)
    assert len(victims) == min(count, len(samples) - protected)  # it removes all it was asked while it can
    def removable(split: Split) -> int:
        return sum(max(0, sum(1 for s in samples if s.label == label and s.split == split) - keep)
                   for label in per_label)

    held_before = sum(1 for s in samples if s.split == Split.HELDOUT)
    from_heldout = min(count, max(0, held_before - round(heldout * (len(samples) - count))))
    if removable(Split.HELDOUT) >= from_heldout and removable(Split.TRAIN) >= count - from_heldout:
        # neither split ran out: the held-out split gave what keeps its share of what is kept
        assert sum(1 for s in kept if s.split == Split.HELDOUT) == held_before - from_heldout


def test_the_largest_class_gives_first_and_a_rare_one_keeps_its_history():
    samples = _samples({"common": 300, "rare": 30}, 0.1, 1)
    victims = choose(samples, 200, 0.1, 5, 0.5)
    assert Counter(s.label for s in victims) == {"common": 200}
    victims = choose(samples, 280, 0.1, 5, 0.5)  # then both, down to equal sizes
    after = Counter(s.label for s in samples) - Counter(s.label for s in victims)
    assert abs(after["common"] - after["rare"]) <= 2


def test_older_samples_go_oldest_first_and_the_reservoir_last_spread_over_history():
    samples = [s for s in _samples({"a": 400}, 0.0001, 2) if s.split == Split.TRAIN]
    samples = [Sample(*s.__dict__.values()) for s in samples]
    victims = choose(samples, 250, 0.0001, 10, 0.5)
    gone = {s.sha256 for s in victims}
    kept = [s for s in samples if s.sha256 not in gone]
    outside = [s for s in samples[:-10] if reservoir_key(s.sha256) >= 0.5]
    # the ones outside the reservoir went first, oldest first
    assert [s.sha256 for s in victims[: len(outside)]] == [s.sha256 for s in outside]
    older_kept = kept[:-10]
    assert all(reservoir_key(s.sha256) < 0.5 for s in older_kept)
    # what remains of the past is spread over it: kept samples in each quarter of the history
    positions = [samples.index(s) for s in older_kept]
    quarters = Counter(4 * p // (len(samples) - 10) for p in positions)
    assert all(quarters[q] >= len(older_kept) // 8 for q in range(4))


# removal through the store ----------------------------------------------------------------------------


def test_a_budget_removes_down_to_its_target_counted_explained_and_consistent(tmp_path):
    config = budget_config(tmp_path, max_samples=300, target=0.8, keep_newest_per_class=5)
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 250, "dog": 120, "owl": 10})
        before = stored(d)
        expected = {s.sha256 for s in choose(d.store.samples(), 155, config.heldout_fraction, 5, 0.5)}
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))  # above 80 % of 300: down to 75 %
        assert report.removed == 380 - 225 and d.store.count_samples() == 225 and report.over is None
        assert before - stored(d) == expected  # the store's reading, one class at a time, chooses the same
        counts = d.store.label_counts()
        assert counts["owl"] == 10 and counts["cat"] >= counts["dog"] - 1  # the rare class untouched
        assert d.store.removal_counts() == {"max_samples": 155}
        event = d.store.events(kind=EventKind.REMOVED)[-1].message
        assert event["why"] == "max_samples" and event["samples"] == 155 and sum(event["by_label"].values()) == 155
        check = check_consistency(d.store, d.blobs, inbox=config.inbox_path)
        assert check.clean and check.journal == 225 and not check.removing
        assert rebuilt(config, tmp_path) == stored(d)
        # a second check removes nothing
        assert enforce(config, d.store, d.blobs, DiskUsage(config.layout)).removed == 0
    finally:
        d.store.close()
        d.lock.release()


def test_bytes_budget_counts_everything_and_stops_at_protected_samples(tmp_path):
    # 256 blob folders take 1 MiB of the budget before any sample (4 KiB each on ext4)
    config = budget_config(tmp_path, max_bytes="2MiB", keep_newest_per_class=20, max_quarantine_bytes="64KiB")
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 200, "dog": 200})
        usage = DiskUsage(config.layout)
        assert usage.measure().total > 2 << 20
        report = enforce(config, d.store, d.blobs, usage)
        assert report.removed > 0 and report.over is None, report.to_json()
        assert usage.measure().total <= 2 << 20
        # a budget below what the protected samples need: everything removable goes, and it says so
        tight = budget_config(tmp_path, max_bytes="1200KiB", keep_newest_per_class=20, max_quarantine_bytes="4KiB")
        report = enforce(tight, d.store, d.blobs, usage)
        assert report.over is not None and "only protected samples remain" in report.over
        assert d.store.label_counts(Split.TRAIN) == {"cat": 20, "dog": 20}
        assert all(0 < n <= 20 for n in d.store.label_counts(Split.HELDOUT).values())
        assert choose(d.store.samples(), 1, 0.1, 20, 0.5) == []  # nothing removable is left
        assert check_consistency(d.store, d.blobs).clean
    finally:
        d.store.close()
        d.lock.release()


def test_no_sample_is_removed_while_a_job_reads_them(tmp_path):
    config = budget_config(tmp_path, max_samples=50, keep_newest_per_class=1)
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 100})
        job = d.store.create_job("test")
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.removed == 0 and f"job {job.id} reads the samples" in report.over
        d.store.set_job_state(job.id, "running")
        d.store.set_job_state(job.id, "done")
        assert enforce(config, d.store, d.blobs, DiskUsage(config.layout)).removed > 0
    finally:
        d.store.close()
        d.lock.release()


def test_quarantine_has_its_own_bound_oldest_first(tmp_path):
    config = budget_config(tmp_path, max_quarantine_bytes="40KiB")
    d = open_data_dir(config)
    try:
        q = config.layout.quarantine
        for i in range(20):
            (q / f"f{i}.png").write_bytes(os.urandom(4000))
            (q / f"f{i}.png.reason.json").write_text("{}")
            os.utime(q / f"f{i}.png", (1000 + i, 1000 + i))
            os.utime(q / f"f{i}.png.reason.json", (1000 + i, 1000 + i))
        (q / "lone.png.reason.json").write_text("{}")  # a crash between a file's removal and its reason's
        os.utime(q / "lone.png.reason.json", (900, 900))
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.quarantine_removed > 0 and not (q / "lone.png.reason.json").exists()
        left = sorted(int(p.name[1:-4]) for p in q.glob("f*.png"))
        assert left == list(range(20 - len(left), 20))  # the newest stay
        assert all((q / f"f{i}.png.reason.json").exists() for i in left)
        assert DiskUsage(config.layout).measure().quarantine <= 40 * 1024
        assert d.store.events(kind=EventKind.REMOVED)[-1].message["why"] == "max_quarantine_bytes"
    finally:
        d.store.close()
        d.lock.release()


def test_over_bytes_with_only_protected_samples_the_versions_a_rollback_does_not_need_go(tmp_path):
    from edgerev_daemon.storage.registry import Registry

    config = budget_config(tmp_path, max_bytes="1200KiB", keep_newest_per_class=20, max_quarantine_bytes="4KiB")
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 20, "dog": 20}, batches=1)
        registry = Registry(config.layout.root)
        parent = None
        for _ in range(4):
            v = d.store.add_version(None, parent, promoted=True)
            files = {n: os.urandom(60_000) for n in ("model.safetensors", "model.json", "model.onnx")}
            registry.write(v.id, files)
            registry.switch(v.id)
            parent = v.id
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.removed == 0 and report.versions_removed == ["v0001", "v0002"]
        assert registry.versions() == ["v0003", "v0004"] and registry.current() == "v0004"  # in service, its parent
        assert report.over is None, report.to_json()
        event = d.store.events(kind=EventKind.REMOVED)[-1].message
        assert event["versions"] == ["v0001", "v0002"] and event["kept"] == ["v0003", "v0004"]
    finally:
        d.store.close()
        d.lock.release()


def test_a_budget_the_disk_cannot_hold_is_named(tmp_path):
    config = budget_config(tmp_path, max_bytes="1000TiB")
    config.layout.root.mkdir(parents=True)
    why = fits_disk(config, DiskUsage(config.layout).measure())
    assert why is not None and "storage.max_bytes" in why and "cannot fit the disk" in why
    small = budget_config(tmp_path, max_bytes="1MiB", max_quarantine_bytes="1KiB")
    assert fits_disk(small, DiskUsage(config.layout).measure()) is None


def test_usage_sees_files_added_and_removed_in_a_cached_folder(tmp_path):
    config = budget_config(tmp_path)
    d = open_data_dir(config)
    try:
        usage = DiskUsage(config.layout, wall=lambda: 4e9)  # every folder looks settled: the cache is used
        shas = fill(d, {"cat": 50}, batches=1)
        first = usage.measure().blobs
        assert first >= 50 * BLOB
        d.blobs.remove(shas[0])
        assert usage.measure().blobs < first  # the folder's time moved with the removal
        assert usage.measure().blobs == DiskUsage(config.layout).measure().blobs
    finally:
        d.store.close()
        d.lock.release()


# journal compaction -------------------------------------------------------------------------------


def test_compaction_keeps_the_samples_and_the_count_of_removals(tmp_path):
    config = budget_config(tmp_path, max_samples=100, keep_newest_per_class=5)
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 150, "dog": 100})
        enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        before = d.store.journal.read()
        size = d.store.journal.path.stat().st_size
        assert compact_journal(d.store, force=True) is not None
        after = d.store.journal.read()
        assert set(after.samples()) == set(before.samples()) == stored(d)
        assert after.removal_counts() == before.removal_counts() == d.store.removal_counts()
        assert d.store.journal.path.stat().st_size < size * 0.6
        assert check_consistency(d.store, d.blobs).clean
        # a removed sample dropped again comes back, before and after compaction
        assert rebuilt(config, tmp_path) == stored(d)
    finally:
        d.store.close()
        d.lock.release()


def test_enough_removals_compact_the_journal_by_themselves(tmp_path):
    config = budget_config(tmp_path, max_samples=60, keep_newest_per_class=3)
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 300, "dog": 100})
        report = enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        assert report.removed == 349 and report.compacted is not None
        contents = d.store.journal.read()
        assert len(contents.lines) == 51 and contents.header["removed"] == {"max_samples": 349}
        assert check_consistency(d.store, d.blobs).clean and rebuilt(config, tmp_path) == stored(d)
        assert compact_journal(d.store) is None  # nothing removed since
    finally:
        d.store.close()
        d.lock.release()


def test_a_sample_removed_then_journaled_again_is_kept():
    from edgerev_daemon.storage.journal import JournalContents, JournalRecord, Removal

    r = JournalRecord(1, "a" * 64, "cat", "train", 1, 1, "b" * 64, "cat/1.png", 0.0)
    c = JournalContents(records=[r, r], lines=[r, Removal("a" * 64, "max_bytes", 1.0), r])
    assert set(c.samples()) == {"a" * 64} and c.removed() == set() and c.removal_counts() == {"max_bytes": 1}


def test_rebuild_keeps_the_job_history_and_events_of_a_readable_store(tmp_path):
    config = budget_config(tmp_path, max_samples=50, keep_newest_per_class=5)
    d = open_data_dir(config)
    try:
        fill(d, {"cat": 80})
        job = d.store.create_job("test")
        d.store.set_job_state(job.id, "running")
        d.store.set_job_state(job.id, "failed", error="boom")
        enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        events = len(d.store.events(limit=10_000))
        check = check_consistency(d.store, d.blobs)
        assert check.history == {"jobs": 1, "versions_not_promoted": 0, "events": events}
    finally:
        d.store.close()
        d.lock.release()
    lost = tmp_path / "lost"
    shutil.copytree(config.layout.root, lost / "data", symlinks=True)
    for f in (lost / "data").glob("store.sqlite*"):
        f.unlink()
    gone = rebuild(make_config(lost, data_dir=str(lost / "data")))
    assert gone.lost_history == "store.sqlite is missing" and gone.salvaged == {} and gone.samples == 42
    report = rebuild(config, move_aside=True)
    assert report.salvaged == {"jobs": 1, "versions": 0, "events": events} and report.lost_history is None
    assert report.removed == {"max_samples": 38}
    from edgerev_daemon.storage.store import Store

    with Store(config.layout.database) as s:
        assert s.get_job(job.id).error == "boom" and len(s.events(limit=10_000)) == events
        assert s.removal_counts() == {"max_samples": 38} and s.count_samples() == 42


# a crash at each step of a removal and of a compaction (in-process) ---------------------------------


def _over_budget(tmp_path):
    config = budget_config(tmp_path, max_samples=60, keep_newest_per_class=3)
    d = open_data_dir(config)
    fill(d, {"cat": 60, "dog": 40})
    return config, d


def _after_crash(config, d, tmp_path, removing: bool):
    """What must hold after a crash: check is ok, check and rebuild agree; then a start's repair leaves it clean."""
    check = check_consistency(d.store, d.blobs, inbox=config.inbox_path)
    assert check.ok, check.to_json()
    assert bool(check.removing) == removing
    assert rebuilt(config, tmp_path) == stored(d) - set(check.removing)
    finish_removals(d.store, d.blobs)
    remove_garbage(check_consistency(d.store, d.blobs, inbox=config.inbox_path), d.blobs)
    after = check_consistency(d.store, d.blobs, inbox=config.inbox_path)
    assert after.clean and not after.removing, after.to_json()
    assert rebuilt(config, tmp_path) == stored(d)
    return after


def test_crash_after_the_journal_before_the_commit(tmp_path, monkeypatch):
    from edgerev_daemon.storage.store import Store

    config, d = _over_budget(tmp_path)
    try:
        real = Store._delete

        def journal_then_crash(self, c, shas, why):
            raise Crash

        monkeypatch.setattr(Store, "_delete", journal_then_crash)
        with pytest.raises(Crash):
            enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        monkeypatch.setattr(Store, "_delete", real)
        assert d.store.count_samples() == 100  # rolled back: the rows stay, the journal says removed
        _after_crash(config, d, tmp_path, removing=True)
        assert d.store.count_samples() == 51 and d.store.removal_counts() == {"max_samples": 49}
    finally:
        d.store.close()
        d.lock.release()


def test_crash_after_the_commit_before_the_blobs(tmp_path, monkeypatch):
    config, d = _over_budget(tmp_path)
    try:
        calls = []

        def remove_then_crash(key):
            calls.append(key)
            if len(calls) == 10:
                raise Crash
            os.unlink(d.blobs.path(key))

        monkeypatch.setattr(d.blobs, "remove", remove_then_crash)
        with pytest.raises(Crash):
            enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        monkeypatch.undo()
        report = _after_crash(config, d, tmp_path, removing=False)
        assert report.samples == 51
    finally:
        d.store.close()
        d.lock.release()


@pytest.mark.parametrize("step", ["write", "rename"])
def test_crash_during_compaction_leaves_an_equivalent_journal(tmp_path, monkeypatch, step):
    config, d = _over_budget(tmp_path)
    try:
        enforce(config, d.store, d.blobs, DiskUsage(config.layout))
        before = d.store.journal.read()
        real = os.replace

        def crash(src, dst):
            if step == "rename":
                real(src, dst)
            raise Crash

        monkeypatch.setattr(os, "replace", crash)
        with pytest.raises(Crash):
            compact_journal(d.store, force=True)
        monkeypatch.undo()
        after = Journal(config.layout.journal).read()
        assert set(after.samples()) == set(before.samples()) and after.removal_counts() == before.removal_counts()
        _after_crash(config, d, tmp_path, removing=False)
    finally:
        d.store.close()
        d.lock.release()


# kill -9 in a process of its own ----------------------------------------------------------------------


def _run_child(data_dir: Path, point: str) -> int:
    proc = subprocess.run([sys.executable, str(CHILD), str(data_dir), point], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode in (0, -signal.SIGKILL), proc.stderr
    return proc.returncode


@pytest.mark.slow
def test_kill_at_each_step_of_a_removal_and_a_compaction(tmp_path):
    """kill -9 at each step (and at random lines of the daemon's code): check is ok and agrees with a
    rebuild at once; the next start's repair leaves a clean directory with the same samples."""
    points = ["journal:1", "commit:1", "blob:1", "blob:17", "compact-write:1", "compact-rename:1", "finish:1"]
    points += [f"line:{n}" for n in random.Random(24).sample(range(50, 4000), 10)]
    killed = 0
    for point in points:
        root = tmp_path / point.replace(":", "-")
        config = budget_config(root, max_samples=60, keep_newest_per_class=3)
        d = open_data_dir(config)
        fill(d, {"cat": 60, "dog": 40})
        d.store.close()
        d.lock.release()
        if point.startswith("finish"):  # a removal cut short first, then a kill inside the start's finish
            _run_child(config.layout.root, "journal:1")
        killed += _run_child(config.layout.root, point) != 0
        d = open_data_dir(config)
        try:
            _after_crash(config, d, root, removing=bool(check_consistency(d.store, d.blobs).removing))
            assert d.store.count_samples() in (100, 51)
        finally:
            d.store.close()
            d.lock.release()
    assert killed >= 7
