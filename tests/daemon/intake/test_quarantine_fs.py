"""A rejected file on another file system than the data directory is never copied.

Across file systems a rename fails with ``EXDEV``; the file stays in its inbox folder under a hidden
``.rejected-`` name with its reason recorded, and is not retried: the data disk grows by one reason
file per rejected file, however often the daemon polls. One variant injects ``EXDEV`` (always runs);
one mounts a real tmpfs for the inbox (needs the right to mount: skipped where it is refused).
"""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

from edgerev_daemon import EventKind, ingest_inbox
from edgerev_daemon.intake import confined

from ..conftest import image_bytes, make_config, open_data_dir, tmpfs


def used_bytes(folder: Path) -> int:
    return sum(p.lstat().st_size for p in folder.rglob("*"))


def check_left_in_inbox(d, polls: int = 5) -> None:
    big = os.urandom(64 * 1024)  # not an image: rejected
    d.drop("cat/big.png", big)
    d.drop("cat/ok.png", image_bytes(1))
    r = ingest_inbox(d.config, d.store, clock=d.clock)
    assert r.accepted == 1 and [q[0] for q in r.quarantined] == ["cat/big.png"] and r.stuck == []
    assert sorted(p.name for p in (d.inbox / "cat").iterdir()) == [".rejected-big.png"]
    assert (d.inbox / "cat" / ".rejected-big.png").read_bytes() == big
    reason = json.loads((d.quarantine / "big.png.reason.json").read_text())
    assert reason["left_in_inbox"] == "cat/.rejected-big.png" and reason["source"] == "cat/big.png"
    assert not (d.quarantine / "big.png").exists()
    event = d.store.events(EventKind.QUARANTINE)[0].message
    assert event["moved_to"] == "inbox:cat/.rejected-big.png"
    used = used_bytes(d.quarantine)
    assert used < 4096
    for _ in range(polls):  # not retried, not copied: the data disk does not grow
        r = ingest_inbox(d.config, d.store, clock=d.clock)
        assert (r.accepted, r.quarantined, r.stuck) == (0, [], [])
    assert used_bytes(d.quarantine) == used and len(d.store.events(EventKind.QUARANTINE)) == 1


def test_exdev_leaves_the_rejected_file_hidden_in_the_inbox(datadir, monkeypatch):
    real = confined.link

    def other_file_system(src_fd, src, dst_fd, dst):
        if src_fd != dst_fd:  # inbox folder -> quarantine: as if they were on two file systems
            raise OSError(errno.EXDEV, os.strerror(errno.EXDEV))
        return real(src_fd, src, dst_fd, dst)

    monkeypatch.setattr(confined, "link", other_file_system)
    check_left_in_inbox(datadir)


def test_a_file_system_without_hard_links(datadir, monkeypatch):
    def no_links(src_fd, src, dst_fd, dst):  # FAT: link() is refused, rename works
        raise OSError(errno.EPERM, os.strerror(errno.EPERM))

    monkeypatch.setattr(confined, "link", no_links)
    datadir.drop("cat/bad.png", b"not an image")
    r = ingest_inbox(datadir.config, datadir.store, clock=datadir.clock)
    assert [q[0] for q in r.quarantined] == ["cat/bad.png"] and r.stuck == []
    assert (datadir.quarantine / "bad.png").read_bytes() == b"not an image"
    assert list((datadir.inbox / "cat").iterdir()) == []


def test_an_inbox_on_a_real_tmpfs(tmp_path):
    with tmpfs(tmp_path / "inbox", "4m") as inbox:
        assert os.stat(inbox).st_dev != os.stat(tmp_path).st_dev
        d = open_data_dir(make_config(tmp_path, inbox=str(inbox)))
        try:
            check_left_in_inbox(d)
        finally:
            d.store.close()
            d.lock.release()
