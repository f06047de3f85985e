"""Ingest never reaches outside the inbox, whatever is swapped for a symbolic link and when.

A label folder is replaced by a link to an outside folder (holding tempting images, some under the
very names the inbox had) at chosen instants, and by a separate process in a loop racing the ingest
loop. Nothing outside may be read into the store, moved into quarantine or deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

from edgerev_daemon import EventKind, ingest_inbox
from edgerev_daemon.intake import ingest as ingest_mod

from ..conftest import image_bytes
from .test_hostile_input import snapshot

SWAPPER = r"""
import os, sys
inbox, outside = sys.argv[1], sys.argv[2]
os.chdir(inbox)
swaps = 0
def quiet(f, *a):
    try:
        f(*a)
    except OSError:
        pass
while not os.path.exists(".stop"):
    if not os.path.lexists(".lnk") and not os.path.islink("cat"):
        quiet(os.symlink, outside, ".lnk")
    if os.path.isdir("cat") and not os.path.islink("cat"):
        quiet(os.rename, "cat", ".real")
    if not os.path.lexists("cat") and os.path.islink(".lnk"):
        quiet(os.rename, ".lnk", "cat")
    if os.path.islink("cat"):
        quiet(os.rename, "cat", ".lnk")
    if not os.path.lexists("cat") and os.path.isdir(".real"):
        quiet(os.rename, ".real", "cat")
    swaps += 1
    if swaps == 1:
        print("swapping", flush=True)
if os.path.islink("cat"):
    os.unlink("cat")
if os.path.isdir(".real"):
    os.rename(".real", "cat")
print(swaps, flush=True)
"""


def outside_folder(root: Path, n: int) -> tuple[Path, set[str]]:
    """A folder outside the inbox with images named like the inbox's; returns it and their hashes."""
    out = root / "outside"
    (out / "deeper").mkdir(parents=True)
    hashes = set()
    for i in range(n):
        for path in (out / f"{i}.png", out / "deeper" / f"{i}.png"):
            data = image_bytes(10_000 + len(hashes))
            path.write_bytes(data)
            hashes.add(hashlib.sha256(data).hexdigest())
    return out, hashes


def assert_untouched(datadir, outside: Path, before: dict, outside_hashes: set[str]) -> None:
    assert snapshot(outside) == before
    assert not {s.sha256 for s in datadir.store.samples()} & outside_hashes
    for p in datadir.quarantine.iterdir():
        if p.is_file() and not p.is_symlink():
            assert hashlib.sha256(p.read_bytes()).hexdigest() not in outside_hashes


def swap_to_link(inbox: Path, outside: Path) -> None:
    os.rename(inbox / "cat", inbox / ".real")
    os.symlink(outside, inbox / "cat")


def test_a_folder_swapped_between_scan_and_read_is_not_followed(datadir, tmp_path, monkeypatch):
    outside, hashes = outside_folder(tmp_path, 3)
    before = snapshot(outside)
    for i in range(3):
        datadir.drop(f"cat/{i}.png", image_bytes(i))
    datadir.drop("cat/deeper/0.png", image_bytes(9))
    real = ingest_mod._precheck
    swapped = []

    def swap_after_the_scan(root_fd, c, extensions):
        if not swapped:
            swap_to_link(datadir.inbox, outside)
            swapped.append(c.source)
        return real(root_fd, c, extensions)

    monkeypatch.setattr(ingest_mod, "_precheck", swap_after_the_scan)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert swapped and r.accepted == 0
    assert_untouched(datadir, outside, before, hashes)


def test_a_folder_swapped_between_read_and_remove_keeps_the_outside_file(datadir, tmp_path, monkeypatch):
    outside, hashes = outside_folder(tmp_path, 2)
    before = snapshot(outside)
    for i in range(2):
        datadir.drop(f"cat/{i}.png", image_bytes(i))
    real = ingest_mod.normalize
    swapped = []

    def swap_after_the_read(data, size, max_pixels):
        if not swapped:
            swap_to_link(datadir.inbox, outside)
            swapped.append(True)
        return real(data, size, max_pixels)

    monkeypatch.setattr(ingest_mod, "normalize", swap_after_the_read)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert r.accepted == 1  # read before the swap: stored, and its original is still in .real/
    assert sorted(p.name for p in (datadir.inbox / ".real").iterdir()) == ["0.png", "1.png"]
    assert_untouched(datadir, outside, before, hashes)


def test_a_manifest_entry_through_a_swapped_folder_is_refused(datadir, tmp_path, monkeypatch):
    outside, hashes = outside_folder(tmp_path, 1)
    before = snapshot(outside)
    datadir.drop("cat/0.png", image_bytes(0))
    datadir.drop("m.jsonl", (json.dumps({"path": "cat/0.png", "label": "dog"}) + "\n").encode())
    swap_to_link(datadir.inbox, outside)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert r.accepted == 0 and [w for w, _ in r.refused] == ["m.jsonl:1"]
    assert_untouched(datadir, outside, before, hashes)


def test_a_swapper_process_racing_the_ingest_loop_never_reaches_outside(datadir, tmp_path):
    outside, hashes = outside_folder(tmp_path, 20)
    before = snapshot(outside)
    inside = {hashlib.sha256(image_bytes(i)).hexdigest() for i in range(40)}
    for i in range(20):
        datadir.drop(f"cat/{i}.png", image_bytes(i))
        datadir.drop(f"cat/deeper/{i}.png", image_bytes(20 + i))
    swapper = subprocess.Popen([sys.executable, "-c", SWAPPER, str(datadir.inbox), str(outside)],
                               stdout=subprocess.PIPE, text=True)
    try:
        assert swapper.stdout.readline().strip() == "swapping"
        for i in range(150):
            (datadir.inbox / f"m{i}.jsonl").write_text(
                "".join(json.dumps({"path": f"cat/{j}.png", "label": "dog"}) + "\n" for j in range(i % 5, 20, 5)))
            ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
            assert_untouched(datadir, outside, before, hashes)
    finally:
        (datadir.inbox / ".stop").touch()
        swaps = int(swapper.stdout.readline())
        swapper.wait()
    assert swaps > 0
    assert_untouched(datadir, outside, before, hashes)
    (datadir.inbox / ".stop").unlink()
    for p in datadir.inbox.glob("*.jsonl"):
        p.unlink()
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)  # the swapping is over: the rest goes in
    assert {s.sha256 for s in datadir.store.samples()} == inside
    assert all(e.message["source"] != "cat" or "link" in e.message["reason"]
               for e in datadir.store.events(EventKind.QUARANTINE, limit=10_000))
    assert not [p for p in datadir.quarantine.iterdir() if p.is_dir() and not p.is_symlink()]


def test_a_folder_swapped_in_for_a_judged_link_is_not_quarantined(datadir, tmp_path, monkeypatch):
    outside, hashes = outside_folder(tmp_path, 1)
    before = snapshot(outside)
    os.symlink(outside, datadir.inbox / "cat")  # judged: a link, to be quarantined
    real = ingest_mod._precheck

    def swap_in_a_folder(root_fd, c, extensions):
        why = real(root_fd, c, extensions)
        os.rename(datadir.inbox / "cat", datadir.inbox / ".gone")
        datadir.drop("cat/0.png", image_bytes(0))  # a real label folder under the judged name
        return why

    monkeypatch.setattr(ingest_mod, "_precheck", swap_in_a_folder)
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert r.quarantined == [] and list(datadir.quarantine.iterdir()) == []
    monkeypatch.undo()
    assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock).accepted == 1
    assert_untouched(datadir, outside, before, hashes)
