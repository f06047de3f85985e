"""Requests handed to the daemon that holds a data directory, through a folder of it: one queue for all.

Only the process holding the data directory's lock writes its store; another process (a fleet's ClientApp,
``edgerev daemon label``, the labelling page of another process) that finds the lock held *posts* a request
instead, and the daemon *answers* it between its cycles. Both use this module: the fleet's requests
(:mod:`edgerev_daemon.learning.handoff`) in ``DATA_DIR/fleet/requests/``, the owner's answers
(:mod:`edgerev_daemon.learning.answers`) in ``DATA_DIR/questions/answers/``.

**Whole or absent.** A request is a folder ``<id>.request/`` holding ``meta.json`` and, when it carries
tensors, ``shared.safetensors`` (its SHA-256 in ``meta.json``). It is written as ``.<id>.tmp``, every file
and the folder fsynced, then renamed and the parent fsynced: the daemon never sees half a request, even
after a power cut. The answer, ``<id>.result/``, is written the same way before the request is removed; a
daemon killed between the two removes the answered request at its next start (:func:`pending`) rather than
carrying it out twice. A daemon killed while it carries a request out takes it again at its next start (a
fleet round resumes from its checkpoint).

**Taken once, or expired.** A reader takes a result by renaming it to a hidden name of its own before it reads
it (:func:`collect`): two readers (a waiter and the page that collects what its waiters gave up on) never read
one result twice or half. A result whose asker gave up waiting is nobody's to collect; the daemon, each time it
serves a queue (:func:`pending`), removes the results older than :data:`RESULT_MAX_AGE` and all but the newest
:data:`RESULT_KEEP` (never one whose request is still there: it is what says the request was carried out), and
what a writer or reader killed midway left behind (hidden folders) once it is as old. A waiter polls for its
result, so it collects one within a poll of its writing; the bounds only reach results nobody waits for. Ages
are the folders' modification times against the wall clock (``now``, injected in tests).

**Read safely.** Nothing but JSON and safetensors is read (no pickle); a request is a folder made inside the
queue, and a link is never followed. Requests are taken oldest first (by the folder's mtime).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from pathlib import Path

from edgerev.atomic import atomic_write, fsync_dir

REQUEST, RESULT = ".request", ".result"
META, TENSORS = "meta.json", "shared.safetensors"
RESULT_MAX_AGE = 3600.0  # seconds an uncollected result is kept: the page shows a late outcome within it
RESULT_KEEP = 64  # uncollected results kept at most (the newest): more than the page's waiters and a few CLIs


def _write(final: Path, meta: dict, tensors: dict | None) -> None:
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tensors is not None:
        from edgerev.models.directory import save_tensors  # torch: only a request that carries tensors needs it

        meta = {**meta, "sha256": save_tensors(tmp / TENSORS, tensors)}
    atomic_write(tmp / META, json.dumps(meta).encode())  # fsynced, as the tensors are, and the folder
    tmp.rename(final)
    fsync_dir(final.parent)  # the name too: a power cut leaves no folder, or a complete one


def read(folder: Path) -> tuple[dict, dict | None]:
    """A request's or a result's ``meta.json`` and its tensors (None: it carries none).

    Raises:
        OSError, ValueError, KeyError: unreadable, not JSON, or tensors that do not match their hash
            (:class:`edgerev.errors.EdgerevError` from the safetensors reader is a ``ValueError`` here too).
    """
    meta = json.loads((folder / META).read_text())
    if not isinstance(meta, dict):
        raise ValueError(f"{folder / META} holds no JSON object")
    if "sha256" not in meta:
        return meta, None
    from edgerev.errors import EdgerevError
    from edgerev.models.directory import load_tensors

    try:
        return meta, load_tensors(folder / TENSORS, meta["sha256"])
    except EdgerevError as e:
        raise ValueError(str(e)) from None


def post(queue: Path, meta: dict, tensors: dict | None = None) -> str:
    """Post a request in ``queue`` (created if missing); returns its id."""
    rid = uuid.uuid4().hex
    _write(Path(queue) / f"{rid}{REQUEST}", meta, tensors)
    return rid


def pending(queue: Path, now: float | None = None) -> list[tuple[str, Path]]:
    """The requests waiting in ``queue``, oldest first: (id, folder). A request whose result is written (the
    daemon was killed before it removed the request) is removed, not returned. The results nobody collected
    are expired first (:func:`expire`, at ``now``: the wall clock unless given)."""
    queue = Path(queue)
    if not queue.is_dir():
        return []
    expire(queue, now)
    found = []
    for p in queue.iterdir():
        if p.name.endswith(REQUEST) and not p.is_symlink() and p.is_dir():
            rid = p.name[: -len(REQUEST)]
            if (queue / f"{rid}{RESULT}").is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                found.append((rid, p))
    return sorted(found, key=lambda f: f[1].stat().st_mtime)


def answer(queue: Path, rid: str, meta: dict, tensors: dict | None = None) -> None:
    """Write request ``rid``'s result, then remove the request (the daemon, holding the lock)."""
    _write(Path(queue) / f"{rid}{RESULT}", meta, tensors)
    shutil.rmtree(Path(queue) / f"{rid}{REQUEST}", ignore_errors=True)


def collect(queue: Path, rid: str) -> tuple[dict, dict | None] | None:
    """Request ``rid``'s result, read once (the folder is removed, readable or not), or None: not yet.

    Raises:
        OSError, ValueError, KeyError: the result is there but cannot be read (see :func:`read`).
    """
    taken = _take(Path(queue) / f"{rid}{RESULT}")
    if taken is None:
        return None
    try:
        return read(taken)
    finally:
        shutil.rmtree(taken, ignore_errors=True)


def _take(folder: Path) -> Path | None:
    """``folder`` renamed to a hidden name of this caller's own, or None: not there (not written yet, or another
    reader or the expiry took it first), or not a folder."""
    if folder.is_symlink() or not folder.is_dir():
        return None
    taken = folder.with_name(f".{folder.name}.{uuid.uuid4().hex}.taken")
    try:
        folder.rename(taken)
    except FileNotFoundError:
        return None
    if taken.is_symlink() or not taken.is_dir():  # swapped in between: nothing of ours
        taken.unlink(missing_ok=True)
        return None
    return taken


def expire(queue: Path, now: float | None = None, max_age: float = RESULT_MAX_AGE, keep: int = RESULT_KEEP) -> int:
    """Remove the results in ``queue`` nobody collected: those older than ``max_age`` seconds at ``now`` (the wall
    clock unless given) and all but the newest ``keep``; and the hidden folders a writer or reader killed midway
    left, once older than ``max_age``. A result whose request is still there (the daemon was killed between the
    two) stays: it says the request was carried out. Returns how many results were removed."""
    queue = Path(queue)
    now = time.time() if now is None else now
    results, leftovers = [], []
    for p in queue.iterdir() if queue.is_dir() else ():
        try:
            st = p.lstat()
        except FileNotFoundError:
            continue  # collected meanwhile
        if p.name.startswith("."):
            leftovers.append((st.st_mtime, p))
        elif p.name.endswith(RESULT):
            results.append((st.st_mtime, p))
    results.sort(key=lambda r: r[0], reverse=True)  # newest first
    removed = 0
    for i, (mtime, p) in enumerate(results):
        if (queue / f"{p.name[: -len(RESULT)]}{REQUEST}").exists():
            continue  # the record that its request was carried out, until :func:`pending` removes the request
        if (i >= keep or now - mtime > max_age) and (taken := _take(p)) is not None:
            shutil.rmtree(taken, ignore_errors=True)
            removed += 1
    for mtime, p in leftovers:
        if now - mtime > max_age:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
    return removed


def wait(queue: Path, rid: str, timeout: float, poll: float) -> tuple[dict, dict | None] | None:
    """:func:`collect` until the result comes or ``timeout`` seconds pass (None: the request still waits)."""
    end = time.monotonic() + timeout
    while True:
        got = collect(queue, rid)
        if got is not None:
            return got
        if time.monotonic() >= end:
            return None
        time.sleep(poll)  # another process writes the result: nothing here to wait on but the file system


def waiting(queue: Path, rid: str) -> bool:
    """Whether request ``rid`` is still in ``queue``, not yet taken."""
    return (Path(queue) / f"{rid}{REQUEST}").is_dir()


def withdraw(queue: Path, rid: str) -> None:
    """Remove request ``rid`` if the daemon has not taken it yet (its asker gave up waiting)."""
    shutil.rmtree(Path(queue) / f"{rid}{REQUEST}", ignore_errors=True)
