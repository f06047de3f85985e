"""Model versions on disk: complete directories, and a ``current`` link switched atomically.

```
DATA_DIR/versions/v0001/   model.safetensors, model.json, model.onnx, replay.safetensors,
                           config.yaml, metrics.json, manifest.json (SHA-256 and size of every other file)
DATA_DIR/versions/.v0002.partial/   a version being written (removed at start-up if a crash left it)
DATA_DIR/current -> versions/v0001
```

A version directory is written under a hidden ``.partial`` name, every file fsynced, then renamed to
its final name and the parent fsynced: a directory named ``vNNNN`` is always complete. ``current`` is
a relative symbolic link, replaced by renaming a new link over it (``rename(2)`` is atomic), so a
reader, or a daemon restarted after a power cut, finds either the old version or the new one in
service, never a half-written one. A version is only linked after its directory is complete.

A ``current`` that is missing, dangling or replaced by something else (a folder, a file) is repaired
from the store's record of the version in service (:meth:`Registry.repair`): whatever stands in its
place is moved aside (``current.moved-aside-N``), never deleted.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from edgerev.atomic import fsync_dir
from edgerev.errors import EdgerevError, TrustError
from edgerev.models.directory import CheckpointError, model_classes

VERSION_RE = re.compile(r"v\d{4,}")
REQUIRED = ("model.safetensors", "model.json", "model.onnx")
MANIFEST = "manifest.json"


class RegistryError(EdgerevError):
    """A version is missing or incomplete, or the registry cannot be changed as asked."""


class Registry:
    """The version directories and the ``current`` link under ``root`` (the data directory)."""

    def __init__(self, root: str | Path) -> None:
        self.root = Path(root)
        self.versions_dir = self.root / "versions"
        self.link = self.root / "current"

    def path(self, version: str) -> Path:
        if not VERSION_RE.fullmatch(version):
            raise RegistryError(f"{version!r} is not a version name (v0001, v0002, ...)")
        return self.versions_dir / version

    def versions(self) -> list[str]:
        """Complete version directories, oldest first."""
        if not self.versions_dir.is_dir():
            return []
        names = [p.name for p in self.versions_dir.iterdir() if p.is_dir() and VERSION_RE.fullmatch(p.name)]
        return sorted(names, key=lambda n: int(n[1:]))

    def current(self) -> str | None:
        """The version in service, or None before the first promotion."""
        try:
            target = os.readlink(self.link)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise RegistryError(f"{self.link} is not a link to a version: {e}") from None
        name = Path(target).name
        if not VERSION_RE.fullmatch(name) or not (self.versions_dir / name).is_dir():
            raise RegistryError(f"{self.link} points to {target!r}, which is not a version directory")
        return name

    def current_path(self) -> Path | None:
        v = self.current()
        return None if v is None else self.path(v)

    def current_classes(self) -> tuple[str, ...]:
        """The classes of the version in service (its ``model.json``, read without torch as a job reads it:
        :func:`edgerev.models.directory.model_classes`); () when none is in service or its description cannot be
        read (the start-up checks report that)."""
        try:
            path = self.current_path()
            return model_classes(path) if path else ()
        except (RegistryError, CheckpointError, TrustError):
            return ()

    def write(self, version: str, files: Mapping[str, Path | bytes]) -> Path:
        """Write a complete version directory from ``files`` (name -> source file or bytes).

        Raises:
            RegistryError: the version exists, or a required file is missing.
            OSError: the disk is full or not writable; nothing named ``version`` is left behind.
        """
        final = self.path(version)
        if final.exists():
            raise RegistryError(f"version {version} already exists")
        missing = [n for n in REQUIRED if n not in files]
        if MANIFEST in files:
            raise RegistryError(f"{MANIFEST} is written by the registry, not given")
        if missing:
            raise RegistryError(f"version {version} lacks {', '.join(missing)}")
        self.versions_dir.mkdir(parents=True, exist_ok=True)
        partial = self.versions_dir / f".{version}.partial"
        if partial.exists():
            shutil.rmtree(partial)
        try:
            partial.mkdir()
            manifest: dict[str, dict] = {}
            for name, src in files.items():
                if Path(name).name != name:
                    raise RegistryError(f"a version file must be a plain name, got {name!r}")
                data = src if isinstance(src, bytes) else Path(src).read_bytes()
                _write_synced(partial / name, data)
                manifest[name] = {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
            _write_synced(partial / MANIFEST, (json.dumps({"version": version, "files": manifest}, indent=2,
                                                          sort_keys=True) + "\n").encode())
            fsync_dir(partial)
            os.rename(partial, final)
            fsync_dir(self.versions_dir)
        except BaseException:
            shutil.rmtree(partial, ignore_errors=True)
            raise
        return final

    def link_state(self) -> tuple[str, str | None]:
        """``("ok", version)``, ``("missing", None)``, or what is wrong with ``current`` and ``None``."""
        if not self.link.is_symlink():
            if not self.link.exists():
                return "missing", None
            return f"is not a link but a {'folder' if self.link.is_dir() else 'file'}", None
        try:
            return "ok", self.current()
        except RegistryError:
            return f"is dangling (points to {os.readlink(self.link)!r})", None

    def verify(self, version: str) -> list[str]:
        """What is wrong with a version directory: a required file missing, a file whose bytes do not
        match its manifest (empty: complete and intact; a version written without a manifest by an
        older edgerev is checked for its required files only)."""
        folder = self.path(version)
        problems = [f"{version} lacks {n}" for n in REQUIRED if not (folder / n).is_file()]
        try:
            manifest = json.loads((folder / MANIFEST).read_text())
            entries = manifest["files"].items()
        except FileNotFoundError:
            return problems
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            return [*problems, f"{version}/{MANIFEST} is unreadable: {e}"]
        for name, entry in entries:
            path = folder / name
            if not path.is_file():
                if name not in REQUIRED:
                    problems.append(f"{version} lacks {name}")
                continue
            if hashlib.sha256(path.read_bytes()).hexdigest() != entry.get("sha256"):
                problems.append(f"{version}/{name} does not match its SHA-256 in {MANIFEST}")
        return problems

    def repair(self, version: str) -> str | None:
        """Point ``current`` at ``version`` if it is missing, dangling or not a link; whatever stood in its
        place is moved aside. Returns what was wrong (``None``: nothing to do).

        Raises:
            RegistryError: ``version`` is not a complete version directory.
        """
        state, name = self.link_state()
        if state == "ok":
            return None
        if state != "missing" and not self.link.is_symlink():
            n = 1
            while (aside := self.root / f"current.moved-aside-{n}").exists() or aside.is_symlink():
                n += 1
            os.rename(self.link, aside)
            state += f", moved to {aside.name}"
        self.switch(version)
        return f"{self.link.name} {state}; restored to {version}"

    def switch(self, version: str) -> None:
        """Make ``version`` current (atomically); it must be a complete directory."""
        target = self.path(version)
        missing = [n for n in REQUIRED if not (target / n).is_file()]
        if not target.is_dir() or missing:
            raise RegistryError(f"version {version} is not a complete version directory")
        tmp = self.root / f".current.tmp-{os.getpid()}"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(os.path.join("versions", version), tmp)
        try:
            os.replace(tmp, self.link)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        fsync_dir(self.root)

    def latest_complete(self, candidates: list[str]) -> str | None:
        """The newest of ``candidates`` that is a complete version directory on disk."""
        for name in sorted(candidates, key=lambda n: int(n[1:]), reverse=True):
            if VERSION_RE.fullmatch(name) and not [n for n in REQUIRED if not (self.path(name) / n).is_file()]:
                return name
        return None

    def prune(self, keep: int, protect: set[str] = frozenset()) -> list[str]:
        """Delete the oldest version directories beyond the last ``keep``; never the current one or
        those in ``protect``. Returns the deleted names."""
        current = self.current()
        names = self.versions()
        doomed = [n for n in names[: max(0, len(names) - keep)] if n != current and n not in protect]
        for n in doomed:
            shutil.rmtree(self.versions_dir / n)
        if doomed:
            fsync_dir(self.versions_dir)
        return doomed

    def recover(self) -> list[str]:
        """Remove what a crash left: partial version directories and temporary links. Returns them."""
        removed = []
        if self.versions_dir.is_dir():
            for p in self.versions_dir.glob(".*.partial"):
                shutil.rmtree(p, ignore_errors=True)
                removed.append(p.name)
        for p in self.root.glob(".current.tmp-*"):
            p.unlink(missing_ok=True)
            removed.append(p.name)
        return removed


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
