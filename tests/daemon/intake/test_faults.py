"""Hostile and broken input: each bad file is quarantined (or, for a manifest entry naming something
the daemon may not touch, refused) with its reason, and ingest goes on with the rest."""

from __future__ import annotations

import io
import json
import os
from dataclasses import replace

import pytest
from PIL import ImageFile

from edgerev_daemon import EventKind, check_consistency, ingest_inbox
from edgerev_daemon.intake.images import ImageRejected, normalize

from ..conftest import bomb_png, image_bytes, write


def corrupt_png() -> bytes:
    png = image_bytes(100, (64, 64))
    i = png.index(b"IDAT") + 20
    return png[:i] + bytes([png[i] ^ 0xFF]) + png[i + 1:]


def truncated_jpeg() -> bytes:
    jpg = image_bytes(101, (128, 128), "JPEG")
    return jpg[: len(jpg) // 2]


def flat_png(width: int, height: int) -> bytes:
    """A real, fully decodable image of one colour: a few kilobytes for millions of pixels."""
    from PIL import Image

    out = io.BytesIO()
    Image.new("RGB", (width, height), (90, 120, 30)).save(out, "PNG")
    return out.getvalue()


def test_the_fault_list(datadir, tmp_path):
    cfg = replace(datadir.config, limits=replace(datadir.config.limits, max_file_size=200_000, max_pixels=1_000_000))
    outside = write(tmp_path / "outside" / "secret.png", image_bytes(102))
    faults = {
        "cat/corrupt.png": (corrupt_png(), "corrupt or truncated PNG"),
        "cat/truncated.jpg": (truncated_jpeg(), "corrupt or truncated JPEG: image file is truncated"),
        "cat/empty.png": (b"", "empty file (0 bytes)"),
        "cat/notes.png": (b"remember the milk\n", "not a PNG or JPEG image"),
        "cat/bomb.png": (bomb_png(), "decompression bomb"),
        "cat/big.png": (flat_png(1200, 1000), "decompression bomb: the header claims 1200x1000"),
        "cat/huge.png": (b"\x89PNG" + b"\0" * 200_001, "200005 bytes, above limits.max_file_size (200000)"),
        "cat/anim.gif": (b"GIF89a", "extension '.gif' not allowed"),
        "bad label!/x.png": (image_bytes(104), "label 'bad label!' is not a valid name"),
        "loose.png": (image_bytes(105), "not in a label folder"),
    }
    for rel, (data, _) in faults.items():
        datadir.drop(rel, data)
    good = {f"cat/good{i}.png": image_bytes(110 + i) for i in range(3)} | {"dog/good.jpg": image_bytes(120, fmt="JPEG")}
    for rel, data in good.items():
        datadir.drop(rel, data)
    os.symlink(outside, datadir.inbox / "cat" / "link.png")
    os.symlink(outside.parent, datadir.inbox / "cat" / "linkdir")
    os.symlink(outside.parent, datadir.inbox / "escape")
    os.mkfifo(datadir.inbox / "cat" / "pipe.png")
    datadir.drop(".m/fine.png", image_bytes(121))
    datadir.drop(".m/badlabel.png", image_bytes(122))
    manifest = [
        {"path": "../outside/secret.png", "label": "cat"},
        {"path": str(outside), "label": "cat"},
        {"path": "escape/secret.png", "label": "cat"},
        {"path": "cat/link.png", "label": "cat"},
        {"path": ".m/badlabel.png", "label": "../../etc"},
        {"path": ".m/fine.png", "label": "bird"},
        {"label": "cat"},
    ]
    datadir.drop("upload.jsonl", ("\n".join(json.dumps(m) for m in manifest) + "\nnot json\n").encode())

    r = ingest_inbox(cfg, datadir.store, clock=datadir.clock)

    reasons = dict(r.quarantined)
    for rel, (_, reason) in faults.items():
        assert reason in reasons.pop(rel), (rel, reasons.get(rel))
    assert "symbolic link" in reasons.pop("cat/link.png")
    assert "symbolic link" in reasons.pop("cat/linkdir")
    assert "symbolic link" in reasons.pop("escape")
    assert reasons.pop("cat/pipe.png") == "not a regular file"
    assert "label '../../etc' is not a valid name" in reasons.pop(".m/badlabel.png")
    assert reasons == {}
    refused = dict(r.refused)
    assert "path traversal" in refused.pop("upload.jsonl:1")
    assert "absolute path" in refused.pop("upload.jsonl:2")
    assert "leaves the inbox through a symbolic link" in refused.pop("upload.jsonl:3")
    assert "is a symbolic link" in refused.pop("upload.jsonl:4")
    assert 'expected an object with "path" and "label"' in refused.pop("upload.jsonl:7")
    assert "not JSON" in refused.pop("upload.jsonl:8")
    assert refused == {}

    # the rest went in; the file outside the inbox was never touched
    assert r.accepted == len(good) + 1 and datadir.store.labels() == ["bird", "cat", "dog"]
    assert outside.read_bytes() == image_bytes(102)
    # every rejected file sits in quarantine with its reason; the inbox holds only folders
    assert [p for p in datadir.inbox.rglob("*") if not p.is_dir() or p.is_symlink()] == []
    sidecars = {json.loads(p.read_text())["source"]: json.loads(p.read_text())
                for p in datadir.quarantine.glob("*.reason.json")}
    assert set(sidecars) == {q for q, _ in r.quarantined}
    for side in sidecars.values():
        assert side["at"] == datadir.clock() and side["reason"]
    assert (datadir.quarantine / "escape").is_symlink()  # moved as a link; its target stays where it was
    events = datadir.store.events(limit=1000)
    assert sum(e.kind is EventKind.QUARANTINE for e in events) == len(r.quarantined)
    assert sum(e.kind is EventKind.REFUSED for e in events) == len(r.refused)
    assert check_consistency(datadir.store, datadir.blobs).clean


def test_quarantine_names_never_collide(datadir):
    datadir.drop("cat/broken.png", b"not an image")
    datadir.drop("dog/broken.png", b"not an image either")
    datadir.drop("dog/broken", b"no extension")
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert len(r.quarantined) == 3
    names = sorted(p.name for p in datadir.quarantine.iterdir())
    assert names == ["broken", "broken-1.png", "broken-1.png.reason.json", "broken.png", "broken.png.reason.json",
                     "broken.reason.json"]


def test_a_bomb_is_refused_from_its_header_without_decoding(monkeypatch):
    def no_decoding(self):
        raise AssertionError("pixels were decoded")

    monkeypatch.setattr(ImageFile.ImageFile, "load", no_decoding)
    for data in (bomb_png(), bomb_png(5000, 5000)):
        with pytest.raises(ImageRejected, match="decompression bomb"):
            normalize(data, 32, max_pixels=20_000_000)


def test_a_bad_manifest_is_quarantined_whole(datadir):
    datadir.drop("batch.jsonl", b"\xff\xfe not utf-8")
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert r.quarantined == [("batch.jsonl", "manifest is not UTF-8 text")]
