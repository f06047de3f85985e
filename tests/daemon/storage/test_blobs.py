"""Content-addressed blobs: layout, batched durability (syncfs or per-file fsync), write-back errors."""

from __future__ import annotations

import errno
import hashlib
import os

import pytest

from edgerev_daemon import ingest_inbox
from edgerev_daemon.storage import blobs as blobs_mod
from edgerev_daemon.storage.blobs import BlobStore

from ..conftest import image_bytes


def key(i: int) -> str:
    return hashlib.sha256(bytes([i])).hexdigest()


def test_layout_and_scan(tmp_path):
    b = BlobStore(tmp_path / "blobs")
    k = key(1)
    path = b.write(k, b"png bytes")
    assert path == tmp_path / "blobs" / k[:2] / (k[2:] + ".png") and b.read(k) == b"png bytes" and b.exists(k)
    b.write(k, b"png bytes")  # rewriting is harmless
    (path.parent / "stranger.txt").write_text("?")
    assert {(found, p.name) for found, p in b.scan()} == {(k, path.name), (None, "stranger.txt")}
    with pytest.raises(ValueError, match="not a SHA-256"):
        b.path("../../etc/passwd")
    b.remove(k)
    assert not b.exists(k)


def test_sync_falls_back_to_fsync_of_every_file_and_folder(tmp_path, monkeypatch):
    b = BlobStore(tmp_path)
    keys = [key(i) for i in range(5)]
    for k in keys:
        b.write(k, b"x")
    synced = []
    real = os.fsync
    monkeypatch.setattr(blobs_mod, "_syncfs", None)
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    b.sync()
    assert set(synced) == {str(b.path(k)) for k in keys} | {str(b.path(k).parent) for k in keys}
    synced.clear()
    b.sync()  # nothing new written: nothing to do
    assert synced == []


@pytest.mark.skipif(blobs_mod._syncfs is None, reason="syncfs is Linux-only")
def test_syncfs_is_one_call_per_batch(tmp_path, monkeypatch):
    calls = []
    real = blobs_mod._syncfs
    monkeypatch.setattr(blobs_mod, "_syncfs", lambda path: calls.append(path) or real(path))
    b = BlobStore(tmp_path)
    for i in range(20):
        b.write(key(i), b"x")
    b.sync()
    assert calls == [tmp_path]


def test_a_write_back_error_abandons_the_batch(datadir, monkeypatch):
    def eio(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(blobs_mod, "_syncfs", eio)
    datadir.drop("cat/a.png", image_bytes(500))
    with pytest.raises(OSError, match="Input/output error"):
        ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert datadir.store.count_samples() == 0 and (datadir.inbox / "cat/a.png").exists()
