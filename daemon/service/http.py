"""The optional status page: HTML, JSON and Prometheus metrics, and the labelling page, on the loopback only.

Off unless ``http.enabled``; the service starts a :class:`StatusServer` beside its loop::

    server = StatusServer(config).start()
    ...
    server.stop()

Routes (GET and HEAD, and POST to ``/label``; any other method is 405, any other path 404):

- ``/``: the status page (:mod:`edgerev_daemon.service.page`: the model in service with its curves inline,
  what comes next, the versions, the latest events; every value escaped, no script, inline style only);
- ``/versions/vNNNN/curves.png``, ``/versions/vNNNN/classes.png``: a version's plots, while on disk;
- ``/status.json``: the same snapshot as JSON;
- ``/metrics``: Prometheus text exposition format 0.0.4;
- ``/healthz``: ``ok``, for container health checks (it reads nothing);
- ``/label``: the questions waiting (:mod:`edgerev_daemon.service.labelling`), and ``POST /label`` an answer;
- ``/blobs/<sha256>.png``: a stored sample's normalized image, by its hash alone (never a path from the request).

The one write, ``POST /label``, takes the path every answer takes
(:func:`~edgerev_daemon.service.labelling.give`: under the data directory's lock, through the daemon when it
holds it, waiting up to ``answer_wait`` seconds for its outcome). It is refused with 403 unless the form carries
the token this server made at its start (random, compared in constant time; the pages carry it, and another
site's page cannot read them), and unless an ``Origin`` header, when the browser sends one, is this page's own:
no cross-site request can label.

**Under load.** Each connection is served by a thread of its own; the kernel queues up to
:data:`_BACKLOG` connections not yet accepted (``listen``'s backlog, capped by ``net.core.somaxconn``), so a burst
of a few hundred is queued, not reset (the library's default, 5, reset most of 200 answers posted at once). At
most ``answer_slots`` answers wait for the daemon at a time (a wait lasts up to ``answer_wait`` seconds while
the daemon's cycle is busy); one more is refused at once with 503 and ``Retry-After``, nothing of it applied.
An answer whose wait ended before the daemon applied it is noted as handed over; the page collects its outcome
later (:class:`~edgerev_daemon.service.labelling.Notes`), and one nobody collects expires in the mailbox.

Every request reads through a connection of its own (:func:`~edgerev_daemon.service.status.status` opens the
store and closes it before it returns): the write-ahead log lets it read while the daemon writes, and
no request but an answer writes anything. A store that cannot be read answers 503 with one line, never a traceback.

The page is for the machine itself. The server refuses to listen anywhere but a loopback address,
whatever the config says (it may have been built without validation), and it answers 403 to a
request whose ``Host`` header names anything but a loopback address: a web page in a browser on the
same machine cannot read it through a DNS name rebound to 127.0.0.1.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
import math
import os
import re
import secrets
import socket
import socketserver
import sqlite3
import threading
import time
from collections.abc import Callable, Iterable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

from edgerev.errors import EdgerevError, one_line
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import DaemonError
from edgerev_daemon.service.labelling import Notes
from edgerev_daemon.service.page import format_html
from edgerev_daemon.service.status import holder_pid, status
from edgerev_daemon.storage.registry import VERSION_RE

log = logging.getLogger("edgerev.daemon.http")

METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
ALLOW = "GET, HEAD"
# a version name as the registry writes it and one of its pictures, nothing else
_PICTURE = re.compile(r"/versions/(v\d{4,})/(curves|classes)\.png")
_PICTURE_LIMIT = 16 * 1024 * 1024  # a plot is well under 1 MiB; a bigger file is not read whole
_DRAIN_LIMIT = 64 * 1024  # request body bytes read (and dropped) before a 405, so the reply is not lost to a reset
_BLOB = re.compile(r"/blobs/([0-9a-f]{64})\.png")
_FORM_LIMIT = 16 * 1024  # an answer's form is a few hundred bytes
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src 'self'"
_BACKLOG = 256  # connections the kernel queues before accept: a burst of 200 answers at once fits
_RETRY_AFTER = 1  # seconds a refused answer is asked to wait: a slot frees as soon as the daemon answers one


def loopback_address(host: str, port: int) -> tuple[socket.AddressFamily, tuple]:
    """The address to bind for ``host``, which must be a loopback address or ``localhost``.

    An IP literal is checked as it is; ``localhost`` is resolved (every address it resolves to must
    be a loopback one, so a tampered hosts file cannot widen it). Any other name is refused without
    being looked up.

    Returns:
        The address family and the socket address of the first match.

    Raises:
        DaemonError: ``host`` is empty, not a loopback address, or ``localhost`` resolves elsewhere.
    """
    if not 0 <= port <= 65535:
        raise DaemonError(f"http.port: must lie in 0..65535, got {port}")
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        if host.lower().rstrip(".") != "localhost":
            raise DaemonError(f"http.host: the status page listens on a loopback address only, got {host!r}") from None
        flags = 0
    else:
        if not ip.is_loopback:
            raise DaemonError(f"http.host: the status page listens on a loopback address only, got {host!r}")
        flags = socket.AI_NUMERICHOST
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=flags)
    except socket.gaierror as e:
        raise DaemonError(f"http.host: cannot resolve {host!r}: {e.strerror or e}") from None
    infos = [i for i in infos if i[0] in (socket.AF_INET, socket.AF_INET6)]
    if not infos:
        raise DaemonError(f"http.host: {host!r} resolves to no IP address")
    for _family, _type, _proto, _name, sockaddr in infos:
        if not ipaddress.ip_address(sockaddr[0].split("%")[0]).is_loopback:
            raise DaemonError(f"http.host: {host!r} resolves to {sockaddr[0]}, not a loopback address")
    return infos[0][0], infos[0][4]


def _loopback_host_header(value: str | None) -> bool:
    """Whether a ``Host`` header (absent, as HTTP/1.0 allows, or ``name[:port]``) names the loopback."""
    if not value:
        return True
    value = value.strip()
    if value.startswith("["):
        name = value[1:].partition("]")[0]
    else:
        name = value.rpartition(":")[0] if value.count(":") == 1 else value
    if name.lower().rstrip(".") == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# metrics ------------------------------------------------------------------------------------------------


def escape_label_value(value: str) -> str:
    """A label value as the exposition format writes it: backslash, double quote and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _escape_help(text: str) -> str:
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def _number(value: float) -> str:
    if isinstance(value, bool):
        return "1" if value else "0"
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value))


def _family(name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]) -> list[str]:
    """The lines of one metric family: ``# HELP``, ``# TYPE``, then one line per sample (none: no lines)."""
    samples = list(samples)
    if not samples:
        return []
    lines = [f"# HELP {name} {_escape_help(help_text)}", f"# TYPE {name} {kind}"]
    for labels, value in samples:
        text = ",".join(f'{k}="{escape_label_value(str(v))}"' for k, v in labels.items())
        lines.append(f"{name}{{{text}}} {_number(value)}" if text else f"{name} {_number(value)}")
    return lines


_PROGRESS = (  # the running job's latest report: (its key, the metric, help); absent while no job trains
    ("step", "edgerev_job_step", "Optimizer steps the running job has taken."),
    ("total_steps", "edgerev_job_total_steps", "The running job's steps at its epoch maximum."),
    ("epoch", "edgerev_job_epoch", "The running job's epoch (1-based)."),
    ("epochs", "edgerev_job_epochs", "The running job's epoch maximum."),
    ("loss", "edgerev_job_loss", "The running job's mean training loss since its previous report."),
    ("val_acc", "edgerev_job_heldout_accuracy", "The running job's held-out accuracy at its last epoch (0..1)."),
    ("eta_seconds", "edgerev_job_eta_seconds", "Seconds until the running job reaches its epoch maximum."),
)


def format_metrics(s: dict) -> str:
    """A :func:`~edgerev_daemon.service.status.status` snapshot in Prometheus text exposition format 0.0.4.

    Counters are what only grows (samples stored counts the removed ones too; failed jobs stay failed);
    everything that may go down is a gauge (a version's ``promoted`` flag flips from false to true, events are
    pruned). ``edgerev_current_heldout_accuracy`` (all held-out samples) and
    ``edgerev_current_recent_heldout_accuracy`` (the recent window) are left out while unknown.
    """
    current = s.get("current") or {}
    number = 0
    if isinstance(current.get("version"), str) and VERSION_RE.fullmatch(current["version"]):
        number = int(current["version"][1:])
    accuracy, recent = current.get("heldout_accuracy"), current.get("recent_heldout_accuracy")
    promoted = sum(1 for v in s["versions"] if v["promoted"])
    job = s.get("job")
    lines: list[str] = []
    lines += _family("edgerev_daemon_up", "gauge", "1 while a daemon holds the data directory's lock, else 0.",
                     [({}, 1 if s.get("daemon_pid") else 0)])
    storage = s.get("storage") or {}
    removed_split = storage.get("removed_by_split") or {}
    lines += _family("edgerev_samples_total", "counter",
                     "Samples stored, by split (those kept and those the retention policy removed since).",
                     [({"split": split}, s["samples"][split] + removed_split.get(split, 0))
                      for split in ("train", "heldout")])
    lines += _family("edgerev_samples", "gauge", "Samples kept now, by split.",
                     [({"split": split}, s["samples"][split]) for split in ("train", "heldout")])
    if storage:
        removed = storage.get("removed") or {}
        lines += _family("edgerev_samples_removed_total", "counter",
                         "Samples removed by the retention policy, by the bound that asked (storage.max_bytes, "
                         "storage.max_samples).", [({"why": why}, removed.get(why, 0))
                                                   for why in ("max_bytes", "max_samples")])
        lines += _family("edgerev_storage_bytes", "gauge", "Bytes on disk of the data directory, by part.",
                         [({"part": part}, n) for part, n in storage["usage"].items() if part != "total"])
        lines += _family("edgerev_storage_max_bytes", "gauge", "The storage budget (storage.max_bytes); absent: none.",
                         [({}, storage["max_bytes"])] if storage.get("max_bytes") else [])
        lines += _family("edgerev_storage_over", "gauge",
                         "1 while the data directory is over its bounds and the policy cannot bring it under "
                         "(ingest waits), else 0.", [({}, 1 if storage.get("over") else 0)])
    lines += _family("edgerev_unlabeled_samples", "gauge",
                     "Unlabelled samples kept now (they wait for a label; a job may learn from them).",
                     [({}, s["samples"]["unlabeled"])] if "unlabeled" in s["samples"] else [])
    pseudo = s.get("pseudo_labels")
    lines += _family("edgerev_last_job_pseudo_labeled", "gauge",
                     "Unlabelled images the last job's last epoch gave a pseudo-label (of "
                     "edgerev_last_job_unlabeled_taken); absent before a job.",
                     [({}, pseudo["last_epoch_pseudo_labeled"])] if pseudo else [])
    lines += _family("edgerev_last_job_unlabeled_taken", "gauge",
                     "Unlabelled images the last job's last epoch took; absent before a job.",
                     [({}, pseudo["last_epoch_unlabeled"])] if pseudo else [])
    lines += _family("edgerev_labels", "gauge", "Labels (classes) seen so far.", [({}, len(s["labels"]))])
    lines += _family("edgerev_new_samples_since_last_job", "gauge",
                     "Samples stored after the data of the last finished job (what the schedule counts).",
                     [({}, s["new_samples_since_last_job"])])
    lines += _family("edgerev_quarantined_files", "gauge", "Files in the quarantine folder.",
                     [({}, s["quarantined_files"])])
    lines += _family("edgerev_versions", "gauge", "Model versions recorded, by whether they were promoted.",
                     [({"promoted": "true"}, promoted), ({"promoted": "false"}, len(s["versions"]) - promoted)])
    lines += _family("edgerev_current_version", "gauge",
                     "Number of the model version in service (v0007: 7); 0 when none is.", [({}, number)])
    lines += _family("edgerev_current_heldout_accuracy", "gauge",
                     "Held-out accuracy of the model version in service (0..1).",
                     [({}, float(accuracy))] if isinstance(accuracy, int | float) else [])
    lines += _family("edgerev_current_recent_heldout_accuracy", "gauge",
                     "Held-out accuracy of the model version in service on the recent window its promotion judged "
                     "(promotion.recent_window_days before each class's newest sample; 0..1).",
                     [({}, float(recent))] if isinstance(recent, int | float) else [])
    lines += _family("edgerev_job_active", "gauge", "1 while a fine-tuning job is queued or running, else 0.",
                     [({}, 1 if job and job["state"] in ("queued", "running") else 0)])
    progress = (job or {}).get("progress") or {}
    for key, name, help_text in _PROGRESS:
        value = progress.get(key)
        lines += _family(name, "gauge", help_text, [({}, value)] if isinstance(value, int | float) else [])
    q = s.get("questions") or {}
    if q:
        gain = (q.get("gain") or {}).get("gained")
        lines += _family("edgerev_questions_waiting", "gauge", "Unlabelled samples the daemon asks its owner to label.",
                         [({}, q["waiting"])])
        lines += _family("edgerev_answers", "gauge", "Samples an owner's answer labelled (while stored and the event "
                         "log keeps the answer).", [({}, q["answers"])])
        lines += _family("edgerev_answers_accuracy_gain", "gauge",
                         "Held-out accuracy gained from the last answers (the version in service after the first job "
                         "that trained on them minus before it, on that job's held-out samples); absent: not yet.",
                         [({}, float(gain))] if isinstance(gain, int | float) else [])
    lines += _family("edgerev_jobs_failed_total", "counter", "Fine-tuning jobs that failed (of the latest 1000).",
                     [({}, s["jobs_failed"])])
    lines += _family("edgerev_store_rows", "gauge", "Rows per table of the store (events are pruned).",
                     [({"table": t}, n) for t, n in s["counts"].items() if not t.startswith("samples_")])
    return "\n".join(lines) + "\n"


# server -------------------------------------------------------------------------------------------------


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    server_version = "edgerev"
    sys_version = ""
    timeout = 10.0  # a client that connects and says nothing does not keep a thread forever

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (the base class names it so)
        log.debug("%s %s", self.address_string(), format % args)

    def _send(self, code: int, body: bytes | str, content_type: str = "text/plain; charset=utf-8",
              headers: dict[str, str] | None = None, csp: str = _CSP) -> None:
        data = body.encode() if isinstance(body, str) else body
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.send_header("X-Content-Type-Options", "nosniff")
        # nothing from outside the device, no script: the page's own style and the plots this server serves
        self.send_header("Content-Security-Policy", csp)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(data)

    def _snapshot(self, events: int) -> dict | None:
        """:func:`status`, or None after answering 503 (the store is missing, locked too long or broken)."""
        try:
            return status(self.server.config, events=events, clock=self.server.clock)
        except (EdgerevError, sqlite3.Error, OSError) as e:
            line = one_line(e)
            log.warning("status page: store unavailable: %s", line)
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"store unavailable: {line}\n")
            return None

    def do_GET(self) -> None:  # noqa: N802 (the base class dispatches on this name)
        if not _loopback_host_header(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, "forbidden: the Host header names no loopback address\n")
            return
        path = urlsplit(self.path).path
        try:
            if path == "/healthz":
                self._send(HTTPStatus.OK, "ok\n")
            elif path == "/":
                if (s := self._snapshot(events=20)) is not None:
                    self._send(HTTPStatus.OK, format_html(s), "text/html; charset=utf-8")
            elif path == "/status.json":
                if (s := self._snapshot(events=10)) is not None:
                    self._send(HTTPStatus.OK, json.dumps(s, indent=2, default=str) + "\n", "application/json")
            elif path == "/metrics":
                if (s := self._snapshot(events=0)) is not None:
                    self._send(HTTPStatus.OK, format_metrics(s), METRICS_CONTENT_TYPE)
            elif (m := _PICTURE.fullmatch(path)) is not None and (png := self._picture(*m.groups())) is not None:
                self._send(HTTPStatus.OK, png, "image/png")
            elif path == "/label":
                self._label_page()
            elif (m := _BLOB.fullmatch(path)) is not None and (png := self._blob(m.group(1))) is not None:
                self._send(HTTPStatus.OK, png, "image/png")
            else:
                self._send(HTTPStatus.NOT_FOUND, "not found\n")
        except (BrokenPipeError, ConnectionResetError):
            pass  # the client went away
        except Exception:
            log.exception("status page: %s %s failed", self.command, path)
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "internal error (see the daemon's log)\n")

    do_HEAD = do_GET  # noqa: N815 (same headers, no body: see _send)

    def _picture(self, version: str, name: str) -> bytes | None:
        """A version's ``NAME.png``, or None (no such version or file on disk): the name matched
        :data:`_PICTURE` and the file is opened without following a link out of the version folder."""
        from edgerev_daemon.storage.registry import Registry

        folder = Registry(self.server.config.layout.root).path(version)
        try:
            fd = os.open(folder / f"{name}.png", os.O_RDONLY | os.O_NOFOLLOW)
        except OSError:
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(_PICTURE_LIMIT)

    def _blob(self, sha256: str) -> bytes | None:
        """A stored sample's normalized image, or None: the hash matched :data:`_BLOB` (64 hex digits), and the
        file the blob store keeps under it is opened without following a link."""
        from edgerev_daemon.storage.blobs import BlobStore

        try:
            fd = os.open(BlobStore(self.server.config.layout.blobs).path(sha256), os.O_RDONLY | os.O_NOFOLLOW)
        except (OSError, ValueError):
            return None
        with os.fdopen(fd, "rb") as f:
            return f.read(_PICTURE_LIMIT)

    def _label_page(self, code: int = HTTPStatus.OK, notes: list | None = None) -> None:
        from edgerev_daemon.learning.questions import waiting
        from edgerev_daemon.service.labelling import format_label_page
        from edgerev_daemon.storage.store import Store

        config = self.server.config
        try:
            with Store(config.layout.database) as store:
                questions, labels = waiting(config.layout.root, store), store.labels()
        except (EdgerevError, sqlite3.Error, OSError) as e:
            line = one_line(e)
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"store unavailable: {line}\n")
            return
        nonce = secrets.token_urlsafe(16)
        shown = self.server.notes.latest() if notes is None else notes
        page = format_label_page(questions, labels, self.server.token, nonce, shown,
                                 running=holder_pid(config) is not None)
        self._send(code, page, "text/html; charset=utf-8",
                   csp=f"{_CSP}; script-src 'nonce-{nonce}'; form-action 'self'; base-uri 'none'; "
                       "frame-ancestors 'none'")

    def _own_origin(self) -> bool:
        """Whether the ``Origin`` header is absent or names this page (``http://`` and the ``Host`` it was
        asked for, which :func:`_loopback_host_header` checked)."""
        origin = self.headers.get("Origin")
        if origin is None:
            return True
        host = self.headers.get("Host") or ""
        return bool(host) and origin == f"http://{host}"

    def do_POST(self) -> None:  # noqa: N802 (the base class dispatches on this name)
        from edgerev_daemon.learning.answers import Answer
        from edgerev_daemon.service.labelling import give

        if urlsplit(self.path).path != "/label":
            self._not_allowed()
            return
        length = self.headers.get("Content-Length", "")
        if not length.isdigit() or int(length) > _FORM_LIMIT:
            self.close_connection = True
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE if length.isdigit() else HTTPStatus.LENGTH_REQUIRED,
                       "an answer is a small form\n")
            return
        body = self.rfile.read(int(length))
        if not _loopback_host_header(self.headers.get("Host")):
            self._send(HTTPStatus.FORBIDDEN, "forbidden: the Host header names no loopback address\n")
            return
        if not self._own_origin():
            self._send(HTTPStatus.FORBIDDEN, "forbidden: the request comes from another page than this one\n")
            return
        try:
            form = {k: v[0] for k, v in parse_qs(body.decode("utf-8"), strict_parsing=False).items()}
        except UnicodeDecodeError:
            form = {}
        token = form.get("token", "")
        if not hmac.compare_digest(token.encode(), self.server.token.encode()):
            log.warning("status page: an answer without this server's token refused")
            self._send(HTTPStatus.FORBIDDEN, "forbidden: the form lacks this page's token (reload the page)\n")
            return
        sample = form.get("sample", "")
        if "skip" in form:
            answer = Answer(sample, None)
        elif "add" in form:
            answer = Answer(sample, form.get("new_label", "").strip(), new_label=True)
        else:
            answer = Answer(sample, form.get("label", ""))
        if not self.server.slots.acquire(blocking=False):
            self._send(HTTPStatus.SERVICE_UNAVAILABLE,
                       f"busy: {self.server.answer_slots} answers wait for the daemon already; this one was not "
                       f"taken: send it again in {_RETRY_AFTER} s\n", headers={"Retry-After": str(_RETRY_AFTER)})
            return
        try:
            given = give(self.server.config, [answer], wait=self.server.answer_wait, wakeup=self.server.wakeup)
        except (EdgerevError, sqlite3.Error, OSError) as e:
            line = one_line(e)
            self._send(HTTPStatus.SERVICE_UNAVAILABLE, f"store unavailable: {line}\n")
            return
        finally:
            self.server.slots.release()
        notes = self.server.notes.add(given)
        if given.outcomes is not None and not all(o.ok for o in given.outcomes):
            self._label_page(HTTPStatus.CONFLICT, notes)  # the reason, at once, with the questions still waiting
            return
        self._send(HTTPStatus.SEE_OTHER, "answered\n", headers={"Location": "/label"})

    def _not_allowed(self) -> None:
        length = self.headers.get("Content-Length", "")
        if length.isdigit() and int(length) <= _DRAIN_LIMIT:
            self.rfile.read(int(length))
        self.close_connection = True
        self._send(HTTPStatus.METHOD_NOT_ALLOWED, "method not allowed: the only write is POST /label\n",
                   headers={"Allow": ALLOW})

    def __getattr__(self, name: str):
        # every method but GET, HEAD and POST (PUT, DELETE, made-up ones) is refused alike
        if name.startswith("do_"):
            return self._not_allowed
        raise AttributeError(name)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = _BACKLOG
    config: DaemonConfig
    token: str  # the answers' token, made at the start
    notes: Notes  # the latest outcomes of answers, newest first, for the labelling page
    wakeup: Callable[[], None] | None
    answer_wait: float
    answer_slots: int
    slots: threading.BoundedSemaphore  # one per answer that may wait for the daemon at a time

    def server_bind(self) -> None:
        # HTTPServer.server_bind asks for the host's FQDN, a DNS lookup that can hang on a device offline
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = str(self.server_address[0]), int(self.server_address[1])


class _Server6(_Server):
    address_family = socket.AF_INET6


class StatusServer:
    """The status page of ``config``'s data directory, served from a thread of its own.

    Args:
        config: the daemon's configuration; ``config.http.host`` and ``config.http.port`` say where to
            listen (port 0: any free port, see :attr:`port`). ``config.http.enabled`` is the caller's
            business: this class serves whenever it is started.
        poll_interval: seconds between the serving thread's checks for :meth:`stop`.
        clock: the time snapshots are taken at (``time.time``; tests inject a fixed one).
        wakeup: wakes the daemon's loop when an answer is handed to it (the service passes its own).
        answer_wait: seconds a POST waits for the daemon to apply an answer before the page says it is pending.
        answer_slots: answers that may wait at a time; one more is refused with 503 and ``Retry-After``.
    """

    def __init__(self, config: DaemonConfig, poll_interval: float = 0.5,
                 clock: Callable[[], float] = time.time, wakeup: Callable[[], None] | None = None,
                 answer_wait: float = 5.0, answer_slots: int = 8) -> None:
        if answer_slots < 1:
            raise ValueError(f"answer_slots: must be at least 1, got {answer_slots}")
        self.config = config
        self.wakeup = wakeup
        self.answer_wait = answer_wait
        self.answer_slots = answer_slots
        self.token = ""
        self.poll_interval = poll_interval
        self.clock = clock
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._server is not None

    @property
    def server_address(self) -> tuple:
        """The bound socket address (``(host, port)``, or a 4-tuple for IPv6)."""
        if self._server is None:
            raise DaemonError("the status page is not running")
        return self._server.server_address

    @property
    def port(self) -> int:
        """The bound port (the one the system chose when the config asked for 0)."""
        return int(self.server_address[1])

    @property
    def url(self) -> str:
        host = self.server_address[0]
        return f"http://{f'[{host}]' if ':' in host else host}:{self.port}/"

    def start(self) -> StatusServer:
        """Bind and serve in a daemon thread.

        Raises:
            DaemonError: the host is not a loopback address, the port is taken, or it already runs.
        """
        if self._server is not None:
            raise DaemonError("the status page is already running")
        family, address = loopback_address(self.config.http.host, self.config.http.port)
        cls = _Server6 if family == socket.AF_INET6 else _Server
        try:
            server = cls(address, _Handler)
        except OSError as e:
            raise DaemonError(f"http: cannot listen on {self.config.http.host}:{self.config.http.port}: "
                              f"{e.strerror or e}") from None
        server.config = self.config
        server.clock = self.clock
        # per start: a page served before a restart cannot answer after it (the token is in no file)
        self.token = server.token = secrets.token_urlsafe(32)
        server.notes = Notes(self.config.layout.root)
        server.wakeup, server.answer_wait = self.wakeup, self.answer_wait
        server.answer_slots, server.slots = self.answer_slots, threading.BoundedSemaphore(self.answer_slots)
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, args=(self.poll_interval,),
                                        name="edgerev-http", daemon=True)
        self._thread.start()
        log.info("status page on %s", self.url)
        return self

    def stop(self) -> None:
        """Stop serving and close the listening socket (a no-op when not running)."""
        server, thread = self._server, self._thread
        if server is None:
            return
        self._server = self._thread = None
        server.shutdown()
        server.server_close()
        if thread is not None:
            thread.join()

    def __enter__(self) -> StatusServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
