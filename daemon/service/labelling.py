"""The owner answers the questions: the one path answers take (:func:`give`), and the labelling page's HTML.

:func:`give` serves ``edgerev daemon label --set/--skip`` and the page's POST alike: it takes the data
directory's lock when it is free and applies the answers itself, or hands them to the daemon that holds it
(:mod:`edgerev_daemon.learning.answers` says how, and why a label is written only under the lock).

The page (:func:`format_label_page`) lists the questions waiting, each with its picture (the stored,
normalized image, ``/blobs/<hash>.png``), the model's guess and how unsure it was, and the file it came from;
one form per question, one button per known label, a skip button and a field for a new label. A digit key
answers the top question with the label whose badge shows that digit (:func:`label_keys`: a label that is
itself one digit is its own key, so pressing ``5`` answers ``5``; the other labels take the digits left) and
``s`` skips it, through a small inline script the Content-Security-Policy admits by a nonce of this response
alone (no script from anywhere else runs). Every form carries the server's token: a page from another site
cannot read it, so it cannot label. Every value is escaped.

:class:`Notes` keeps what the page says became of the latest answers, and turns a request the daemon had not
answered in time into its outcomes once it has (the result is collected, not left in the queue).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import LockError
from edgerev_daemon.learning import answers as answers_mod
from edgerev_daemon.learning.answers import Answer, Outcome
from edgerev_daemon.learning.questions import Question
from edgerev_daemon.service.lock import DataDirLock
from edgerev_daemon.service.page import esc
from edgerev_daemon.storage import mailbox
from edgerev_daemon.storage.store import Store


@dataclass(frozen=True)
class Given:
    """What :func:`give` did: the outcomes, or (``outcomes`` None) the id of a request the running daemon has
    not answered yet; it applies it at its next cycle (after the job under way, if one is)."""

    outcomes: list[Outcome] | None
    request: str | None = None


def give(config: DaemonConfig, answers: Sequence[Answer], wait: float = 10.0,
         wakeup: Callable[[], None] | None = None, poll: float = 0.1) -> Given:
    """Apply ``answers`` under the data directory's lock: directly when it is free, else through the running
    daemon, waiting at most ``wait`` seconds for its outcome (``wakeup``: a way to wake its loop)."""
    root = config.layout.root
    lock = DataDirLock(root)
    try:
        lock.acquire()
    except LockError:
        pass
    else:
        try:
            with Store(config.layout.database) as store:
                return Given(answers_mod.apply(config, store, answers))
        finally:
            lock.release()
    rid = answers_mod.submit(root, answers)
    if wakeup is not None:
        wakeup()
    got = answers_mod.wait(root, rid, wait, poll)
    return Given(got, None if got is not None else rid)


def pending_text(given: Given) -> str:
    return (f"handed to the running daemon (request {given.request}): it applies the answers at its next cycle, "
            "after the job under way if one is")


class Notes:
    """What the page says became of the latest answers, newest first (at most ``size``): their outcomes, or a
    line for a request handed to the daemon that had not answered before its waiter gave up. :meth:`latest`
    collects the results of those requests (the newest :data:`~edgerev_daemon.storage.mailbox.RESULT_KEEP`) and
    shows their outcomes instead; a result nobody collects expires in the mailbox. Safe across threads."""

    def __init__(self, root: Path, size: int = 10) -> None:
        self._root = root
        self._lock = threading.Lock()
        self._notes: deque[Outcome | str] = deque(maxlen=size)
        self._handed: dict[str, str] = {}  # request id -> its line among the notes, oldest first

    def add(self, given: Given) -> list[Outcome | str]:
        """Note what :func:`give` did; returns the notes it made."""
        made: list[Outcome | str] = list(given.outcomes) if given.outcomes is not None else [pending_text(given)]
        with self._lock:
            if given.outcomes is None and given.request is not None:
                self._handed[given.request] = pending_text(given)
                while len(self._handed) > mailbox.RESULT_KEEP:
                    del self._handed[next(iter(self._handed))]
            self._notes.extendleft(made)
        return made

    def latest(self) -> list[Outcome | str]:
        """The notes, newest first, with the outcomes of the handed-over requests the daemon has answered since."""
        with self._lock:
            for rid in list(self._handed):
                got = answers_mod.result(self._root, rid)
                if got is None:
                    continue
                line = self._handed.pop(rid)
                if line in self._notes:
                    self._notes.remove(line)
                self._notes.extendleft(got)
            return list(self._notes)


# the page -----------------------------------------------------------------------------------------------

_STYLE = """body{font-family:system-ui,sans-serif;margin:1.2em auto;max-width:60em;padding:0 1em;color:#222}
h1{font-size:1.4em;margin:0}.muted{color:#666}
form.q{display:grid;grid-template-columns:8em auto;gap:.2em 1em;border:1px solid #ddd;border-radius:6px;
padding:.6em;margin:.6em 0}form.q:first-of-type{border-color:#6a9f6a;background:#f3f7f3}
form.q img{width:8em;height:8em;image-rendering:pixelated;grid-row:span 3;border:1px solid #ccc}
button{margin:.1em .2em .1em 0}kbd{border:1px solid #aaa;border-radius:3px;padding:0 .25em;font-size:.85em}
.ok{color:#1d6b1d}.refused{color:#a00}code{font-size:.9em}"""

_SCRIPT = """document.addEventListener('keydown', function (e) {
  if (e.altKey || e.ctrlKey || e.metaKey || /^(INPUT|TEXTAREA|SELECT)$/.test(e.target.tagName)) return;
  if (!/^[0-9s]$/.test(e.key)) return;
  var form = document.querySelector('form.q');
  var button = form && form.querySelector('button[data-key="' + e.key + '"]');
  if (button) { e.preventDefault(); button.click(); }
});"""

_PAGE = """<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>edgerev daemon: questions</title>
<style>{style}</style>
</head>
<body>
<header><h1>Questions</h1><p class="muted">{header}</p></header>
{notes}
{forms}
<footer><p class="muted">Keys: the digit in a label's badge answers the top question with that label (a label that
is one digit is its own key; the other labels take the digits left, 1 to 9 then 0), <kbd>s</kbd> skips it.
<a href="/">status</a></p></footer>
<script nonce="{nonce}">{script}</script>
</body>
</html>
"""


def blob_path(sha256: str) -> str:
    """``/blobs/<hash>.png``: where the server serves a stored sample's normalized image."""
    return f"/blobs/{sha256}.png"


_DIGITS = "0123456789"
_KEY_ORDER = "1234567890"  # the order in which the labels that are no digit take the keys left


def label_keys(labels: Sequence[str]) -> dict[str, str]:
    """The key that answers with each label, by label (a label past the ten digits has none).

    A label that is itself one digit is its own key, whatever its place: with labels ``0``..``9`` the key ``5``
    answers ``5``. The other labels take the digits no such label took, 1 to 9 then 0, in the order of
    ``labels``. So a key never reads as another label than the one it answers with.
    """
    own = {label for label in labels if len(label) == 1 and label in _DIGITS}
    left = iter(k for k in _KEY_ORDER if k not in own)
    keys = {}
    for label in labels:
        key = label if label in own else next(left, None)
        if key is not None:
            keys[label] = key
    return keys


def _form(q: Question, labels: Sequence[str], keys: dict[str, str], token: str) -> str:
    guesses = ", ".join(f"{esc(c)} {100 * p:.0f} %" for c, p in q.top)
    buttons = "".join(
        f'<button type="submit" name="label" value="{esc(label)}"'
        + (f' data-key="{keys[label]}"><kbd>{keys[label]}</kbd> ' if label in keys else ">")
        + f"{esc(label)}</button>"
        for label in labels)
    return (f'<form class="q" method="post" action="/label" id="q-{esc(q.sample[:12])}">'
            f'<input type="hidden" name="token" value="{esc(token)}">'
            f'<input type="hidden" name="sample" value="{esc(q.sample)}">'
            f'<img src="{esc(blob_path(q.sample))}" alt="sample {esc(q.sample[:12])}">'
            f"<div>guess: <b>{esc(q.guess)}</b> <span class=\"muted\">(margin {q.margin:.2f}: {guesses})</span>"
            f"<br><span class=\"muted\">sample {esc(q.sample[:12])} from <code>{esc(q.source)}</code></span></div>"
            f'<div>{buttons}<button type="submit" name="skip" value="1" data-key="s"><kbd>s</kbd> skip</button></div>'
            f'<div><input name="new_label" placeholder="another label" aria-label="another label">'
            f'<button type="submit" name="add" value="1">add as a new label</button></div></form>')


def format_label_page(questions: Sequence[Question], labels: Sequence[str], token: str, nonce: str,
                      notes: Sequence[Outcome | str] = (), running: bool = False) -> str:
    """The labelling page: ``questions`` waiting, with a button per label of ``labels`` (in the store's order) and
    its key (:func:`label_keys`), the latest outcomes in ``notes``; every value escaped."""
    header = (f"{len(questions)} waiting" + (" · the daemon runs: answers go through it" if running else "")
              + " · labelled samples are trained on at the next job")
    lines = []
    for n in notes:
        if isinstance(n, Outcome):
            cls = "ok" if n.ok else "refused"
            lines.append(f'<li class="{cls}">{esc(n.sample[:12])}: {esc(n.text)}</li>')
        else:
            lines.append(f"<li>{esc(n)}</li>")
    notes_html = f'<ul id="notes">{"".join(lines)}</ul>' if lines else ""
    keys = label_keys(labels)
    forms = "\n".join(_form(q, labels, keys, token) for q in questions) or "<p>No question waits.</p>"
    return _PAGE.format(style=_STYLE, header=esc(header), notes=notes_html, forms=forms, nonce=esc(nonce),
                        script=_SCRIPT)
