"""No input stops ingest: any bytes as a name, any manifest line, any kind of file.

Property-based (hypothesis) over names and manifest lines, plus hand-picked cases that name each
known trap. Every test checks the same invariant: the call returns, every file is accounted for
(stored, duplicate, quarantined, refused, or skipped because hidden), every recorded name is the
escaped text of :mod:`edgerev_daemon.intake.names` (it maps back to the original bytes), and nothing outside
the inbox and the data directory changed.
"""

from __future__ import annotations

import json
import os
import socket
import stat
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerev_daemon import EventKind, ingest_inbox
from edgerev_daemon.intake.manifest import MAX_DEPTH, MAX_LINE
from edgerev_daemon.intake.names import name_bytes, shown, shown_path

from ..conftest import image_bytes, make_config, open_data_dir

NAMES = st.binary(min_size=1, max_size=255).filter(
    lambda b: b"/" not in b and b"\0" not in b and b not in (b".", b".."))
EXAMPLES = 100


def snapshot(folder: Path) -> dict[bytes, tuple[int, bytes | None]]:
    """Every entry under ``folder`` (bytes paths): its mode and, for a regular file, its content."""
    out = {}
    for root, dirs, files in os.walk(os.fsencode(folder)):
        for name in dirs + files:
            p = os.path.join(root, name)
            mode = os.lstat(p).st_mode
            out[p] = (stat.S_IFMT(mode), Path(os.fsdecode(p)).read_bytes() if stat.S_ISREG(mode) else None)
    return out


def clean_text(text: str) -> bool:
    """What every recorded name must be: encodable, no control character, and reversible."""
    text.encode("utf-8")
    return not any(ord(c) < 32 or ord(c) == 127 for c in text)


class Sandbox:
    """A data directory, its inbox, and a folder outside both that nothing may touch."""

    def __init__(self, root: Path) -> None:
        self.outside = root / "outside"
        (self.outside / "sub").mkdir(parents=True)
        (self.outside / "secret.png").write_bytes(image_bytes(999))
        (self.outside / "sub" / "x.png").write_bytes(image_bytes(998))
        self.d = open_data_dir(make_config(root))
        self.before = snapshot(self.outside)

    def close(self) -> None:
        assert snapshot(self.outside) == self.before, "something outside the inbox changed"
        self.d.store.close()
        self.d.lock.release()

    def put(self, parts: list[bytes], data: bytes) -> None:
        inbox = os.fsencode(self.d.inbox)
        folder = os.path.join(inbox, *parts[:-1]) if len(parts) > 1 else inbox
        os.makedirs(folder, exist_ok=True)
        with open(os.path.join(folder, parts[-1]), "wb") as f:
            f.write(data)

    def recorded_sources(self) -> set[str]:
        s = self.d.store
        out = {x.source for x in s.samples()}
        for kind in (EventKind.QUARANTINE, EventKind.DUPLICATE):
            out |= {e.message["source"] for e in s.events(kind, limit=10_000)}
        return out


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(files=st.lists(st.tuples(st.none() | NAMES, NAMES.filter(lambda b: not b.endswith(b".jsonl")), st.booleans()),
                      min_size=1, max_size=6, unique_by=lambda t: (t[0], t[1])))
def test_any_bytes_as_folder_and_file_names(files):
    """``None`` as the folder: a file directly in the inbox (no label: quarantined)."""
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(Path(tmp))
        try:
            expected = {}
            folders = {f for f, _, _ in files if f is not None}
            for i, (folder, name, good) in enumerate(files):
                parts = [name] if folder is None else [folder, name]
                if folder is None and name in folders:
                    continue  # that name is a folder already
                box.put(parts, image_bytes(i) if good else b"not an image %d" % i)
                if not any(p.startswith(b".") for p in parts):
                    expected[b"/".join(parts)] = shown_path([os.fsdecode(p) for p in parts])
            r = ingest_inbox(box.d.config, box.d.store, clock=box.d.clock)
            assert r.stuck == [] and r.unsettled == 0
            recorded = box.recorded_sources()
            for raw, source in expected.items():
                assert source in recorded, (source, r.to_json())
                assert clean_text(source)
                assert name_bytes(source) == raw  # reversible to the very bytes
            assert r.accepted + r.duplicates + len(r.quarantined) == len(expected)
            left = [p for p in snapshot(box.d.inbox) if not os.path.isdir(p)]
            assert all(any(part.startswith(b".") for part in p.split(b"/")) for p in left)
            for p in box.d.quarantine.iterdir():
                assert len(os.fsencode(p.name)) <= 255 and clean_text(p.name)
        finally:
            box.close()


@settings(max_examples=1000, deadline=None)
@given(st.binary(max_size=300))
def test_names_round_trip(raw):
    text = shown(raw)
    assert clean_text(text) and name_bytes(text) == raw


JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(),
                    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
                    max_leaves=12)
PATHS = st.one_of(st.sampled_from([".up/a.png", ".up/b.png", "../outside/secret.png", "/etc/passwd", ".up",
                                   "./.up//a.png", ".up/../.up/b.png", "link/secret.png", "link", ""]),
                  st.text(max_size=40), JSON)
ENTRIES = st.fixed_dictionaries({"path": PATHS, "label": st.one_of(st.sampled_from(["cat", "dog", "bad label!"]),
                                                                    JSON)})
LINES = st.one_of(st.text(max_size=200), JSON.map(json.dumps), ENTRIES.map(json.dumps),
                  ENTRIES.map(lambda e: json.dumps(e, ensure_ascii=False)))


@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lines=st.lists(LINES, min_size=1, max_size=8), bom=st.booleans(), crlf=st.booleans())
def test_any_manifest_lines(lines, bom, crlf):
    with tempfile.TemporaryDirectory() as tmp:
        box = Sandbox(Path(tmp))
        try:
            box.put([b".up", b"a.png"], image_bytes(1))
            box.put([b".up", b"b.png"], image_bytes(2))
            os.symlink(box.outside, box.d.inbox / "link")
            text = ("\r\n" if crlf else "\n").join(lines)
            box.put([b"m.jsonl"], (("\ufeff" if bom else "") + text).encode("utf-8", "surrogatepass"))
            r = ingest_inbox(box.d.config, box.d.store, clock=box.d.clock)
            assert r.stuck == [] and r.unsettled == 0
            events = box.d.store.events(limit=10_000)  # all of them read back as JSON
            for e in events:
                json.dumps(e.message, ensure_ascii=False).encode("utf-8")
            handled = r.accepted + r.duplicates + len([q for q in r.quarantined if q[0] not in ("m.jsonl", "link")])
            manifest_quarantined = any(q[0] == "m.jsonl" for q in r.quarantined)
            if not manifest_quarantined:
                nonblank = [x for x in text.removeprefix("\ufeff").split("\n") if x.removesuffix("\r").strip()]
                assert len(r.refused) + handled == len(nonblank), r.to_json()
        finally:
            box.close()


def test_manifest_traps_are_refused_one_line_each(datadir):
    datadir.drop(".up/a.png", image_bytes(1))
    datadir.drop(".up/b.png", image_bytes(2))
    traps = [
        "[" * 100_000,                                          # would exhaust the parser's recursion
        "[" * (MAX_DEPTH + 1) + "]" * (MAX_DEPTH + 1),
        json.dumps({"path": ".up/a.png", "label": "cat", "x": "y" * MAX_LINE}),
        '{"path": ".up/a.png", "label": "cat", "path": "/etc/passwd"}',  # duplicate key
        '{"path": ".up/a.png", "label": NaN}',
        '{"path": ".up/a.png", "label": "cat", "n": ' + "9" * 5000 + "}",  # above int conversion limits
        '{"path": ".up/a.png", "label": 7}',
        '{"path": ["x"], "label": "cat"}',
        '{"path": "\\udc80.png", "label": "cat"}',
        '{"path": "a\\u0000b", "label": "cat"}',
        '"just a string"',
        "[1, 2]",
        "null",
    ]
    body = "\ufeff" + "\r\n".join(traps + [json.dumps({"path": ".up/b.png", "label": "cat"})]) + "\r\n"
    datadir.drop("m.jsonl", body.encode("utf-8", "surrogatepass"))
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert [w for w, _ in r.refused] == [f"m.jsonl:{i}" for i in range(1, len(traps) + 1)]
    assert all("\n" not in why and len(why) < 300 for _, why in r.refused)
    assert r.accepted == 1 and datadir.store.samples()[0].source == ".up/b.png"  # the batch went on


def test_special_files_are_quarantined_and_never_block(datadir, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret.png").write_bytes(image_bytes(5))
    cat = datadir.inbox / "cat"
    cat.mkdir(parents=True)
    os.mkfifo(cat / "fifo.png")  # opening it for reading would block without O_NONBLOCK
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(cat / "sock.png"))
    os.symlink(outside / "secret.png", cat / "link.png")
    os.symlink(outside, cat / "dirlink")
    os.symlink(outside, datadir.inbox / "dog")  # a label folder that is a link
    (cat / "folder.png").mkdir()  # a folder where a file is expected: walked, it holds nothing
    try:
        os.mknod(cat / "null.png", 0o600 | stat.S_IFCHR, os.makedev(1, 3))
        nodes = ["cat/null.png"]
    except PermissionError:
        nodes = []
    datadir.drop("cat/ok.png", image_bytes(6))
    try:
        r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    finally:
        sock.close()
    assert r.accepted == 1
    assert sorted(q[0] for q in r.quarantined) == sorted(["cat/fifo.png", "cat/sock.png", "cat/link.png",
                                                          "cat/dirlink", "dog"] + nodes)
    assert sorted(p.name for p in outside.iterdir()) == ["secret.png"]
    assert (outside / "secret.png").read_bytes() == image_bytes(5)
    assert (datadir.quarantine / "dog").is_symlink()  # the link moved, not what it points to


def test_a_name_too_long_for_the_quarantine_does_not_block_ingest(datadir):
    long_name = "x" * 251 + ".txt"  # 255 bytes: the sidecar's suffix would not fit beside it
    datadir.drop(f"cat/{long_name}", b"text")
    datadir.drop("cat/ok.png", image_bytes(7))
    for _ in range(2):
        r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
        assert r.stuck == []
    assert datadir.store.count_samples() == 1
    assert datadir.store.events(EventKind.QUARANTINE)[0].message["source"] == f"cat/{long_name}"
    names = [p.name for p in datadir.quarantine.iterdir()]
    assert len(names) == 2 and all(len(n.encode()) <= 255 for n in names)


def test_a_non_utf8_name_is_stored_and_recorded_escaped(datadir, caplog):
    inbox = os.fsencode(datadir.inbox)
    os.makedirs(os.path.join(inbox, b"cat"))
    for name, seed in ((b"caf\xe9.png", 1), (b"two\nlines\x1b[31m.png", 2), (b"back\\slash.png", 3)):
        with open(os.path.join(inbox, b"cat", name), "wb") as f:
            f.write(image_bytes(seed))
    with open(os.path.join(inbox, b"cat", b"\xff\xfe.txt"), "wb") as f:
        f.write(b"not an image")
    caplog.set_level("INFO")
    for _ in range(2):  # and again: nothing left to crash a restart
        ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    sources = sorted(s.source for s in datadir.store.samples())
    assert sources == ["cat/back\\\\slash.png", "cat/caf\\xe9.png", "cat/two\\x0alines\\x1b[31m.png"]
    assert [name_bytes(s) for s in sources] == [b"cat/back\\slash.png", b"cat/caf\xe9.png",
                                                b"cat/two\nlines\x1b[31m.png"]
    assert datadir.store.events(EventKind.QUARANTINE)[0].message["source"] == "cat/\\xff\\xfe.txt"
    assert (datadir.quarantine / "\\xff\\xfe.txt").read_bytes() == b"not an image"
    for record in caplog.records:  # no log line can be forged by a name
        assert "\n" not in record.getMessage() and "\x1b" not in record.getMessage()
