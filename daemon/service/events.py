"""How events read: one line each, in the words an owner reads (``status``, its JSON and the HTTP page).

The store keeps an audit trail, and some things are recorded there in more than one row:

- a version is recorded when the gate decides (``promoted: false``: not in service yet, whatever the
  decision), then again when its promotion is carried out (``promoted: true``) or fails (the reason
  replaced). The first row must stay: it is written before the export, which a stop or a crash may cut
  short, and the next start carries out a decision it finds recorded. Read one after the other, the two
  rows said "promoted: false; reason: better on ..." then "promoted: true" with the same reason, and an
  owner read that the model had been refused;
- a job is recorded queued (with its reason), running, then done or failed.

:func:`fold` shows each version's rows, and each job's, as one line at its last row, saying what
happened; the rows it folded stay listed (``ids``), and the store keeps them all.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping


def readable(message: object) -> str:
    """An event's message as text: its ``message`` when that is all it says, else ``key: value`` pairs."""
    if not isinstance(message, dict):
        return str(message)
    if set(message) == {"message"}:
        return str(message["message"])
    return "; ".join(f"{k}: {_value(v)}" for k, v in sorted(message.items()))


def _value(v: object) -> str:
    return v if isinstance(v, str) else json.dumps(v, sort_keys=True)


# kind -> (the keys its sentence needs, the sentence); any other key of the message follows as "key: value"
_SENTENCES = {
    "rollback": (("from", "to"), "rolled back from {from} to {to}"),
    "quarantine": (("source", "reason"), "quarantined {source}: {reason}"),
    "refused": (("manifest", "line", "reason"), "{manifest} line {line} refused: {reason}"),
    "duplicate": (("source", "existing"), "{source} is a copy of {existing}, stored already"),
    "error": (("where", "error"), "{where}: {error}"),
    "info": (("message",), "{message}"),
}
_DUPLICATE_DETAIL = ("sha256", "label", "existing_label", "label_conflict", "moved_to")


def _sentence(kind: str, message: dict) -> str:
    keys, sentence = _SENTENCES.get(kind, ((), ""))
    if not keys or not all(k in message for k in keys):
        return readable(message)
    text = sentence.format_map({k: _value(message[k]) for k in keys})
    if kind == "duplicate" and message.get("label_conflict"):
        text += f" (dropped as {message.get('label')}, stored as {message.get('existing_label')})"
    rest = {k: v for k, v in message.items() if k not in keys and not (kind == "duplicate" and k in _DUPLICATE_DETAIL)}
    return text + (f"; {readable(rest)}" if rest else "")


def version_text(version: str, rows: list[dict], decision: bool | None) -> str:
    """A version's rows (oldest first) as one sentence; ``decision``: whether the gate chose to promote it
    (``metrics["promote"]``; None where the store does not say)."""
    last, first = rows[-1]["message"], rows[0]["message"]
    reason = last.get("reason") or ""
    if last.get("promoted"):
        what = "promoted"
    elif decision and reason == first.get("reason"):  # decided, not carried out yet (or stopped before it)
        what = "passed the gate, promotion not finished"
    else:
        what = "kept out" if decision is False else "not promoted"  # a failed promotion replaced the reason
    return f"{version} {what}" + (f": {reason}" if reason else "")


def job_text(job: object, rows: list[dict]) -> str:
    """A job's rows (oldest first) as one sentence: its last state, why it ran, why it failed."""
    last = rows[-1]["message"]
    reason = next((r["message"]["reason"] for r in rows if r["message"].get("reason")), None)
    state = last.get("state")
    if state == "queued" and any(r["message"].get("state") == "running" for r in rows):
        state = "interrupted, queued to resume"
    text = f"job {job} {state}" + (f": {last['error']}" if last.get("error") else "")
    return text + (f"; why: {reason}" if reason else "")


def _group(event: dict) -> tuple[str, object] | None:
    """The rows an event folds with: a version's, a job's (None: it stands alone)."""
    message = event.get("message")
    if not isinstance(message, dict):
        return None
    if event["kind"] == "version" and isinstance(message.get("version"), str):
        return "version", message["version"]
    if event["kind"] == "job" and "job" in message and "state" in message:
        return "job", message["job"]
    return None


def fold(events: Iterable[dict], decisions: Mapping[str, bool | None] | None = None) -> list[dict]:
    """Events (``Event.to_json()``, oldest first) as lines, oldest first: each version's rows and each job's
    folded into one at its last row, every line with its ``text``.

    Args:
        decisions: version -> whether the gate chose to promote it (``metrics["promote"]``).

    Returns:
        The last row of each line with ``ids`` (every row it stands for, oldest first), ``first_at`` (the
        first one's time) and ``text`` added.
    """
    events = list(events)
    groups: dict[tuple[str, object], list[dict]] = {}
    for e in events:
        if (key := _group(e)) is not None:
            groups.setdefault(key, []).append(e)
    lines = []
    for e in events:
        key = _group(e)
        rows = groups[key] if key is not None else [e]
        if rows[-1] is not e:
            continue  # shown at its group's last row
        if key is None:
            text = _sentence(e["kind"], e["message"]) if isinstance(e["message"], dict) else readable(e["message"])
        elif key[0] == "version":
            text = version_text(key[1], rows, (decisions or {}).get(key[1]))
        else:
            text = job_text(key[1], rows)
        lines.append(e | {"ids": [r["id"] for r in rows], "first_at": rows[0]["at"], "text": text})
    return lines
