"""What the storage budget costs: measuring the data directory, a removal, a journal compaction, written as JSON.

A data directory is filled with ``--samples`` samples of ``--labels`` classes the way ingest records them
(a blob file written and synced per batch of 256, one transaction with its journal lines each; the blobs are
random bytes of a 32x32 PNG's size, so nothing is decoded), on the disk the script is pointed at (``--dir``;
a temporary folder by default). Then, timed: the first measure of the data directory (every blob folder
walked), the next one (each folder's sum cached under its mtime: what every cycle pays), a removal by the
retention policy down to ``--keep`` of the samples (``storage.max_samples`` with ``target`` 0.9: journal
lines fsynced, rows deleted, blobs unlinked, the write-ahead log checkpointed) with the Python memory it
peaked at (tracemalloc), a compaction of the journal and its size before and after, and ``check``'s
comparison of the store, the journal and the blob folder.

    python benchmarks/retention.py --samples 20000 --out results/retention.json
"""

from __future__ import annotations

import argparse
import hashlib
import os
import platform
import random
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

from _common import write_json


def fill(store, blobs, n: int, labels: int, heldout_fraction: float, seed: int) -> None:
    from edgerev_daemon.storage.records import NewSample

    rng = random.Random(seed)
    batch: list = []
    for i in range(n):
        data = rng.randbytes(3000)
        sha = hashlib.sha256(data + i.to_bytes(8, "big")).hexdigest()
        blobs.write(sha, data)
        label = f"class{min(labels - 1, int(rng.paretovariate(1.2)) - 1)}"  # a few frequent classes, a long tail
        batch.append(NewSample(sha, label, 32, 32, hashlib.sha256(data).hexdigest(), f"{label}/{i}.png"))
        if len(batch) == 256 or i == n - 1:
            blobs.sync()
            store.record_batch(batch, [], heldout_fraction)
            batch = []


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--samples", type=int, default=20_000)
    p.add_argument("--labels", type=int, default=20)
    p.add_argument("--keep", type=float, default=0.8, help="storage.max_samples as a share of --samples")
    p.add_argument("--dir", type=Path, default=None, help="where the data directory goes (default: a temporary one)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()

    from edgerev_daemon.config import config_from_dict
    from edgerev_daemon.layout import prepare
    from edgerev_daemon.service.lock import DataDirLock
    from edgerev_daemon.storage.blobs import BlobStore
    from edgerev_daemon.storage.check import check_consistency
    from edgerev_daemon.storage.retention import compact_journal, enforce
    from edgerev_daemon.storage.store import Store
    from edgerev_daemon.storage.usage import DiskUsage

    with tempfile.TemporaryDirectory(dir=args.dir, prefix="edgerev-retention-") as tmp:
        max_samples = int(args.keep * args.samples)
        config = config_from_dict({"data_dir": str(Path(tmp) / "data"),
                                   "storage": {"min_free_space": 0, "max_samples": max_samples}})
        prepare(config.layout, config.inbox_path)
        with DataDirLock(config.layout.root), Store(config.layout.database) as store:
            blobs = BlobStore(config.layout.blobs)
            t = time.perf_counter()
            fill(store, blobs, args.samples, args.labels, config.heldout_fraction, args.seed)
            fill_s = time.perf_counter() - t
            usage = DiskUsage(config.layout, wall=lambda: time.time() + 10)  # every folder settled: cache used
            t = time.perf_counter()
            before = usage.measure()
            cold_s = time.perf_counter() - t
            t = time.perf_counter()
            usage.measure()
            warm_s = time.perf_counter() - t
            labels_before = store.split_label_counts()
            tracemalloc.start()
            t = time.perf_counter()
            report = enforce(config, store, blobs, usage)
            remove_s = time.perf_counter() - t
            peak = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            journal_before = config.layout.journal.stat().st_size
            t = time.perf_counter()
            compacted = compact_journal(store, force=True)
            compact_s = time.perf_counter() - t
            t = time.perf_counter()
            check = check_consistency(store, blobs, verify=False, inbox=config.inbox_path)
            check_s = time.perf_counter() - t
            labels_after = store.split_label_counts()
            after = usage.measure()
    result = {
        "benchmark": "retention",
        "machine": {"python": sys.version.split()[0], "platform": platform.platform(), "cpus": os.cpu_count()},
        "samples": args.samples, "labels": args.labels, "max_samples": max_samples,
        "fill_seconds": round(fill_s, 2),
        "bytes_before": before.to_json(), "bytes_after": after.to_json(),
        "measure_first_seconds": round(cold_s, 4), "measure_cached_seconds": round(warm_s, 4),
        "removed": report.removed, "remove_seconds": round(remove_s, 2),
        "remove_ms_per_sample": round(1000 * remove_s / max(1, report.removed), 3),
        "remove_python_peak_bytes": peak,
        "journal_bytes_before_compaction": journal_before,
        "journal_bytes_after_compaction": compacted[1] if compacted else journal_before,
        "compact_seconds": round(compact_s, 3),
        "check_seconds": round(check_s, 2), "check_clean": check.clean,
        "smallest_class_before": min(labels_before.values()), "smallest_class_after": min(labels_after.values()),
        "split_label_groups_before": len(labels_before), "split_label_groups_after": len(labels_after),
    }
    write_json(result, args.out)


if __name__ == "__main__":
    main()
