"""What is waiting in the inbox: files in label folders, and JSON-lines manifests.

Two ways to drop images:

- ``inbox/<label>/<any sub-folders>/<file>``: the label is the top-level folder's name.
- ``inbox/<name>.jsonl``: one ``{"path": ..., "label": ...}`` object per line; ``path`` is relative
  to the inbox and must stay inside it (no ``..``, not absolute, no symbolic link on the way out,
  not a link itself). Such an entry is *refused*: recorded with its reason, and nothing it names is
  touched. Put a manifest's files in a hidden folder (``inbox/.upload-1/``), which the folder scan
  skips, and write the manifest last; a manifest's claim wins over the folder a file sits in.

Names starting with ``.`` are skipped everywhere (the usual mark of a file still being written: write
``.x.png``, then rename it to ``x.png``), and so is any file modified less than ``settle_seconds`` ago
(it may still be being copied); both are picked up by a later scan. A file directly in the inbox
(not a manifest) has no label and is quarantined.

The scan only lists; :mod:`edgerev_daemon.ingest` decides what happens to each file.
"""

from __future__ import annotations

import json
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LABEL_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
MANIFEST_SUFFIX = ".jsonl"


def valid_label(name: object) -> bool:
    return isinstance(name, str) and LABEL.fullmatch(name) is not None


@dataclass(frozen=True)
class Candidate:
    """A file to examine: ``source`` is its path relative to the inbox (what events name);
    ``label`` is ``None`` for a file with no label folder; ``manifest`` names the manifest that
    listed it, if one did."""

    path: Path
    source: str
    label: str | None
    manifest: str | None = None


@dataclass(frozen=True)
class Refusal:
    """A manifest line that names nothing the daemon may touch."""

    manifest: str
    line: int
    path: str | None
    reason: str


@dataclass
class Scan:
    candidates: list[Candidate] = field(default_factory=list)
    refusals: list[Refusal] = field(default_factory=list)
    manifests: dict[str, tuple[Path, os.stat_result]] = field(default_factory=dict)  # read; removed once done
    bad_manifests: list[tuple[Candidate, str]] = field(default_factory=list)  # to quarantine, with the reason
    unsettled: int = 0


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _inside(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


def _rel(path: Path, inbox: Path) -> str:
    return path.relative_to(inbox).as_posix()


def _confine(inbox: Path, raw: object) -> tuple[Path | None, str | None]:
    """The real path a manifest entry names inside ``inbox`` (a resolved folder), or why not."""
    if not isinstance(raw, str) or not raw.strip() or "\x00" in raw:
        return None, "path must be a non-empty string"
    rel = PurePosixPath(raw)
    if rel.is_absolute():
        return None, f"absolute path {raw!r}: paths are relative to the inbox"
    if ".." in rel.parts:
        return None, f"path traversal {raw!r}: '..' is not allowed"
    full = inbox.joinpath(*rel.parts)
    real_parent = Path(os.path.realpath(full.parent))
    real = real_parent / full.name
    if not _inside(real_parent, inbox) or real == inbox:
        return None, f"{raw!r} leaves the inbox through a symbolic link"
    if real.is_symlink():
        return None, f"{raw!r} is a symbolic link (not followed)"
    return real, None


def _settled(st: os.stat_result, now: float, settle: float) -> bool:
    return now - st.st_mtime >= settle


def _read_manifest(path: Path, name: str, inbox: Path, max_bytes: int, scan: Scan,
                   claimed: dict[str, str], seen: Callable[[str], bool]) -> None:
    cand = Candidate(path, name, None)
    try:
        st = path.lstat()
        raw = path.read_bytes()[: max_bytes + 1]
    except OSError as e:
        scan.bad_manifests.append((cand, f"cannot read the manifest: {e.strerror or e}"))
        return
    if len(raw) > max_bytes:
        scan.bad_manifests.append((cand, f"manifest above limits.max_file_size ({max_bytes} bytes)"))
        return
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        scan.bad_manifests.append((cand, "manifest is not UTF-8 text"))
        return
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            scan.refusals.append(Refusal(name, number, None, f"not JSON: {e.msg}"))
            continue
        if not isinstance(obj, dict) or "path" not in obj or "label" not in obj:
            scan.refusals.append(Refusal(name, number, None, 'expected an object with "path" and "label"'))
            continue
        real, why = _confine(inbox, obj["path"])
        if why is not None:
            scan.refusals.append(Refusal(name, number, str(obj["path"]), why))
            continue
        source = _rel(real, inbox)
        if source in claimed:
            scan.refusals.append(Refusal(name, number, source, f"already listed by {claimed[source]}"))
            continue
        if not real.exists():
            if not seen(source):  # not a file this manifest had us store before a crash
                scan.refusals.append(Refusal(name, number, source, "no such file in the inbox"))
            continue
        if real.is_dir():
            scan.refusals.append(Refusal(name, number, source, "is a directory"))
            continue
        claimed[source] = name
        label = obj["label"] if isinstance(obj["label"], str) else repr(obj["label"])
        entries.append(Candidate(real, source, label, name))
    scan.candidates.extend(entries)
    scan.manifests[name] = (path, st)


def scan_inbox(inbox: Path, now: float, settle_seconds: float, max_manifest_bytes: int,
               seen: Callable[[str], bool] = lambda source: False) -> Scan:
    """List the inbox (sorted, so runs are reproducible).

    Args:
        now: the current time, against files' modification times.
        seen: whether a file from this inbox path was already stored or quarantined; a manifest
            entry whose file is gone is silently done when it was, refused when it was not.
    """
    inbox = Path(os.path.realpath(inbox))
    scan = Scan()
    claimed: dict[str, str] = {}
    entries = sorted(os.scandir(inbox), key=lambda e: e.name)
    folders = []
    for e in entries:
        if _hidden(e.name):
            continue
        st = e.stat(follow_symlinks=False)
        if stat.S_ISDIR(st.st_mode):
            folders.append(e)
        elif not _settled(st, now, settle_seconds):
            scan.unsettled += 1
        elif e.name.endswith(MANIFEST_SUFFIX) and stat.S_ISREG(st.st_mode):
            _read_manifest(Path(e.path), e.name, inbox, max_manifest_bytes, scan, claimed, seen)
        else:
            scan.candidates.append(Candidate(Path(e.path), e.name, None))
    for folder in folders:
        for root, dirs, files in os.walk(folder.path):  # never follows a link to a folder
            dirs[:] = sorted(d for d in dirs if not _hidden(d))
            links = [d for d in dirs if os.path.islink(os.path.join(root, d))]
            for name in sorted(f for f in files if not _hidden(f)) + links:
                path = Path(root, name)
                source = _rel(path, inbox)
                if source in claimed:
                    continue
                try:
                    st = path.lstat()
                except FileNotFoundError:
                    continue
                if not _settled(st, now, settle_seconds):
                    scan.unsettled += 1
                    continue
                scan.candidates.append(Candidate(path, source, folder.name))
    return scan
