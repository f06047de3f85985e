"""Ingest throughput of the daemon, in images per second, written as JSON.

Two inboxes of generated images (the trainer's learnable synthetic set): small PNGs already at the
model's input size, and larger JPEGs that ingest decodes and shrinks. Each is ingested into a fresh
data directory on the disk the script is pointed at (``--dir``; a temporary folder by default), with
every fsync the daemon does for real; the time covers the scan, hashing, decoding, normalization,
blob writes, the SQLite commits and the inbox removals. ``--fsync-each`` makes blobs durable with one
fsync per file and folder instead of one ``syncfs`` per batch (the fallback off Linux). ``journal_share``
is the fraction of the ingest time spent appending and fsyncing the sample journal, measured in the
same run.

    python benchmarks/ingest.py --out results/ingest.json
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import write_json


def make_inbox(inbox: Path, n: int, size: int, fmt: str, classes: int, seed: int) -> int:
    """``n`` images of ``size x size`` in ``inbox/<class>/``; returns their total bytes."""
    from PIL import Image

    from edgerev.train.data import SyntheticImages

    data = SyntheticImages(n, classes, size, seed=seed)
    total = 0
    for i in range(n):
        img, label = data[i]
        folder = inbox / data.classes[label]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:05d}.{'png' if fmt == 'PNG' else 'jpg'}"
        Image.fromarray(img.permute(1, 2, 0).numpy()).save(path, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
        total += path.stat().st_size
    return total


def run_case(root: Path, name: str, n: int, size: int, fmt: str, image_size: int, batch_files: int) -> dict:
    from edgerev_daemon import DataDirLock, Store, check_consistency, config_from_dict, ingest_inbox, prepare
    from edgerev_daemon.storage.blobs import BlobStore
    from edgerev_daemon.storage.journal import Journal

    spent = [0.0]
    real_append = Journal.append

    def timed_append(self, records):  # the journal's own cost, as a share of the same run
        t0 = time.perf_counter()
        try:
            return real_append(self, records)
        finally:
            spent[0] += time.perf_counter() - t0

    Journal.append = timed_append
    folder = root / name
    cfg = config_from_dict({"data_dir": str(folder / "data"), "image_size": image_size,
                            "ingest": {"settle_seconds": 0, "batch_files": batch_files}})
    input_bytes = make_inbox(cfg.inbox_path, n, size, fmt, classes=10, seed=1)
    with DataDirLock(cfg.layout.root):
        prepare(cfg.layout, cfg.inbox_path)
        with Store(cfg.layout.database) as store:
            t = time.perf_counter()
            report = ingest_inbox(cfg, store)
            wall = time.perf_counter() - t
            check = check_consistency(store, BlobStore(cfg.layout.blobs))
    Journal.append = real_append
    assert report.accepted == n and check.clean, (report.to_json(), check.to_json())
    return {"case": name, "images": n, "input": f"{fmt} {size}x{size}", "stored": f"PNG {image_size}x{image_size}",
            "input_mib": round(input_bytes / 2**20, 2), "batch_files": batch_files, "batches": report.batches,
            "seconds": round(wall, 3), "images_per_second": round(n / wall, 1),
            "journal_share": round(spent[0] / wall, 4)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--png", type=int, default=2000, help="PNG images (32x32)")
    p.add_argument("--jpeg", type=int, default=500, help="JPEG images (256x256)")
    p.add_argument("--image-size", type=int, default=32)
    p.add_argument("--batch-files", type=int, default=256)
    p.add_argument("--dir", type=Path, help="where to build the data directories (default: a temporary folder)")
    p.add_argument("--fsync-each", action="store_true", help="fsync every blob instead of one syncfs per batch")
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    from edgerev_daemon.storage import blobs

    if a.fsync_each:
        blobs._syncfs = None
    with tempfile.TemporaryDirectory(dir=a.dir) as tmp:
        root = Path(tmp)
        cases = [run_case(root, "png32", a.png, 32, "PNG", a.image_size, a.batch_files),
                 run_case(root, "jpeg256", a.jpeg, 256, "JPEG", a.image_size, a.batch_files)]
    import PIL

    write_json({"python": sys.version.split()[0], "pillow": PIL.__version__, "machine": platform.machine(),
                "cpus": os.cpu_count(), "load_average": os.getloadavg()[0],
                "blob_durability": "syncfs per batch" if blobs._syncfs else "fsync per file and folder",
                "cases": cases}, a.out)


if __name__ == "__main__":
    main()
