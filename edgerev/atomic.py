"""Atomic file writes: temporary file, fsync, rename, fsync of the folder.

Every file edgerev writes for later reading (weights, checkpoints, configs, ONNX models) goes through
here. No torch import: the ONNX Runtime side of :mod:`edgerev.export` runs on devices without PyTorch.
"""

from __future__ import annotations

import os
from pathlib import Path


def _fsync(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside ``path`` durable."""
    _fsync(path)


def fsync_tree(path: str | Path) -> None:
    """fsync every file and folder under ``path`` (a tree written without it, e.g. by ``shutil.copytree``),
    deepest first, ``path`` last; links are not followed."""
    for folder, _, files in os.walk(path, topdown=False):
        for name in files:
            if not os.path.islink(file := os.path.join(folder, name)):
                _fsync(file)
        _fsync(folder)


def atomic_write(path: str | Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync, and rename (never a torn file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    fsync_dir(path.parent)
