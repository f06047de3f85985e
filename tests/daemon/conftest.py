"""Fixtures of the daemon tests: a config and a data directory in ``tmp_path``, image files, a clock."""

from __future__ import annotations

import io
import struct
import subprocess
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from edgerev_daemon import DaemonConfig, DataDirLock, Store, config_from_dict, prepare, validate_paths
from edgerev_daemon.storage.blobs import BlobStore


class Clock:
    """A clock the test moves by hand; it starts a day ahead of the real one, so files the test has
    just written look settled (their modification times are real)."""

    def __init__(self, now: float | None = None) -> None:
        self.now = time.time() + 86400.0 if now is None else now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def image_bytes(seed: int, size: tuple[int, int] = (32, 32), fmt: str = "PNG", mode: str = "RGB") -> bytes:
    """A random image (distinct for each seed) encoded as ``fmt``."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    w, h = size
    im = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).convert(mode)
    out = io.BytesIO()
    im.save(out, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return out.getvalue()


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def bomb_png(width: int = 30000, height: int = 30000) -> bytes:
    """A valid PNG header claiming ``width x height`` pixels, followed by a few bytes of pixel data:
    tiny on disk, gigabytes once decoded."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    idat = zlib.compress(b"\0" * 4096)
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IDAT", idat) + png_chunk(b"IEND", b"")


def write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


@dataclass
class DataDir:
    """A started daemon's data side: config, lock held, folders made, store open."""

    config: DaemonConfig
    store: Store
    blobs: BlobStore
    clock: Clock
    lock: DataDirLock

    @property
    def inbox(self) -> Path:
        return self.config.inbox_path

    @property
    def quarantine(self) -> Path:
        return self.config.layout.quarantine

    def drop(self, rel: str, data: bytes) -> Path:
        return write(self.inbox / rel, data)


def make_config(tmp_path: Path, **overrides) -> DaemonConfig:
    data = {"data_dir": str(tmp_path / "data"), "ingest": {"settle_seconds": 0}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return config_from_dict(data)


@contextmanager
def rebuilt_store(config: DaemonConfig, tmp_path: Path) -> Iterator[Store]:
    """The store ``edgerev daemon rebuild`` makes from a copy of the data directory (its store files and
    lock left out; the original untouched), open; the copy goes afterwards."""
    import shutil
    import tempfile

    from edgerev_daemon.storage.rebuild import rebuild

    copy = Path(tempfile.mkdtemp(dir=tmp_path, prefix="rebuild-"))
    shutil.rmtree(copy)
    shutil.copytree(config.layout.root, copy, symlinks=True,
                    ignore=shutil.ignore_patterns("store.sqlite*", "daemon.lock"))
    cfg = make_config(tmp_path, data_dir=str(copy))
    rebuild(cfg)
    try:
        with Store(cfg.layout.database) as store:
            yield store
    finally:
        shutil.rmtree(copy, ignore_errors=True)


def open_data_dir(config: DaemonConfig, clock: Clock | None = None) -> DataDir:
    clock = clock or Clock()
    validate_paths(config)
    lock = DataDirLock(config.layout.root).acquire()
    prepare(config.layout, config.inbox_path)
    return DataDir(config, Store(config.layout.database, clock=clock), BlobStore(config.layout.blobs), clock, lock)


@pytest.fixture
def datadir(tmp_path):
    d = open_data_dir(make_config(tmp_path))
    yield d
    d.store.close()
    d.lock.release()


@pytest.fixture(scope="session")
def served(tmp_path_factory) -> Path:
    """A data directory the daemon made, with v0001 in service (one real job, trained once for every test
    that asks: test_service's SMALL config, 160 images of 2 classes). Read it, or copy it to change it."""
    from edgerev_daemon.service.daemon import Daemon
    from tests.daemon.service.test_service import drop
    from tests.daemon.service.test_service import make_config as service_config

    tmp = tmp_path_factory.mktemp("served")
    config, _ = service_config(tmp)
    drop(config, 160, range(2))
    with Daemon(config, clock=Clock()) as d:
        job = d.cycle().job
    assert job["promoted"] and job["version"] == "v0001", job
    return tmp / "data"


@contextmanager
def tmpfs(folder: Path, size: str) -> Iterator[Path]:
    """A real file system of ``size`` (``"2m"``) mounted on ``folder`` for the block: root only, so the
    test is skipped where ``mount`` is refused (the injected-fault variants beside it always run)."""
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield folder
    finally:
        subprocess.run(["umount", "-l", str(folder)], check=False)


@pytest.fixture
def label_page(served, tmp_path):
    """The labelling page's server on a copy of ``served`` with 30 unlabelled samples and their questions:
    (config, the running server, each sample's true label)."""
    from edgerev_daemon.service.http import StatusServer
    from tests.daemon.learning.test_questions import asked_copy
    from tests.daemon.service.test_http import http_config

    config, _, truth, _ = asked_copy(served, tmp_path, n=30)
    config = http_config(config)
    with StatusServer(config, poll_interval=0.02, clock=Clock(), answer_wait=0.0) as server:
        yield config, server, truth
