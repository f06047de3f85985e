"""The storage budget: what is removed when the data directory reaches ``storage.max_bytes``.

Checked at the start of every cycle (:func:`enforce`), before ingest. When the data directory holds more
than ``storage.target`` (90 %) of ``storage.max_bytes`` (or the store more than that share of
``storage.max_samples`` samples), samples are removed until it holds :data:`BAND` (5 points) less than
that share, by the policy below. Ingest stops where this starts (:mod:`edgerev_daemon.intake.budget`): it
checks ``max_bytes`` before every file and ends once the data directory passes the target, the rest of a
burst waiting in the inbox for the next cycle, so a cycle's ingest fills the band a removal frees. The rest
of the budget is headroom for what ingest overshoots by, a job's checkpoints and the version it writes, and
a removal's journal lines (written before its blobs go); above the budget itself ingest waits.

1. **Nothing a job reads.** While a job is queued or running (interrupted, to be resumed) it reads every
   sample up to its data, and its evaluation the held-out ones: no sample is removed until it is done.
   The version in service and the one a rollback goes back to are version directories, never samples;
   ``promotion.keep_last`` bounds those, and when only protected samples remain and the bytes are still
   above the target, the other version directories go too (:func:`prune_versions`), never those two.
2. **Unlabelled samples first, oldest first.** An image nobody labelled teaches less than one with a
   label (semi-supervised training and the label questions use them, nothing judges on them), so they
   go before any labelled sample, in arrival order. Only when none is left do labelled samples go, by
   the rules below.
3. **The held-out share stays fixed.** Of the samples removed, as many come from the held-out split as
   keep it at ``heldout_fraction`` of what is kept (a split with nothing left to remove gives the rest).
4. **Every class stays, with its newest samples.** The newest ``storage.keep_newest_per_class`` samples
   of each class in each split are never removed, so the recent window the promotion gate judges on is
   the last to thin.
5. **The largest class gives first** (water-filling): each removal comes from the class that holds the
   most samples in that split, so a rare or vanished class keeps its history while a frequent one thins.
6. **Within a class, oldest first, a reservoir last.** A sample whose hash falls in the first
   ``storage.reservoir`` share of the hash space belongs to the reservoir: the others go oldest first;
   reservoir samples go after them, in a fixed order of their hashes, so what remains of a class's past
   is an even sample of its whole history (nested: a smaller budget keeps a subset of what a larger one
   keeps). The choice is a pure function of the store, so a removal cut short by a crash is chosen again.

Crash safety is the journal's (see :mod:`edgerev_daemon.storage.journal`): the removal lines are fsynced inside the
transaction that deletes the rows, the blobs go after its commit; :func:`finish_removals` completes at start
what a crash cut short. Every removal is counted by reason in the store (``status``) and explained by a
``removed`` event (how many, of which labels, why, the bytes before and the budget).

Quarantine has its own bound (``storage.max_quarantine_bytes``): its oldest files go first, with their
reasons. When the budget cannot be reached (a job holds the samples, or only protected samples remain) ingest
waits, so the data directory does not keep growing past the budget.
"""

from __future__ import annotations

import heapq
import logging
import math
import os
import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.layout import SIDECAR
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.faults import free_bytes
from edgerev_daemon.storage.journal import JournalContents, Removal
from edgerev_daemon.storage.records import EventKind, RemovalReason, Sample, Split
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.store import Store
from edgerev_daemon.storage.usage import DiskUsage, Usage, shared

log = logging.getLogger("edgerev.daemon")

_HASH_SPAN = float(16**8)
_PASSES = 4


def reservoir_key(sha256: str) -> float:
    """A sample's place in the hash space, in [0, 1) (the bytes after those
    :func:`~edgerev_daemon.storage.store.split_of` reads, so reservoir and split are independent)."""
    return int(sha256[8:16], 16) / _HASH_SPAN


def victim_order(hashes: Sequence[str], keep_newest: int, reservoir: float) -> list[str]:
    """A class's removable samples in the order they go: ``hashes`` (one class and split, in arrival order)
    without the newest ``keep_newest``; those outside the reservoir oldest first, then the reservoir's from
    the largest hash key down."""
    older = hashes[: max(0, len(hashes) - keep_newest)]
    outside = [h for h in older if reservoir_key(h) >= reservoir]
    inside = sorted((h for h in older if reservoir_key(h) < reservoir), key=reservoir_key, reverse=True)
    return outside + inside


Group = tuple[Split, str]  # (split, label)


def water_fill(totals: dict[Group, int], groups: Sequence[Group], count: int, keep_newest: int) -> dict[Group, int]:
    """How many of ``count`` removals each group of ``groups`` gives: each from the group that holds the most
    samples then (ties: by label name, so the choice depends on the samples alone), none below its newest
    ``keep_newest``."""
    order = {g: i for i, g in enumerate(sorted(totals, key=lambda g: (g[0].value, g[1])))}
    heap = [(-totals[g], order[g], g) for g in groups if totals[g] > keep_newest]
    heapq.heapify(heap)
    taken = {g: 0 for g in groups}
    left = count
    while heap and left > 0:
        held, i, g = heapq.heappop(heap)
        taken[g] += 1
        left -= 1
        if -held - 1 > keep_newest:
            heapq.heappush(heap, (held + 1, i, g))
    return taken


def plan(totals: dict[Group, int], count: int, heldout_fraction: float, keep_newest: int) -> dict[Group, int]:
    """How many samples each (split, label) gives to remove ``count`` (fewer when only protected ones remain):
    the held-out split as many as keep its share of what is kept, the train split the rest, and a split that
    runs out leaves the rest to the other."""
    held = [g for g in totals if g[0] == Split.HELDOUT]
    train = [g for g in totals if g[0] == Split.TRAIN]
    n_held = sum(totals[g] for g in held)
    kept = sum(totals.values()) - count
    from_heldout = min(count, max(0, n_held - round(heldout_fraction * kept)))
    out = water_fill(totals, held, from_heldout, keep_newest)
    got_held = sum(out.values())
    out |= water_fill(totals, train, count - got_held, keep_newest)
    short = count - sum(out.values())
    if short > 0 and got_held == from_heldout:  # the train split ran out: the held-out one gives the rest
        out |= water_fill(totals, held, from_heldout + short, keep_newest)
    return {g: n for g, n in out.items() if n}


def choose(samples: Sequence[Sample], count: int, heldout_fraction: float, keep_newest: int,
           reservoir: float) -> list[Sample]:
    """The ``count`` samples the policy removes first (the unlabelled oldest first, then the labelled ones in
    arrival order); fewer when only protected ones remain. :func:`enforce` makes the same choice from the
    store's counts, reading one class's hashes at a time."""
    unlabeled = sorted((s for s in samples if s.label is None), key=lambda s: (s.batch_id, s.sha256))[:count]
    groups: dict[Group, list[Sample]] = {}
    for s in samples:
        if s.label is not None:
            groups.setdefault((s.split, s.label), []).append(s)
    counts = plan({g: len(v) for g, v in groups.items()}, count - len(unlabeled), heldout_fraction, keep_newest)
    by_hash = {s.sha256: s for s in samples}
    return unlabeled + [by_hash[h] for g, n in counts.items()
                        for h in victim_order([s.sha256 for s in groups[g]], keep_newest, reservoir)[:n]]


def _choose_in_store(store: Store, count: int, heldout_fraction: float, keep_newest: int,
                     reservoir: float) -> list[str]:
    """:func:`choose` on the store: the unlabelled hashes, then counts by split and label and the hashes of only
    the classes that give (memory bounded by the largest class or the count, not by the store: a year of
    samples is never loaded at once)."""
    unlabeled = store.unlabeled_hashes(limit=count)
    if len(unlabeled) == count:
        return unlabeled
    totals = store.split_label_counts()
    counts = plan(totals, count - len(unlabeled), heldout_fraction, keep_newest)
    return unlabeled + [h for (split, label), n in counts.items()
                        for h in victim_order(store.hashes(label, split), keep_newest, reservoir)[:n]]


@dataclass
class BudgetReport:
    """What one check of the budget found and did."""

    usage: Usage = field(default_factory=Usage)
    max_bytes: int | None = None
    samples: int = 0
    max_samples: int | None = None
    removed: int = 0
    removed_bytes: int = 0
    quarantine_removed: int = 0
    versions_removed: list[str] = field(default_factory=list)
    compacted: tuple[int, int] | None = None
    over: str | None = None  # why the data directory is still over its bounds (ingest waits), or None

    def to_json(self) -> dict:
        return {"usage": self.usage.to_json(), "max_bytes": self.max_bytes, "samples": self.samples,
                "max_samples": self.max_samples, "removed": self.removed, "removed_bytes": self.removed_bytes,
                "quarantine_removed": self.quarantine_removed, "versions_removed": self.versions_removed,
                "compacted": list(self.compacted) if self.compacted else None, "over": self.over}


BAND = 0.05  # below ``target``, the share of a bound a removal goes further, so it is not one at every cycle


def _over(config: DaemonConfig, usage: Usage, samples: int, share: float = 1.0) -> str | None:
    """Why the data directory holds more than ``share`` of a bound, or None."""
    st = config.storage
    budget = st.max_bytes
    if budget is not None and usage.total > share * budget:
        return f"{usage.total} bytes kept, over {_share(share)}storage.max_bytes ({budget})"
    if st.max_samples is not None and samples > share * st.max_samples:
        return f"{samples} samples kept, over {_share(share)}storage.max_samples ({st.max_samples})"
    return None


def _share(share: float) -> str:
    return "" if share >= 1.0 else f"{100 * share:.0f} % of "


def _to_remove(config: DaemonConfig, usage: Usage, samples: int) -> tuple[int, RemovalReason]:
    """How many samples to remove to bring both bounds down to ``target - BAND``, and the bound that asks most."""
    st = config.storage
    low = round(st.target - BAND, 6)
    by_bytes = by_count = 0
    budget = st.max_bytes
    if budget is not None and usage.total > st.target * budget and samples:
        excess = usage.total - math.floor(low * budget)
        by_bytes = min(samples, math.ceil(excess / max(1, usage.blobs / samples)))
    if st.max_samples is not None and samples > st.target * st.max_samples:
        by_count = samples - math.floor(round(low * st.max_samples, 6))
    return (by_bytes, RemovalReason.BYTES) if by_bytes >= by_count else (by_count, RemovalReason.SAMPLES)


def enforce(config: DaemonConfig, store: Store, blobs: BlobStore, usage: DiskUsage) -> BudgetReport:
    """Check the bounds and remove what the policy says (see the module's docstring); once per cycle."""
    st = config.storage
    report = BudgetReport(max_bytes=st.max_bytes, max_samples=st.max_samples)
    report.usage = usage.measure()
    if report.usage.quarantine > st.max_quarantine_bytes:
        report.quarantine_removed = prune_quarantine(config, store, report.usage.quarantine)
        report.usage = usage.measure()
    report.samples = store.count_samples()
    if _over(config, report.usage, report.samples, st.target) is None:
        return report
    job = store.active_job()
    if job is not None:
        over = _over(config, report.usage, report.samples)
        report.over = None if over is None else over + f"; job {job.id} reads the samples until it ends"
        return report
    short = False
    for _ in range(_PASSES):  # the count is estimated from the mean blob; a pass short of the target goes again
        if _over(config, report.usage, report.samples, st.target) is None:
            break
        count, why = _to_remove(config, report.usage, report.samples)
        victims = _choose_in_store(store, count, config.heldout_fraction, st.keep_newest_per_class, st.reservoir)
        short = len(victims) < count
        if not victims:
            break
        before = report.usage.total
        freed = sum(_blob_bytes(blobs, sha) for sha in victims)
        store.remove_samples(victims, why.value, {"bytes_before": before, "blob_bytes": freed,
                                                  "max_bytes": st.max_bytes, "max_samples": st.max_samples})
        for sha in victims:  # after the commit: a crash here leaves orphans, removed at the next start
            blobs.remove(sha)
        report.removed += len(victims)
        report.removed_bytes += freed
        log.info("storage: removed %d samples (%d bytes of blobs) by the retention policy: %s", len(victims),
                 freed, _over(config, report.usage, report.samples, st.target))
        store.checkpoint()  # the write-ahead log holds every page the removal touched: fold it back
        report.usage = usage.measure()
        report.samples = store.count_samples()
    if report.removed:
        report.compacted = compact_journal(store)
        report.usage = usage.measure()
    budget = st.max_bytes
    if budget is not None and report.usage.total > st.target * budget and short:
        report.versions_removed = prune_versions(config, store)
        if report.versions_removed:
            report.usage = usage.measure()
    if _over(config, report.usage, report.samples) is not None:
        report.over = _over(config, report.usage, report.samples) + (": only protected samples remain" if short
                                                                     else "")
    return report


def _blob_bytes(blobs: BlobStore, key: str) -> int:
    try:
        st = os.stat(blobs.path(key))
    except FileNotFoundError:
        return 0
    return getattr(st, "st_blocks", 0) * 512 or st.st_size


def finish_removals(store: Store, blobs: BlobStore, contents: JournalContents | None = None) -> int:
    """Complete removals a crash cut short: rows the journal says were removed go, then their blobs
    (blobs of removals already committed are orphans, for :func:`~edgerev_daemon.storage.check.remove_garbage`).
    Returns how many rows went."""
    contents = contents if contents is not None else store.journal.read()
    removed = contents.removed()
    stored = set(store.blob_hashes())
    todo = sorted(removed & stored)
    if not todo:
        return 0
    last = {r.removed: r.why for r in contents.lines if isinstance(r, Removal)}
    why: dict[str, list[str]] = {}
    for sha in todo:
        why.setdefault(last[sha], []).append(sha)
    n = sum(store.finish_removals(shas, reason) for reason, shas in why.items() if shas)
    for sha in todo:
        blobs.remove(sha)
    log.warning("finished %d sample removals that a crash cut short", n)
    return n


def compact_journal(store: Store, min_removed: int = 256, force: bool = False) -> tuple[int, int] | None:
    """Compact the journal when the removals it lists since its last compaction are at least ``min_removed`` and
    half the samples kept (``force``: whenever it lists any); returns its size before and after, or None when
    left alone. Whether it is due is told by the store's count of removals against the one in the journal's
    header (one line read); only a compaction reads the whole file.

    Finishes no removal itself: when the store still holds a sample the journal says was removed (a commit
    that did not come), it leaves the journal alone, as a compacted journal would no longer say so (see
    :meth:`edgerev_daemon.storage.journal.Journal.compact`); the next start finishes that removal."""
    if not store.journal.exists():
        return None
    header = store.journal.header().get("removed")
    compacted = sum(int(v) for v in header.values()) if isinstance(header, dict) else 0
    since = sum(store.removal_counts().values()) - compacted
    if not force and (since < min_removed or since < store.count_samples() // 2):
        return None
    contents = store.journal.read()
    removals = sum(1 for r in contents.lines if isinstance(r, Removal))
    if not removals:
        return None
    if contents.removed() & set(store.blob_hashes()):
        return None
    before, after = store.journal.compact(contents)
    log.info("journal compacted: %d -> %d bytes (%d removed samples' lines dropped)", before, after, removals)
    return before, after


def prune_versions(config: DaemonConfig, store: Store) -> list[str]:
    """Over the byte budget with only protected samples left: delete the version directories a rollback does
    not need (all but the one in service and its parent, what a rollback goes back to), oldest first, below
    ``promotion.keep_last``; returns their names. Their rows stay (the history), marked pruned on disk."""
    registry = Registry(config.layout.root)
    current = registry.current()
    if current is None:
        return []
    version = store.get_version(current)
    protect = {current} | ({version.parent_id} if version is not None and version.parent_id else set())
    doomed = [n for n in registry.versions() if n not in protect]
    if not doomed:
        return []
    pruned = registry.prune(keep=len(protect), protect=protect)
    if pruned:
        store.add_event(EventKind.REMOVED, {"why": "max_bytes", "versions": pruned,
                                            "kept": sorted(protect), "max_bytes": config.storage.max_bytes})
        log.warning("storage: over storage.max_bytes with only protected samples left: removed versions %s "
                    "(kept %s for service and rollback)", ", ".join(pruned), ", ".join(sorted(protect)))
    return pruned


def prune_quarantine(config: DaemonConfig, store: Store, used: int) -> int:
    """Delete the oldest quarantined files (each with its reason file) until the quarantine is under its
    bound; returns how many files went. The file goes before its reason: a crash between leaves a reason
    alone (as a file rejected across file systems has: it stayed in the inbox), which goes in its turn."""
    folder = config.layout.quarantine
    bound = config.storage.max_quarantine_bytes
    entries: dict[str, list[os.DirEntry]] = {}
    for e in os.scandir(folder):
        if e.is_file(follow_symlinks=False) or e.is_symlink():
            base = e.name[: -len(SIDECAR)] if e.name.endswith(SIDECAR) else e.name
            entries.setdefault(base, []).append(e)

    def age(item: tuple[str, list[os.DirEntry]]) -> float:
        return min(f.stat(follow_symlinks=False).st_mtime for f in item[1])

    removed = freed = 0
    for _, files in sorted(entries.items(), key=age):
        if used - freed <= bound * config.storage.target:
            break
        for f in sorted(files, key=lambda f: f.name.endswith(SIDECAR)):  # the file, then its reason
            try:
                size = f.stat(follow_symlinks=False).st_blocks * 512
                os.unlink(f.path)
            except FileNotFoundError:
                continue
            freed += size
            removed += 1
    if removed:
        store.add_event(EventKind.REMOVED, {"why": "max_quarantine_bytes", "quarantine_files": removed,
                                            "bytes": freed, "max_quarantine_bytes": bound})
        log.info("storage: removed the %d oldest quarantine files (%d bytes) over storage.max_quarantine_bytes",
                 removed, freed)
    return removed


def fits_disk(config: DaemonConfig, usage: Usage) -> str | None:
    """Why the budget cannot fit the disk (what is kept now plus what is free, less ``min_free_space``), or None."""
    budget = config.storage.max_bytes
    free = free_bytes(config.layout.root)
    if budget is None or free is None:
        return None
    room = usage.total + free - config.storage.min_free_space
    if budget <= room:
        return None
    total = shutil.disk_usage(config.layout.root).total
    return (f"storage.max_bytes ({budget} bytes) cannot fit the disk: the daemon keeps {usage.total} bytes and "
            f"{free} are free of {total} (less storage.min_free_space, {config.storage.min_free_space}); "
            f"min_free_space will stop ingest at about {room} bytes kept")


def budget_status(config: DaemonConfig, store: Store, measure: Callable[[], Usage] | None = None) -> dict:
    """The budget's lines for ``status``, the HTTP page and ``/metrics``."""
    usage = (measure or shared(config.layout).measure)()
    samples = store.count_samples()
    return {"usage": usage.to_json(), "max_bytes": config.storage.max_bytes, "samples": samples,
            "max_samples": config.storage.max_samples, "max_quarantine_bytes": config.storage.max_quarantine_bytes,
            "over": _over(config, usage, samples), "removed": store.removal_counts(),
            "removed_by_split": store.removal_counts(by_split=True)}
