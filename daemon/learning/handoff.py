"""Fleet requests handed to a daemon that is already running, through its data directory.

A SuperNode's ClientApp cannot open a data directory whose daemon is running (the lock). It posts the
request instead in ``DATA_DIR/fleet/requests/`` (:mod:`edgerev_daemon.storage.mailbox`: ``meta.json``, what
is asked and the fleet model's description, and ``shared.safetensors``, the tensors, written whole or not
at all). The daemon's loop takes each request at its next cycle (:func:`serve_requests`, from
:meth:`edgerev_daemon.service.daemon.Daemon.cycle`) as a job of its own and answers it the same way
(``meta.json``, and ``shared.safetensors`` for a round). The ClientApp waits for the answer
(:func:`wait_result`), and withdraws its request when none comes in time. A daemon killed in the middle of
a request takes it again at its next start: a round resumes from its checkpoint, a candidate's recorded
decision is carried out.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from edgerev.fleet.model import Consideration, FleetError, FleetModel, RoundResult
from edgerev_daemon.learning.host import JobHost
from edgerev_daemon.storage import mailbox

log = logging.getLogger("edgerev.daemon.fleet")

KINDS = ("classes", "round", "model", "refused")


def requests_dir(root: Path) -> Path:
    return root / "fleet" / "requests"


def submit(root: Path, kind: str, fm: FleetModel | None = None, **extra) -> str:
    """Post a request for the daemon of ``root``; returns its id."""
    if kind not in KINDS:
        raise ValueError(f"unknown fleet request {kind!r}")
    meta: dict = {"kind": kind, **extra}
    tensors = None
    if fm is not None:
        d = asdict(fm)
        tensors = d.pop("shared")
        d["classes"] = list(d["classes"])
        meta["model"] = d
    return mailbox.post(requests_dir(root), meta, tensors)


def wait_result(root: Path, rid: str, timeout: float, poll: float = 0.5):
    """The daemon's answer to request ``rid``: a class count, a :class:`RoundResult` or a
    :class:`Consideration`.

    Raises:
        FleetError: the daemon refused the request (its reason), or did not answer within ``timeout``
            seconds (the request is withdrawn if the daemon has not taken it yet).
    """
    queue = requests_dir(root)
    try:
        got = mailbox.wait(queue, rid, timeout, poll)
    except (OSError, ValueError, KeyError) as e:
        raise FleetError(f"the daemon's answer to request {rid} could not be read: {e}") from None
    if got is None:
        mailbox.withdraw(queue, rid)
        raise FleetError(f"the device's daemon did not answer the fleet's request within {timeout:g} s "
                         f"(is it running? it takes requests between its cycles)")
    meta, tensors = got
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


def serve_requests(daemon: JobHost, stop: Callable[[], bool] = lambda: False) -> int:
    """Carry out every request waiting in the daemon's data directory, oldest first; returns how many."""
    from edgerev_daemon.learning import fleet

    queue = requests_dir(daemon.config.layout.root)
    done = 0
    for rid, req in mailbox.pending(queue):
        if stop():
            break
        out: dict = {}
        tensors = None
        try:
            meta, shared = mailbox.read(req)
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
        mailbox.answer(queue, rid, out, tensors)
        done += 1
    return done
