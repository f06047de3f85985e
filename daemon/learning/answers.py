"""The owner's answers to the questions: a label for a sample, or "skip it", from the CLI or the page.

Both take one path, :func:`edgerev_daemon.service.labelling.give`. A label is written by whoever holds
the data directory's lock, never beside it (the journal line before the commit, one writer). So ``give``
first tries the lock: free (no daemon runs), it applies the answers itself (:func:`apply`) and releases
it. Held (the daemon runs, and the page is served from the daemon's own process), it posts them in
``DATA_DIR/questions/answers/`` (:mod:`edgerev_daemon.storage.mailbox`, the queue the fleet's requests take
too: a request is written whole or not at all), wakes the daemon when it can (the page shares its process),
and waits a while for the result. The daemon takes the requests at its next cycle (:func:`serve`),
before it decides on a job; a job under way keeps it busy, so a wait may end first: the answers are then
applied after that job, and their result waits in the queue for whoever asks for it (:func:`result`: the page
collects the ones its waiters gave up on) until the mailbox's bounds expire it.

An answer is refused, with the reason, when its sample is no longer stored (the retention policy removed
it), was labelled since, or is named ambiguously; a label the store does not know yet is refused as a
likely typo, the known ones named, unless the answer says it is a new label.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import StoreError
from edgerev_daemon.learning import questions
from edgerev_daemon.storage import mailbox
from edgerev_daemon.storage.store import Store

log = logging.getLogger("edgerev.daemon.answers")


@dataclass(frozen=True)
class Answer:
    """``label`` for the sample ``sample`` names (its hash or a prefix of 6+ digits); ``label`` None: skip
    it. ``new_label``: the label may be one the store does not know yet."""

    sample: str
    label: str | None
    new_label: bool = False


@dataclass(frozen=True)
class Outcome:
    """What became of one answer: ``ok``, and a line saying it (the label and split given, or why not)."""

    sample: str
    ok: bool
    text: str


def parse_set(text: str, new_label: bool = False) -> Answer:
    """``SAMPLE=LABEL`` (``--set``) as an :class:`Answer`.

    Raises:
        ValueError: no ``=``, or an empty side.
    """
    sample, eq, label = text.partition("=")
    if not eq or not sample.strip() or not label.strip():
        raise ValueError(f"--set takes SAMPLE=LABEL (a sample's hash or its first 6+ digits), got {text!r}")
    return Answer(sample.strip(), label.strip(), new_label)


def apply(config: DaemonConfig, store: Store, answers: Sequence[Answer]) -> list[Outcome]:
    """Carry out ``answers`` in order (the caller holds the data directory's lock); each one on its own:
    a refused answer does not stop the next."""
    out: list[Outcome] = []
    skips: list[str] = []
    for a in answers:
        try:
            sample = store.resolve_sample(a.sample)
            if a.label is None:
                if sample.label is not None:
                    raise StoreError(f"sample {sample.sha256[:12]} is labelled '{sample.label}' already")
                skips.append(sample.sha256)
                out.append(Outcome(sample.sha256, True, "skipped: not asked again"))
                continue
            known = store.labels()
            if a.label not in known and not a.new_label:
                raise StoreError(f"'{a.label}' is no label the store knows (known: {', '.join(known) or 'none'}); "
                                 "a typo? give it as a new label to add it (--new-label)")
            done = store.label_sample(sample.sha256, a.label, config.heldout_fraction, source="answer")
            out.append(Outcome(done.sha256, True, f"labelled '{done.label}' ({done.split})"))
        except StoreError as e:
            out.append(Outcome(a.sample, False, f"refused: {e}"))
    if skips:
        questions.add_skipped(config.layout.root, skips, set(store.unlabeled_hashes()))
    for o in out:
        log.info("answer for %s: %s", o.sample[:12], o.text)
    return out


# the hand-over to a running daemon ---------------------------------------------------------------------

def answers_dir(root: Path) -> Path:
    return questions.folder(root) / "answers"


def submit(root: Path, answers: Sequence[Answer]) -> str:
    """Post the answers for the daemon of ``root`` (:mod:`edgerev_daemon.storage.mailbox`); returns the id."""
    return mailbox.post(answers_dir(root), {"answers": [asdict(a) for a in answers]})


def serve(config: DaemonConfig, store: Store, now: float | None = None) -> int:
    """Apply every waiting request, oldest first, each answered with its outcomes; returns how many. The results
    nobody collected (their asker gave up waiting) expire first (:func:`edgerev_daemon.storage.mailbox.expire`, at
    ``now``: the wall clock unless given)."""
    queue = answers_dir(config.layout.root)
    taken = mailbox.pending(queue, now)
    for rid, req in taken:
        try:
            meta, _ = mailbox.read(req)
            answers = [Answer(str(d["sample"]), None if d["label"] is None else str(d["label"]),
                              bool(d.get("new_label", False))) for d in meta["answers"]]
            outcomes = [asdict(o) for o in apply(config, store, answers)]
        except (OSError, ValueError, KeyError, TypeError) as e:
            outcomes = [asdict(Outcome("?", False, f"refused: the request could not be read: {e}"))]
        mailbox.answer(queue, rid, {"outcomes": outcomes})
    return len(taken)


def _outcomes(rid: str, read: Callable[[], tuple[dict, dict | None] | None]) -> list[Outcome] | None:
    try:
        got = read()
        return None if got is None else [Outcome(**d) for d in got[0]["outcomes"]]
    except (OSError, ValueError, KeyError, TypeError) as e:  # the daemon applied them: its result is lost
        return [Outcome("?", False, f"the daemon's result for request {rid} could not be read ({e}): "
                                    "see edgerev daemon status for what was labelled")]


def result(root: Path, rid: str) -> list[Outcome] | None:
    """The daemon's outcomes for request ``rid`` (read once: the result is removed), or None (not yet)."""
    return _outcomes(rid, lambda: mailbox.collect(answers_dir(root), rid))


def wait(root: Path, rid: str, timeout: float, poll: float) -> list[Outcome] | None:
    """:func:`result`, waiting at most ``timeout`` seconds for it (None: the daemon has not answered yet; the
    request stays, applied at its next cycle)."""
    return _outcomes(rid, lambda: mailbox.wait(answers_dir(root), rid, timeout, poll))


__all__ = ["Answer", "Outcome", "apply", "parse_set", "result", "serve", "submit", "wait"]
