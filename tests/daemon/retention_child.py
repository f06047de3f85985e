"""The storage budget's removal in a process of its own, for the kill -9 tests (not collected by pytest).

    python retention_child.py DATA_DIR POINT:N

Opens the data directory the way the daemon does (lock, store), finishes what an earlier kill left
(:func:`~edgerev_daemon.storage.retention.finish_removals`), checks the budget (``storage.max_samples: 60``,
``keep_newest_per_class: 3``) and compacts the journal, sending itself SIGKILL at the N-th time it reaches
POINT:

- ``journal``: the removal lines were fsynced, the rows not yet deleted;
- ``commit``: the removal was committed, no blob deleted yet;
- ``blob``: just after the N-th blob was deleted;
- ``compact-write``: the compacted journal was written to its temporary name, not yet renamed;
- ``compact-rename``: the compacted journal was renamed into place, the folder not yet fsynced;
- ``finish``: a removal a kill cut short was finished in the store, its blobs not yet deleted;
- ``line``: the N-th line of the daemon's own code that runs (see ingest_child.py).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from ingest_child import die_at, die_at_line  # noqa: E402


def main() -> None:
    from edgerev_daemon import DataDirLock, Store, config_from_dict
    from edgerev_daemon.storage import blobs, journal, retention, store
    from edgerev_daemon.storage.usage import DiskUsage

    data_dir, (point, n) = sys.argv[1], sys.argv[2].split(":")
    if point == "line":
        die_at_line(int(n))
    elif point in ("compact-write", "compact-rename"):
        die_at(os, "replace", int(n), after=point == "compact-rename")
    else:
        target = {"journal": (journal.Journal, "append", True), "commit": (store.Store, "remove_samples", True),
                  "blob": (blobs.BlobStore, "remove", True), "finish": (store.Store, "finish_removals", True)}[point]
        die_at(*target[:2], int(n), target[2])
    config = config_from_dict({"data_dir": data_dir, "storage": {"min_free_space": 0, "max_samples": 60,
                                                                  "keep_newest_per_class": 3}})
    with DataDirLock(config.layout.root), Store(config.layout.database) as s:
        b = blobs.BlobStore(config.layout.blobs)
        retention.finish_removals(s, b)
        retention.enforce(config, s, b, DiskUsage(config.layout))
        retention.compact_journal(s, force=True)
    print("done", flush=True)


if __name__ == "__main__":
    main()
