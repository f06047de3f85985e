"""``kill -9`` of a daemon ingesting unlabelled images and the files that label them, at each dangerous point
and at random lines of its code: after each kill and the start's replay, ``check`` passes and ``rebuild``
recreates exactly the store; after a clean run every image is stored once, with the first label it was given."""

from __future__ import annotations

import hashlib
import json
import random
import signal
from collections import Counter
from pathlib import Path

import pytest

from edgerev_daemon import EventKind, Store, check_consistency
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.rebuild import replay
from edgerev_daemon.storage.retention import finish_removals

from ..conftest import image_bytes, make_config, rebuilt_store, write
from .test_crash import files_in

CHILD = Path(__file__).parents[1] / "ingest_child.py"


def _make_inbox(inbox: Path) -> dict:
    """Unlabelled images (a folder and a manifest) and labelled copies that come after them in the scan (label
    them) or before (store them labelled; the unlabelled copy is then a duplicate), fresh labelled images and a
    bad file. Returns hash -> the label it must end with (None: unlabelled), and the files that label."""
    final: dict[str, str | None] = {}
    labelers: set[str] = set()

    def put(rel: str, data: bytes) -> str:
        write(inbox / rel, data)
        return hashlib.sha256(data).hexdigest()

    lines = []
    for i in range(30):  # a manifest is read before the folders
        h = put(f".m/{i:03d}.png", image_bytes(5000 + i, (16, 16)))
        lines.append({"path": f".m/{i:03d}.png"} | ({"label": None} if i % 3 else {}))
        final[h] = None
        if i % 2 == 0:
            put(f"z/m{i:03d}.png", (inbox / f".m/{i:03d}.png").read_bytes())
            final[h], labelers = "z", labelers | {f"z/m{i:03d}.png"}
    write(inbox / "m.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())
    for i in range(60):
        h = put(f"unlabeled/{i:03d}.png", image_bytes(6000 + i, (16, 16)))
        final[h] = None
        if i % 5 == 1:  # folder a comes before unlabeled/: stored labelled, the unlabelled copy a duplicate
            put(f"a/dup{i:03d}.png", (inbox / f"unlabeled/{i:03d}.png").read_bytes())
            final[h] = "a"
        elif i % 3 == 0:  # folder z comes after: labels it
            put(f"z/{i:03d}.png", (inbox / f"unlabeled/{i:03d}.png").read_bytes())
            final[h], labelers = "z", labelers | {f"z/{i:03d}.png"}
    for i in range(40):
        final[put(f"a/{i:03d}.png", image_bytes(7000 + i, (16, 16)))] = "a"
    write(inbox / "unlabeled/zz_text.png", b"just text")
    return {"final": final, "labelers": labelers}


def _run_child(data_dir: Path, point: str | None) -> int:
    import subprocess
    import sys

    args = [sys.executable, str(CHILD), str(data_dir), "8"] + ([point] if point else [])
    child = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "ready", child.stderr.read()
        child.wait(timeout=600)  # a bound for a broken run only
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    return child.returncode


def _snapshot(store: Store) -> set[tuple]:
    return {(s.sha256, s.label, s.split, s.batch_id, s.blob_sha256, s.source) for s in store.samples()}


def _restart_and_compare(config, tmp_path: Path, expected: dict) -> None:
    """What the daemon's start does (finish removals, replay the journal), then: check passes, every image is in
    the inbox or stored, a stored label is never another than the one it must end with, and a rebuild of a copy
    recreates exactly the store."""
    blobs = BlobStore(config.layout.blobs)
    with Store(config.layout.database) as store:
        finish_removals(store, blobs)
        replay(store, blobs)
        report = check_consistency(store, blobs, inbox=config.inbox_path)
        assert report.ok and not report.labeling, report.to_json()
        stored = {s.sha256: s.label for s in store.samples()}
        mine = _snapshot(store)
    for h, label in stored.items():
        assert label is None or label == expected["final"][h], (h, label)
    with rebuilt_store(config, tmp_path) as s:
        assert _snapshot(s) == mine


@pytest.mark.slow
def test_kill_9_while_unlabelled_images_are_stored_and_labelled(tmp_path):
    config = make_config(tmp_path)
    expected = _make_inbox(config.inbox_path)
    rng = random.Random(25)
    # the labelling files (z/) come last in the scan, after the bad file's quarantine: the last points fall
    # among them (one may find its work done when an earlier kill came late; most must kill)
    kills = 0
    for point in ("journal:2", "commit:3", "remove:5", "blob:9", "moved:1", "journal:1", "remove:3", "commit:1",
                  "journal:1"):
        rc = _run_child(config.layout.root, point)
        assert rc in (0, -signal.SIGKILL), (point, rc)
        kills += rc == -signal.SIGKILL
        _restart_and_compare(config, tmp_path, expected)
    assert kills >= 7
    for _ in range(3):  # at a random line of the daemon's code
        _run_child(config.layout.root, f"line:{rng.randint(1, 30_000)}")
        _restart_and_compare(config, tmp_path, expected)

    assert _run_child(config.layout.root, None) == 0
    _restart_and_compare(config, tmp_path, expected)
    assert files_in(config.inbox_path) == []
    with Store(config.layout.database) as store:
        assert {s.sha256: s.label for s in store.samples()} == expected["final"]
        events = store.events(limit=100_000)
        labeled = Counter(e.message["source"] for e in events if e.kind is EventKind.LABELED)
        assert labeled == Counter(expected["labelers"])  # each file that labelled did so once
        assert check_consistency(store, BlobStore(config.layout.blobs), inbox=config.inbox_path).ok
