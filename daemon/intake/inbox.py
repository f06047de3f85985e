"""What is waiting in the inbox: files in label folders, and JSON-lines manifests.

Two ways to drop images:

- ``inbox/<label>/<any sub-folders>/<file>``: the label is the top-level folder's name; images in
  ``inbox/unlabeled/`` (or ``unlabelled/``) have none (see :data:`~edgerev_daemon.storage.records.UNLABELED`):
  they are stored unlabelled, and the same image dropped later under a label folder labels them.
- ``inbox/<name>.jsonl``: one ``{"path": ..., "label": ...}`` object per line (see
  :mod:`edgerev_daemon.intake.manifest` for what a line may hold; a line without a label, or with
  ``"label": null`` or ``"unlabeled"``, names an unlabelled image); ``path`` is relative to the inbox and must
  stay inside it (no ``..``, not absolute, no symbolic link on the way, not a link itself). Such an
  entry is *refused*: recorded with its reason, and nothing it names is touched. Put a manifest's
  files in a hidden folder (``inbox/.upload-1/``), which the folder scan skips, and write the
  manifest last; a manifest's claim wins over the folder a file sits in.

Names starting with ``.`` are skipped everywhere (the usual mark of a file still being written: write
``.x.png``, then rename it to ``x.png``), and so is a file that has not yet settled (its size and
modification time unchanged for ``settle_seconds`` by the daemon's clock, see
:mod:`edgerev_daemon.intake.watch`); both are picked up by a later scan. A file directly in the inbox (not a
manifest) has no label and is quarantined. A folder that cannot be listed, or lies deeper than
:data:`MAX_DEPTH`, is reported (:attr:`Scan.problems`) and skipped.

The scan walks folders by descriptor without following links (:mod:`edgerev_daemon.intake.confined`) and
keeps each file's path as its components, the names exactly as the file system gives them; what is
recorded is their :func:`~edgerev_daemon.intake.names.shown` form. The scan only lists;
:mod:`edgerev_daemon.intake.ingest` decides what happens to each file.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from edgerev_daemon.intake import confined
from edgerev_daemon.intake.confined import NotConfined
from edgerev_daemon.intake.manifest import Entry, LineRefused, lines, parse_line
from edgerev_daemon.intake.names import shown, shown_path
from edgerev_daemon.intake.watch import InboxWatch
from edgerev_daemon.storage.records import LABEL, UNLABELED

MANIFEST_SUFFIX = ".jsonl"
MAX_DEPTH = 32  # folders below a label folder; deeper ones are reported, not walked


def valid_label(name: object) -> bool:
    return isinstance(name, str) and LABEL.fullmatch(name) is not None


@dataclass(frozen=True)
class Candidate:
    """A file to examine: ``parts`` its path from the inbox, names as the file system gives them;
    ``source`` the recorded form of that path (what events name); ``label`` is ``None`` for a file
    with no label: ``unlabeled`` says it was dropped so on purpose (``inbox/unlabeled/``, a manifest line
    without a label), else it lies outside any label folder; ``manifest`` names the manifest that listed it,
    if one did; ``inode``: its device and inode when the scan saw it (what may be moved to quarantine:
    nothing swapped in since)."""

    parts: tuple[str, ...]
    source: str
    label: str | None
    manifest: str | None = None
    inode: tuple[int, int] | None = None
    unlabeled: bool = False

    @property
    def name(self) -> str:
        return self.parts[-1]


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
    manifests: dict[str, tuple[tuple[str, ...], confined.Identity]] = field(default_factory=dict)  # removed once done
    bad_manifests: list[tuple[Candidate, str]] = field(default_factory=list)  # to quarantine, with the reason
    problems: dict[str, str] = field(default_factory=dict)  # folders not walked -> why
    unsettled: int = 0


def _hidden(name: str) -> bool:
    return name.startswith(".")


class _Scanner:
    def __init__(self, root_fd: int, now: float, settle_seconds: float, max_manifest_bytes: int,
                 seen: Callable[[str], bool], watch: InboxWatch,
                 read_before: Callable[[str, confined.Identity], bool]) -> None:
        self.root_fd, self.now, self.settle = root_fd, now, settle_seconds
        self.max_manifest_bytes, self.seen, self.watch = max_manifest_bytes, seen, watch
        self.read_before = read_before
        self.scan = Scan()
        self.claimed: dict[tuple[str, ...], str] = {}

    def settled(self, parts: tuple[str, ...], st: os.stat_result) -> bool:
        if self.watch.settled(parts, (st.st_size, st.st_mtime_ns), self.now, self.settle):
            return True
        self.scan.unsettled += 1
        return False

    def top(self) -> None:
        folders = []
        for name in sorted(os.listdir(self.root_fd)):
            if _hidden(name):
                continue
            try:
                st = confined.lstat(self.root_fd, name)
            except OSError:
                continue  # vanished since the listing
            if stat.S_ISDIR(st.st_mode):
                folders.append(name)
            elif not self.settled((name,), st):
                continue
            elif name.endswith(MANIFEST_SUFFIX) and stat.S_ISREG(st.st_mode):
                self.manifest(name)
            else:
                self.scan.candidates.append(Candidate((name,), shown(name), None, inode=(st.st_dev, st.st_ino)))
        for name in folders:
            self.folder(self.root_fd, (name,), None if name in UNLABELED else name, 0)

    def folder(self, parent_fd: int, parts: tuple[str, ...], label: str | None, depth: int) -> None:
        """Walk one folder (opened from its parent without following a link) and those below it."""
        try:
            fd = confined.open_dir(parent_fd, parts[-1])
        except (FileNotFoundError, NotConfined):
            return  # gone, or swapped for a link since it was listed: the next scan sees what it is now
        except OSError as e:
            self.scan.problems[shown_path(parts)] = f"cannot open the folder: {e.strerror or e}"
            return
        try:
            try:
                names = sorted(os.listdir(fd))
            except OSError as e:
                self.scan.problems[shown_path(parts)] = f"cannot list the folder: {e.strerror or e}"
                return
            below = []
            for name in names:
                if _hidden(name):
                    continue
                path = parts + (name,)
                try:
                    st = confined.lstat(fd, name)
                except OSError:
                    continue
                if stat.S_ISDIR(st.st_mode):
                    below.append(path)
                elif path not in self.claimed and self.settled(path, st):
                    self.scan.candidates.append(Candidate(path, shown_path(path), label, inode=(st.st_dev, st.st_ino),
                                                          unlabeled=label is None))
            for path in below:
                if depth + 1 > MAX_DEPTH:
                    self.scan.problems[shown_path(path)] = f"deeper than {MAX_DEPTH} folders below its label folder"
                else:
                    self.folder(fd, path, label, depth + 1)
        finally:
            os.close(fd)

    def manifest(self, name: str) -> None:
        cand = Candidate((name,), shown(name), None)
        try:
            fd = confined.open_file(self.root_fd, name)
        except FileNotFoundError:
            return
        except OSError as e:
            self.scan.bad_manifests.append((cand, f"cannot read the manifest: {e.strerror or e}"))
            return
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(fd)
            raw = f.read(self.max_manifest_bytes + 1)
        cand = Candidate((name,), cand.source, None, inode=(st.st_dev, st.st_ino))
        if len(raw) > self.max_manifest_bytes:
            self.scan.bad_manifests.append((cand, f"manifest above limits.max_file_size ({self.max_manifest_bytes} "
                                                  "bytes)"))
            return
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            self.scan.bad_manifests.append((cand, "manifest is not UTF-8 text"))
            return
        entries = []
        again = self.read_before(cand.source, confined.identity(st))
        for number, line in lines(text):
            try:
                entries.append(self.entry(cand.source, parse_line(line)))
            except LineRefused as e:
                if again:  # refused when first read (recorded then), or its file handled and gone since
                    continue
                path = None if e.path is None else shown(e.path)
                self.scan.refusals.append(Refusal(cand.source, number, path, e.reason))
        self.scan.candidates.extend(c for c in entries if c is not None)
        self.scan.manifests[cand.source] = ((name,), confined.identity(st))

    def entry(self, manifest: str, entry: Entry) -> Candidate | None:
        """The file a manifest entry names, found component by component from the inbox."""
        source, raw = shown_path(entry.parts), "/".join(entry.parts)
        try:
            with confined.parent(self.root_fd, entry.parts) as fd:
                st = confined.lstat(fd, entry.parts[-1])
        except NotConfined:
            raise LineRefused(f"'{source}' leaves the inbox through a symbolic link or a file on the way",
                              source) from None
        except FileNotFoundError:
            if not self.seen(source):  # not a file this manifest had us store before a crash
                raise LineRefused("no such file in the inbox", raw) from None
            return None
        except OSError as e:
            raise LineRefused(f"cannot reach '{source}': {e.strerror or e}", raw) from None
        if entry.parts in self.claimed:
            raise LineRefused(f"already listed by {self.claimed[entry.parts]}", raw)
        if stat.S_ISLNK(st.st_mode):
            raise LineRefused(f"'{source}' is a symbolic link (not followed)", raw)
        if stat.S_ISDIR(st.st_mode):
            raise LineRefused("is a directory", raw)
        self.claimed[entry.parts] = manifest
        label = None if entry.label in UNLABELED else entry.label
        return Candidate(entry.parts, source, label, manifest, inode=(st.st_dev, st.st_ino), unlabeled=label is None)


def scan_inbox(root_fd: int, now: float, settle_seconds: float, max_manifest_bytes: int,
               seen: Callable[[str], bool] = lambda source: False, watch: InboxWatch | None = None,
               read_before: Callable[[str, confined.Identity], bool] = lambda source, identity: False) -> Scan:
    """List the inbox open as ``root_fd`` (sorted, so runs are reproducible).

    Args:
        now: the daemon's clock, for settling (see :mod:`edgerev_daemon.intake.watch`).
        seen: whether a file from this inbox path was already stored or quarantined; a manifest
            entry whose file is gone is silently done when it was, refused when it was not.
        watch: what earlier scans saw (a fresh one when ``None``: nothing settles but with
            ``settle_seconds`` 0).
        read_before: whether an earlier ingest read this manifest, unchanged since (its inbox path and
            identity), and left it with lines to handle: its lines are not refused again (those refused were
            recorded then; a file gone since was handled, its sample possibly removed by the retention policy).
    """
    scanner = _Scanner(root_fd, now, settle_seconds, max_manifest_bytes, seen, watch or InboxWatch(), read_before)
    scanner.top()
    scanner.watch.end_scan()
    return scanner.scan
