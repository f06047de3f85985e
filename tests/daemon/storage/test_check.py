"""The consistency check finds missing, damaged, orphan and stray blobs, and database damage."""

from __future__ import annotations

import sqlite3

from edgerev_daemon import check_consistency, ingest_inbox, remove_garbage

from ..conftest import image_bytes


def _ingested(datadir, n=4):
    for i in range(n):
        datadir.drop(f"cat/{i}.png", image_bytes(200 + i))
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    return [s.sha256 for s in datadir.store.samples()]


def test_a_fresh_store_is_clean(datadir):
    r = check_consistency(datadir.store, datadir.blobs)
    assert r.ok and r.clean and (r.samples, r.blobs) == (0, 0)
    _ingested(datadir)
    r = check_consistency(datadir.store, datadir.blobs)
    assert r.clean and (r.samples, r.blobs) == (4, 4) and r.to_json()["ok"]


def test_missing_and_damaged_blobs_are_problems(datadir):
    keys = _ingested(datadir)
    datadir.blobs.path(keys[0]).unlink()
    datadir.blobs.path(keys[1]).write_bytes(b"bit rot")
    r = check_consistency(datadir.store, datadir.blobs)
    assert not r.ok and r.missing == [keys[0]] and r.corrupt == [keys[1]]
    assert check_consistency(datadir.store, datadir.blobs, verify=False).corrupt == []


def test_orphans_and_strays_are_garbage_not_problems(datadir):
    _ingested(datadir)
    orphan = "ab" * 32
    datadir.blobs.write(orphan, b"a batch a crash cut short")
    stray = datadir.blobs.path(orphan).parent / ".x.png.tmp-123-456"
    stray.write_bytes(b"half")
    r = check_consistency(datadir.store, datadir.blobs)
    assert r.ok and not r.clean and r.orphans == [orphan] and r.strays == [stray]
    assert remove_garbage(r, datadir.blobs) == 2
    assert check_consistency(datadir.store, datadir.blobs).clean


def test_database_damage_is_reported(datadir):
    _ingested(datadir, 2)
    conn = sqlite3.connect(datadir.config.layout.database)
    conn.execute("PRAGMA foreign_keys = OFF")
    conn.execute("UPDATE samples SET label_id = 99")  # a label row that does not exist
    conn.commit()
    conn.close()
    r = check_consistency(datadir.store, datadir.blobs)
    assert not r.ok and len(r.database) == 2 and "samples row" in r.database[0]
