"""Consistency of the store and the blob folder: what the soak and crash tests assert, and what a
``check`` command prints.

Problems (``ok`` is false): a sample whose blob is missing, a blob whose bytes do not hash to what
the sample row recorded (damaged on disk), and anything ``PRAGMA integrity_check`` or
``foreign_key_check`` reports; a store that lost rows (journal samples the store lacks whose files have
left the inbox: only a commit removes them) or a journal that lacks stored samples (the store could not
be rebuilt); a sample whose label or split the journal says otherwise (``relabeled``: a rebuild would
give it another); and, when a registry is given, a version in service that is not complete or not
intact (its files against the SHA-256 recorded in its manifest). Not problems: samples being removed
(the journal says so, the store's commit did not come: the next start finishes it), unlabelled samples
the journal gave a label (``labeling``: the labelling's commit did not come; the next start replays it),
and what a rebuild would lose (``rebuild_would_lose``: the rows only the store holds, which
:func:`edgerev_daemon.storage.rebuild.rebuild` salvages from a readable old store and otherwise cannot
recreate). Garbage (harmless, removable with
:func:`remove_garbage` while the daemon's lock is held): orphan blobs that neither a sample nor the journal
names (written by a batch that a crash cut short before its journal lines) and stray files (a crash's
temporary files).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, field
from pathlib import Path

from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.store import Store


@dataclass
class CheckReport:
    samples: int = 0
    blobs: int = 0
    missing: list[str] = field(default_factory=list)    # sample hashes without a blob
    corrupt: list[str] = field(default_factory=list)    # sample hashes whose blob's bytes changed
    orphans: list[str] = field(default_factory=list)    # blob keys no sample names
    strays: list[Path] = field(default_factory=list)    # other files in the blob folder
    database: list[str] = field(default_factory=list)   # integrity and foreign-key findings
    journal: int = 0                                     # samples the journal knows
    lost: list[str] = field(default_factory=list)       # journal samples the store lost (file gone from the inbox)
    pending: list[str] = field(default_factory=list)    # journal samples not yet committed (file still in the inbox)
    unjournaled: list[str] = field(default_factory=list)  # stored samples the journal lacks
    service: list[str] = field(default_factory=list)    # what is wrong with the version in service
    removing: list[str] = field(default_factory=list)   # stored samples the journal says were removed (a crash
    #                                                     before the removal's commit; the next start finishes it)
    history: dict[str, int] = field(default_factory=dict)  # what a rebuild would lose: rows the journal lacks
    labeling: list[str] = field(default_factory=list)   # unlabelled here, labelled by the journal (replayed at start)
    relabeled: list[str] = field(default_factory=list)  # a label or split the journal says otherwise

    @property
    def ok(self) -> bool:
        """No sample lost or damaged, a sound database, a journal that knows every sample, and an intact
        version in service (garbage and pending journal lines allowed)."""
        return not (self.missing or self.corrupt or self.database or self.lost or self.unjournaled or self.service
                    or self.relabeled)

    @property
    def clean(self) -> bool:
        """:attr:`ok` and no garbage either."""
        return self.ok and not (self.orphans or self.strays)

    def to_json(self) -> dict:
        return {"ok": self.ok, "clean": self.clean, "samples": self.samples, "blobs": self.blobs,
                "missing": self.missing, "corrupt": self.corrupt, "orphans": self.orphans,
                "strays": [str(p) for p in self.strays], "database": self.database, "journal": self.journal,
                "lost": self.lost, "pending": self.pending, "unjournaled": self.unjournaled, "service": self.service,
                "removing": self.removing, "labeling": self.labeling, "relabeled": self.relabeled,
                "rebuild_would_lose": self.history}


def check_consistency(store: Store, blobs: BlobStore, verify: bool = True, inbox: Path | None = None,
                      registry: Registry | None = None) -> CheckReport:
    """Compare every sample row with its blob and the journal, and the blob folder with the rows.

    Args:
        verify: hash every blob (reads them all); ``False`` checks only that each exists.
        inbox: where the samples came from: a journal sample the store lacks is *lost* when its file
            has left the inbox, *pending* when it is still there. Without it, every such sample counts
            as pending.
        registry: also check that the version in service is complete and intact.
    """
    expected = store.blob_hashes()
    report = CheckReport(samples=len(expected), database=store.integrity_problems())
    journaled = _compare_journal(store, report, inbox)
    if registry is not None:
        report.service = service_problems(registry)
    on_disk: set[str] = set()
    for key, path in blobs.scan():
        if key is None:
            report.strays.append(path)
            continue
        on_disk.add(key)
        if key not in expected:
            if key not in journaled:  # a journaled blob is a sample the store lacks, never garbage
                report.orphans.append(key)
        elif verify and hashlib.sha256(path.read_bytes()).hexdigest() != expected[key]:
            report.corrupt.append(key)
    report.blobs = len(on_disk)
    report.missing = sorted(k for k in expected if k not in on_disk)
    return report


def _compare_journal(store: Store, report: CheckReport, inbox: Path | None) -> set[str]:
    """Fill the journal findings; returns the hashes the journal names."""
    if not store.journal.exists():
        report.unjournaled = sorted(store.blob_hashes()) if report.samples else []
        return set()
    contents = store.journal.read()
    journaled = contents.samples()
    stored = store.blob_hashes()
    report.journal = len(journaled)
    report.removing = sorted(contents.removed() & set(stored))
    for sha, r in journaled.items():
        if sha in stored:
            continue
        if inbox is not None and not os.path.lexists(inbox / r.source):
            report.lost.append(sha)
        else:
            report.pending.append(sha)
    gone = set(report.removing)
    report.unjournaled = sorted(sha for sha in stored if sha not in journaled and sha not in gone)
    for sha, (label, split) in store.labels_by_hash().items():
        r = journaled.get(sha)
        if r is None or (r.label, r.split) == (label, split):
            continue
        (report.labeling if label is None else report.relabeled).append(sha)
    report.labeling.sort()
    report.relabeled.sort()
    report.history = store.unjournaled_history()
    return set(journaled)


def service_problems(registry: Registry) -> list[str]:
    """What is wrong with ``current`` and the version it links to (empty: in service and intact)."""
    state, name = registry.link_state()
    if state == "missing":
        return [f"{registry.link} is missing"] if registry.versions() else []
    if state != "ok":
        return [f"{registry.link} {state}"]
    return registry.verify(name)


def remove_garbage(report: CheckReport, blobs: BlobStore) -> int:
    """Delete the orphans and strays a report found; returns how many files went. Call it only while
    holding the data directory's lock: an orphan may be a blob of a batch not yet committed.

    Blobs are deleted only on the word of an intact store that holds samples and a journal that does
    not name them either: a store that was emptied or lost rows (see :mod:`edgerev_daemon.storage.rebuild`)
    would call every blob an orphan.
    """
    n = 0
    if report.samples == 0 or report.database or report.lost or report.unjournaled or report.journal < report.samples:
        orphans: list[str] = []
    else:
        orphans = report.orphans
    for key in orphans:
        blobs.remove(key)
        n += 1
    for path in report.strays:
        if path.is_file() or path.is_symlink():
            path.unlink()
            n += 1
    return n
