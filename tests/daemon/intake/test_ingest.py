"""Ingest of good files: normalized blobs, labels, dedupe, manifests, settle time, early stop."""

from __future__ import annotations

import hashlib
import io
import json
import os
from dataclasses import replace

import numpy as np
import pytest
import torch

from edgerev.train.data import decode_image
from edgerev_daemon import EventKind, StoreError, check_consistency, ingest_inbox
from edgerev_daemon.intake import ingest as ingest_mod
from edgerev_daemon.intake.watch import InboxWatch

from ..conftest import image_bytes


def blob_pixels(datadir, sha256: str) -> np.ndarray:
    from PIL import Image

    with Image.open(io.BytesIO(datadir.blobs.read(sha256))) as im:
        assert im.format == "PNG" and im.mode == "RGB"
        return np.asarray(im)


def leftover_files(inbox) -> list[str]:
    return sorted(str(p.relative_to(inbox)) for p in inbox.rglob("*") if not p.is_dir())


def test_good_files_are_stored_normalized_and_removed(datadir):
    files = {
        "cat/rgb.png": image_bytes(1, (32, 32)),
        "cat/grey.png": image_bytes(2, (50, 40), mode="L"),
        "dog/rgba.png": image_bytes(3, (20, 70), mode="RGBA"),
        "dog/palette.png": image_bytes(4, (33, 33), mode="P"),
        "bird/photo.jpg": image_bytes(5, (256, 192), "JPEG"),
        "bird/Upper.JPEG": image_bytes(6, (40, 40), "JPEG"),
    }
    paths = {rel: datadir.drop(rel, data) for rel, data in files.items()}
    expected = {rel: decode_image(path, 32) for rel, path in paths.items() if rel.endswith(".png")}
    report = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert (report.accepted, report.duplicates, report.quarantined, report.refused) == (6, 0, [], [])
    assert leftover_files(datadir.inbox) == []
    assert datadir.store.labels() == ["bird", "cat", "dog"]
    for rel, data in files.items():
        s = datadir.store.get_sample(hashlib.sha256(data).hexdigest())
        assert s.label == rel.split("/")[0] and s.source == rel
        px = blob_pixels(datadir, s.sha256)
        assert px.shape == (32, 32, 3)
        assert hashlib.sha256(datadir.blobs.read(s.sha256)).hexdigest() == s.blob_sha256
        if rel in expected:  # the same pixels the trainer's own decoder gives
            assert torch.equal(torch.from_numpy(px.copy()).permute(2, 0, 1), expected[rel])
    photo = datadir.store.get_sample(hashlib.sha256(files["bird/photo.jpg"]).hexdigest())
    assert (photo.width, photo.height) == (256, 192)
    assert check_consistency(datadir.store, datadir.blobs).clean


def test_exif_orientation_is_applied(datadir):
    from PIL import Image

    left_dark = np.zeros((32, 64, 3), dtype=np.uint8)
    left_dark[:, 32:] = 255
    im = Image.fromarray(left_dark)
    exif = im.getexif()
    exif[0x0112] = 6  # the camera was turned: rotate 90 degrees clockwise to view
    out = io.BytesIO()
    im.save(out, "JPEG", exif=exif, quality=95)
    datadir.drop("cat/turned.jpg", out.getvalue())
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    px = blob_pixels(datadir, datadir.store.samples()[0].sha256).astype(float)
    assert px[:12].mean() < 40 and px[-12:].mean() > 215  # dark half on top once upright


def test_duplicates_are_stored_once_and_recorded(datadir):
    same = image_bytes(7)
    datadir.drop("cat/a.png", same)
    datadir.drop("dog/b.png", same)  # same bytes, other label, same batch
    datadir.drop("cat/c.png", image_bytes(8))
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert (r.accepted, r.duplicates) == (2, 1)
    datadir.drop("cat/again.png", same)  # a later drop of a stored image
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert (r.accepted, r.duplicates, r.leftovers) == (0, 1, 0)
    assert datadir.store.count_samples() == 2 and leftover_files(datadir.inbox) == []
    dups = [e.message for e in datadir.store.events(EventKind.DUPLICATE)]
    assert [(d["source"], d["existing"], d["label_conflict"]) for d in dups] == [
        ("dog/b.png", "cat/a.png", True), ("cat/again.png", "cat/a.png", False)]


def test_manifest_entries_are_labelled_by_the_manifest(datadir):
    datadir.drop(".upload/x.png", image_bytes(10))
    datadir.drop("cat/y.png", image_bytes(11))  # listed: the manifest's label wins over the folder's
    datadir.drop("cat/z.png", image_bytes(12))
    lines = [{"path": ".upload/x.png", "label": "bird"}, {"path": "cat/y.png", "label": "dog"},
             {"path": "./.upload/x.png", "label": "bird"}, {"path": "gone.png", "label": "bird"}]
    datadir.drop("batch.jsonl", "\n".join(json.dumps(x) for x in lines).encode() + b"\n\n")
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert r.accepted == 3
    assert r.refused == [("batch.jsonl:3", "already listed by batch.jsonl"),
                         ("batch.jsonl:4", "no such file in the inbox")]
    by_source = {s.source: s.label for s in datadir.store.samples()}
    assert by_source == {".upload/x.png": "bird", "cat/y.png": "dog", "cat/z.png": "cat"}
    assert leftover_files(datadir.inbox) == []  # the manifest went once all it listed was handled


def test_unsettled_and_hidden_files_wait(datadir):
    cfg = replace(datadir.config, ingest=replace(datadir.config.ingest, settle_seconds=30.0))
    fresh = datadir.drop("cat/fresh.png", image_bytes(20))
    os.utime(fresh, (datadir.clock() - 5, datadir.clock() - 5))
    datadir.drop("cat/.partial.png", image_bytes(21))
    datadir.drop(".staging/x.png", image_bytes(22))
    watch = InboxWatch()  # what a running daemon remembers between polls
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch)
    assert (r.accepted, r.unsettled) == (0, 1)
    datadir.clock.advance(30)
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, watch=watch)
    assert (r.accepted, r.unsettled) == (1, 0)
    assert leftover_files(datadir.inbox) == [".staging/x.png", "cat/.partial.png"]


def test_stop_between_files(datadir):
    """A stop is asked before every file, not every batch (a batch of large images takes minutes): the files
    examined are committed as a shorter batch, the rest wait."""
    cfg = replace(datadir.config, ingest=replace(datadir.config.ingest, batch_files=2))
    for i in range(5):
        datadir.drop(f"cat/{i}.png", image_bytes(30 + i))
    asked = []
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock, stop=lambda: asked.append(1) or len(asked) >= 3)
    assert r.stopped and (r.accepted, r.batches) == (3, 2) and len(leftover_files(datadir.inbox)) == 2
    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock)
    assert (r.accepted, r.batches) == (2, 1) and leftover_files(datadir.inbox) == []


def test_a_file_replaced_while_ingested_stays_for_the_next_scan(datadir, monkeypatch):
    path = datadir.drop("cat/photo.png", image_bytes(40))
    real = ingest_mod.normalize

    def user_overwrites(data, size, max_pixels):
        path.write_bytes(image_bytes(41, (33, 33)))  # a new picture under the same name, mid-ingest
        return real(data, size, max_pixels)

    monkeypatch.setattr(ingest_mod, "normalize", user_overwrites)
    assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock).accepted == 1
    assert leftover_files(datadir.inbox) == ["cat/photo.png"]
    monkeypatch.undo()
    assert ingest_inbox(datadir.config, datadir.store, clock=datadir.clock).accepted == 1
    assert datadir.store.count_samples() == 2 and leftover_files(datadir.inbox) == []


def test_image_size_cannot_change_under_a_store(datadir):
    ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    with pytest.raises(StoreError, match="image_size 64"):
        ingest_inbox(replace(datadir.config, image_size=64), datadir.store, clock=datadir.clock)
