"""The status page's HTML, from a :func:`~edgerev_daemon.service.status.status` snapshot: what an owner reads
at a glance.

In order: the model in service (``section#in-service``: its version, when the gate promoted it and why, its
held-out accuracy on all samples and on the recent window, per class with a bar each, its training curves and
per-class picture inline); what comes next (``section#next``: the next job or why not yet, the running job,
the storage budget, labels held back, the questions waiting with a link to ``/label`` and what the last
answers gained); what needs a look (``section#attention``, only when something does:
a full disk, a broken ``current`` link, an inbox folder skipped, a failed job, files in quarantine); the data;
the versions as a table (promoted or kept out, and why, in words); the latest events in the device's local
time, each once (:func:`~edgerev_daemon.service.events.fold`).

Everything comes from the device: the style is inline, there is no script, and the pictures are the PNGs
this server serves (``/versions/vNNNN/curves.png``). Every value is escaped: label and file names come
from the inbox, and a folder named ``<script>`` shows as text.
"""

from __future__ import annotations

import html
import time
from collections.abc import Iterable

from edgerev_daemon.learning.schedule import listed
from edgerev_daemon.service.events import readable
from edgerev_daemon.service.status import (
    job_state_text,
    next_job_text,
    progress_line,
    pseudo_text,
    questions_text,
    storage_line,
)
from edgerev_daemon.storage.registry import VERSION_RE

PICTURES = {"curves": "training curves", "classes": "accuracy per class"}

_STYLE = """body{font-family:system-ui,sans-serif;margin:1.2em auto;max-width:60em;padding:0 1em;color:#222}
h1{font-size:1.4em;margin:0}h2{font-size:1.15em;margin:1.4em 0 .4em;border-bottom:1px solid #ddd}
.muted{color:#666}.big{font-size:1.6em;font-weight:bold}
section#in-service{background:#f3f7f3;border:1px solid #cfe0cf;border-radius:6px;padding:.2em 1em 1em}
section#attention{background:#fdf3e7;border:1px solid #ecc99a;border-radius:6px;padding:.2em 1em .5em}
table{border-collapse:collapse}td,th{padding:.25em .7em;text-align:left;vertical-align:top}
th{border-bottom:1px solid #ccc}tr:nth-child(even) td{background:#f7f7f7}
td.num{text-align:right;font-variant-numeric:tabular-nums}meter{width:10em}
dl{display:grid;grid-template-columns:max-content auto;gap:.3em 1em}dt{font-weight:bold}dd{margin:0}
img{width:100%;height:auto;border:1px solid #ddd;background:#fff}
figure{display:inline-block;width:48%;margin:.5em 1% 0 0;vertical-align:top}figcaption{font-size:.9em;color:#666}
.kept{color:#8a5a00}.promoted{color:#1d6b1d}.t{white-space:nowrap}"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<meta http-equiv="refresh" content="30">
<title>edgerev daemon{title}</title>
<style>{style}</style>
</head>
<body>
<header><h1>edgerev daemon</h1><p class="muted">{header}</p></header>
{sections}
<footer><p class="muted">Times are the device's local time; the page reloads every 30 s.
<a href="/status.json">status.json</a> &middot; <a href="/metrics">metrics</a></p></footer>
</body>
</html>
"""


def esc(value: object) -> str:
    """Text for HTML, quotes included (safe in an attribute too); None is empty."""
    return html.escape("" if value is None else str(value), quote=True)


def local_time(at: float | None) -> str:
    """``2026-11-23 14:05:09 CET``: a stored time in the device's own time zone."""
    if at is None:
        return ""
    return time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(at)).strip()


def percent(value: float | None) -> str:
    return "-" if value is None else f"{100 * value:.1f} %"


def _table(header: Iterable[str], rows: Iterable[Iterable[str]], cls: str = "") -> str:
    """A table of cells already in HTML (the caller escapes them)."""
    rows = list(rows)
    if not rows:
        return "<p>none</p>"
    head = "<tr>" + "".join(f"<th>{esc(h)}</th>" for h in header) + "</tr>"
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    attr = f' class="{esc(cls)}"' if cls else ""
    return f"<table{attr}>{head}{body}</table>"


def _definitions(items: Iterable[tuple[str, str]]) -> str:
    """A ``<dl>`` of (term, HTML) pairs."""
    return "<dl>" + "".join(f"<dt>{esc(t)}</dt><dd>{d}</dd>" for t, d in items) + "</dl>"


def picture_path(version: str, name: str) -> str | None:
    """``/versions/v0002/curves.png``, the path the server serves a version's plot at (None: no such plot)."""
    return f"/versions/{version}/{name}.png" if VERSION_RE.fullmatch(version) and name in PICTURES else None


def _in_service(s: dict) -> str:
    cur = s.get("current")
    if cur is None:
        return ('<section id="in-service"><h2>Model in service</h2><p class="big">none yet</p>'
                "<p>The first job trains one once enough labelled images arrived (see what comes next).</p></section>")
    version = cur["version"]
    parts = [f'<h2>Model in service</h2><p><span class="big">{esc(version)}</span>']
    if cur.get("decided_at") is not None:
        parts.append(f" promoted by the gate on {esc(local_time(cur['decided_at']))}")
    parts.append("</p>")
    if cur.get("reason"):
        parts.append(f"<p>Why: {esc(cur['reason'])}</p>")
    n = cur.get("heldout_samples") or {}
    rows = [("all held-out samples", cur.get("heldout_accuracy"), n.get("all"))]
    days = cur.get("recent_window_days")
    if cur.get("recent_heldout_accuracy") is not None:
        window = "all of them" if days is None else f"the {days:g} days before each class's newest sample"
        rows.append((f"the recent window ({window})", cur["recent_heldout_accuracy"], n.get("recent")))
    if cur.get("heldout_accuracy") is None:
        parts.append("<p>Held-out accuracy: not measured (a base model, or a version judged before edgerev kept "
                     "it).</p>")
    else:
        parts.append(_table(("held-out accuracy on", "accuracy", "samples"),
                            ((esc(on), f'<span class="big">{esc(percent(a))}</span>',
                              f'<span class="num">{esc("" if k is None else k)}</span>') for on, a, k in rows),
                            "figures"))
    per_class = cur.get("per_class") or {}
    if per_class:
        which = " (recent window)" if cur.get("recent_heldout_accuracy") is not None else ""
        parts.append(f"<h3>Per class{esc(which)}</h3>")
        parts.append(_table(("class", "accuracy", ""),
                            ((esc(c), f'<span class="num">{esc(percent(a))}</span>',
                              "" if a is None else f'<meter min="0" max="1" value="{a:.4f}">{esc(percent(a))}</meter>')
                             for c, a in per_class.items()), "classes"))
    for name in cur.get("pictures") or ():
        if (path := picture_path(version, name)) is not None:
            caption = f"{PICTURES[name]} of {version}"
            parts.append(f'<figure><a href="{esc(path)}"><img src="{esc(path)}" alt="{esc(caption)}"></a>'
                         f"<figcaption>{esc(caption)}</figcaption></figure>")
    if cur.get("onnx"):
        parts.append(f'<p class="muted">ONNX: {esc(cur["onnx"])}</p>')
    return '<section id="in-service">' + "".join(parts) + "</section>"


def _next(s: dict) -> str:
    items = [("next job", esc(next_job_text(s) or "-"))]
    job = s.get("job")
    if job is not None:
        what = "job" if job["state"] in ("queued", "running") else "last job"
        text = f"job {job['id']} {job_state_text(s)}" + (f": {job['error']}" if job.get("error") else "")
        text += f"; why: {job['reason']}" if job.get("reason") else ""
        if (line := progress_line(job.get("progress"))) is not None:
            text += f"; {line}"
        items.append((what, esc(text)))
    if (st := s.get("storage")) is not None:
        used, most = st["usage"]["total"], st.get("max_bytes")
        bar = f' <meter min="0" max="{most}" value="{min(used, most)}"></meter>' if most else ""
        items.append(("storage", esc(storage_line(st).removeprefix("storage: ")) + bar))
    waiting = s.get("labels_held_back") or {}
    items.append(("labels held back", esc(f"{listed(waiting)}: too few training samples yet" if waiting else "none")))
    if (q := s.get("questions")) is not None:
        link = ' <a href="/label">answer them</a>' if q["waiting"] else ""
        items.append(("questions", esc(questions_text(q)) + link))
    return '<section id="next"><h2>What comes next</h2>' + _definitions(items) + "</section>"


def _attention(s: dict) -> str:
    items = []
    if s.get("snapshot"):
        items.append("read from the database file alone (a storage fault): the latest changes may be missing")
    disk = s.get("disk") or {}
    if disk.get("below_floor"):
        items.append(f"disk: {disk.get('free_bytes')} bytes free, below storage.min_free_space "
                     f"({disk['min_free_bytes']}): ingest and training wait")
    if (s.get("storage") or {}).get("over"):
        items.append(f"storage over its bounds: {s['storage']['over']}")
    if s.get("current_link") not in (None, "ok", "missing"):
        items.append(f"current link {s['current_link']} (repaired at the next start)")
    items += [f"inbox folder {folder} skipped: {error}" for folder, error in (s.get("inbox_problems") or {}).items()]
    job = s.get("job") or {}
    if job.get("state") == "failed":
        items.append(f"job {job['id']} failed: {job.get('error')}")
    if s.get("quarantined_files"):
        items.append(f"{s['quarantined_files']} files in quarantine (each with its reason beside it)")
    if not items:
        return ""
    return ('<section id="attention"><h2>Needs a look</h2><ul>' + "".join(f"<li>{esc(i)}</li>" for i in items)
            + "</ul></section>")


def _data(s: dict) -> str:
    n = s["samples"]
    unlabeled = f", {n['unlabeled']} unlabelled" if n.get("unlabeled") is not None else ""
    items = [("samples", esc(f"{n['total']} ({n['train']} train, {n['heldout']} held out{unlabeled}); "
                             f"{s['new_samples_since_last_job']} new since the last job")),
             ("labels", esc(", ".join(s["labels"]) or "none")),
             *([("pseudo-labels", esc(pseudo_text(s["pseudo_labels"])))] if s.get("pseudo_labels") else []),
             ("inbox", esc(s["inbox"])), ("data directory", esc(s["data_dir"]))]
    return '<section id="data"><h2>Data</h2>' + _definitions(items) + "</section>"


def outcome(v: dict, s: dict) -> str:
    """What became of a version, in words: in service, promoted, being promoted, kept out, not promoted."""
    if v["version"] == (s.get("current") or {}).get("version"):
        return "in service"
    if v["promoted"]:
        return "promoted" if v["on_disk"] else "promoted (pruned)"
    if v.get("promote") is False:
        return "kept out"
    job = s.get("job") or {}
    if v.get("promote") and job.get("id") == v.get("job") and job.get("state") in ("queued", "running"):
        return "being promoted"
    return "not promoted"


def _versions(s: dict) -> str:
    def plots(v: dict) -> str:
        paths = [(name, picture_path(v["version"], name)) for name in v.get("pictures") or ()]
        return " ".join(f'<a href="{esc(p)}">{esc(name)}</a>' for name, p in paths if p)

    def row(v: dict) -> list[str]:
        what = outcome(v, s)
        cls = "promoted" if what in ("in service", "promoted") else "kept" if what != "being promoted" else ""
        return [esc(v["version"]), f'<span class="t">{esc(local_time(v.get("decided_at")))}</span>',
                f'<span class="{cls}">{esc(what)}</span>',
                f'<span class="num">{esc(percent(v.get("heldout_accuracy")))}</span>',
                f'<span class="num">{esc(percent(v.get("recent_heldout_accuracy")))}</span>',
                esc(v["reason"]), plots(v)]

    table = _table(("version", "decided", "outcome", "held-out", "recent", "why", "plots"),
                   (row(v) for v in reversed(s["versions"][-20:])), "versions")
    more = len(s["versions"]) - 20
    return ('<section id="versions"><h2>Versions</h2>' + table
            + (f'<p class="muted">and {more} older (status.json lists them all)</p>' if more > 0 else "")
            + "</section>")


def _events(s: dict) -> str:
    def when(e: dict) -> str:
        text = local_time(e["at"])
        if e.get("repeats", 1) > 1:
            text += f" (x{e['repeats']}, last {local_time(e['last_at'])})"
        return f'<span class="t">{esc(text)}</span>'

    table = _table(("at", "kind", "what happened"),
                   ((when(e), esc(e["kind"]), esc(e.get("text") or readable(e["message"])))
                    for e in reversed(s["events"])), "events")
    return '<section id="events"><h2>Latest events</h2>' + table + "</section>"


def format_html(s: dict) -> str:
    """A :func:`~edgerev_daemon.service.status.status` snapshot as the status page (every value escaped)."""
    pid = s.get("daemon_pid")
    header = ("running, pid " + str(pid) if pid and pid > 0 else "running" if pid else "not running") + \
        f" · {s['data_dir']}"
    cur = s.get("current")
    sections = [_in_service(s), _next(s), _attention(s), _data(s), _versions(s), _events(s)]
    return _PAGE.format(title=esc(f": {cur['version']}" if cur else ""), style=_STYLE, header=esc(header),
                        sections="\n".join(x for x in sections if x))
