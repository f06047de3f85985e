"""Fleet requests handed to a daemon that is already running, through its data directory.

A SuperNode's ClientApp cannot open a data directory whose daemon is running (the lock). It writes the
request instead, ``DATA_DIR/fleet/requests/<id>.request/`` (``meta.json``: what is asked and the fleet
model's description; ``shared.safetensors``: the tensors), complete before its folder gets its final name
(written as ``.<id>.tmp``, every file and the folder fsynced, then renamed and the parent fsynced: the
daemon never sees half a request, even after a power cut). The daemon's loop takes
each request at its next cycle (:func:`serve_requests`, from :meth:`edgerev_daemon.service.daemon.Daemon.cycle`)
as a job of its own, writes ``<id>.result/`` the same way (``meta.json``, and ``shared.safetensors``
for a round), and removes the request. The ClientApp waits for the result folder (:func:`wait_result`),
reads it and removes it. A daemon killed in the middle of a request takes it again at its next start:
a round resumes from its checkpoint, a candidate's recorded decision is carried out.

Nothing but ``meta.json`` and safetensors is read: no pickle, names confined to the requests folder.
"""

from __future__ import annotations

import json
import logging
import shutil
import time
import uuid
from dataclasses import asdict
from pathlib import Path

from edgerev.atomic import atomic_write, fsync_dir
from edgerev.errors import EdgerevError
from edgerev.train.checkpoint import load_tensors, save_tensors
from edgerev_daemon.learning.fleet import Consideration, FleetError, FleetModel, RoundResult

log = logging.getLogger("edgerev.daemon.fleet")

KINDS = ("classes", "round", "model", "refused")


def requests_dir(root: Path) -> Path:
    return root / "fleet" / "requests"


def _write_dir(final: Path, meta: dict, tensors: dict | None) -> None:
    tmp = final.with_name(f".{final.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if tensors is not None:
        meta = {**meta, "sha256": save_tensors(tmp / "shared.safetensors", tensors)}
    atomic_write(tmp / "meta.json", json.dumps(meta).encode())  # fsynced, as the tensors are, and the folder
    tmp.rename(final)
    fsync_dir(final.parent)  # the name too: a power cut leaves no folder, or a complete one


def _read_dir(folder: Path) -> tuple[dict, dict | None]:
    meta = json.loads((folder / "meta.json").read_text())
    tensors = load_tensors(folder / "shared.safetensors", meta["sha256"]) if "sha256" in meta else None
    return meta, tensors


def submit(root: Path, kind: str, fm: FleetModel | None = None, **extra) -> str:
    """Write a request for the daemon of ``root``; returns its id."""
    if kind not in KINDS:
        raise ValueError(f"unknown fleet request {kind!r}")
    rid = uuid.uuid4().hex
    meta: dict = {"kind": kind, **extra}
    tensors = None
    if fm is not None:
        d = asdict(fm)
        tensors = d.pop("shared")
        d["classes"] = list(d["classes"])
        meta["model"] = d
    _write_dir(requests_dir(root) / f"{rid}.request", meta, tensors)
    return rid


def wait_result(root: Path, rid: str, timeout: float, poll: float = 0.5):
    """The daemon's answer to request ``rid``: a class count, a :class:`RoundResult` or a
    :class:`Consideration`.

    Raises:
        FleetError: the daemon refused the request (its reason), or did not answer within ``timeout``
            seconds (the request is withdrawn if the daemon has not taken it yet).
    """
    folder = requests_dir(root)
    result = folder / f"{rid}.result"
    end = time.monotonic() + timeout
    while not result.is_dir():
        if time.monotonic() >= end:
            shutil.rmtree(folder / f"{rid}.request", ignore_errors=True)
            raise FleetError(f"the device's daemon did not answer the fleet's request within {timeout:g} s "
                             f"(is it running? it takes requests between its cycles)")
        time.sleep(poll)  # another process writes the answer: nothing here to wait on but the file system
    try:
        meta, tensors = _read_dir(result)
    except (OSError, ValueError, KeyError, EdgerevError) as e:
        raise FleetError(f"the daemon's answer to request {rid} could not be read: {e}") from None
    finally:
        shutil.rmtree(result, ignore_errors=True)
    if "error" in meta:
        raise FleetError(meta["error"])
    kind = meta["kind"]
    if kind == "classes":
        return {k: int(v) for k, v in meta["counts"].items()}
    if kind == "round":
        return RoundResult(shared=tensors or {}, **meta["result"])
    if kind == "model":
        return Consideration(**meta["result"])
    return None


def _model(meta: dict, tensors: dict | None) -> FleetModel:
    d = dict(meta["model"])
    d["classes"] = tuple(d["classes"])
    return FleetModel(shared=tensors or {}, **d)


def serve_requests(daemon, stop=lambda: False) -> int:
    """Carry out every request waiting in the daemon's data directory, oldest first; returns how many."""
    from edgerev_daemon.learning import fleet

    folder = requests_dir(daemon.config.layout.root)
    if not folder.is_dir():
        return 0
    # a link is never followed: a request is a folder the ClientApp made inside the data directory
    pending = sorted((p for p in folder.iterdir()
                      if p.name.endswith(".request") and not p.is_symlink() and p.is_dir()),
                     key=lambda p: p.stat().st_mtime)
    done = 0
    for req in pending:
        if stop():
            break
        rid = req.name[: -len(".request")]
        out: dict = {}
        tensors = None
        try:
            meta, shared = _read_dir(req)
            kind = meta.get("kind")
            out["kind"] = kind
            if kind == "classes":
                out["counts"] = fleet.label_counts(daemon)
            elif kind == "round":
                r = fleet.train_round(daemon, _model(meta, shared), stop)
                tensors = r.shared
                out["result"] = {k: v for k, v in asdict(r).items() if k != "shared"}
            elif kind == "model":
                c = fleet.consider(daemon, _model(meta, shared))
                out["result"] = asdict(c)
            elif kind == "refused":
                fleet.refuse(daemon, str(meta.get("what", "request")), str(meta.get("error", "")))
            else:
                raise FleetError(f"unknown fleet request {kind!r}")
        except FleetError as e:
            out["error"] = str(e)
        except (OSError, ValueError, KeyError, TypeError) as e:
            out["error"] = f"the fleet's request could not be read: {e}"
            fleet.refuse(daemon, "request", out["error"])
        if "error" in out and stop():  # stopped under way: the request stays, taken again at the next start
            log.info("fleet request %s stopped; taken again at the next start", rid)
            break
        _write_dir(folder / f"{rid}.result", out, tensors)
        shutil.rmtree(req, ignore_errors=True)
        done += 1
    return done
