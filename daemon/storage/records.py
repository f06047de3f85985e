"""The rows of the store as frozen dataclasses, and the enums their state and kind columns take."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from edgerev.enums import TextEnum

LABEL = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
LABEL_RULE = "1 to 64 letters, digits, '_', '.' or '-', starting with a letter or digit"
#: the names that mean *no label*: the inbox folder of unlabelled images (both spellings), and the same word
#: as a manifest line's label; never a class
UNLABELED = ("unlabeled", "unlabelled")


def label_problem(name: object) -> str | None:
    """Why ``name`` cannot be a label (a class), or ``None`` when it can."""
    if not isinstance(name, str) or LABEL.fullmatch(name) is None:
        return f"label '{name}' is not a valid name ({LABEL_RULE})"
    if name in UNLABELED:
        return f"'{name}' means no label (the inbox folder of unlabelled images), never a class"
    return None


class Split(TextEnum):
    TRAIN = "train"
    HELDOUT = "heldout"


class JobState(TextEnum):
    """A job goes ``queued -> running -> done | failed``; a running job found at start-up (the daemon
    was killed) may go back to ``queued`` to be resumed from its checkpoint."""

    QUEUED = "queued"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"


JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED}),
    JobState.RUNNING: frozenset({JobState.DONE, JobState.FAILED, JobState.QUEUED}),
    JobState.DONE: frozenset(),
    JobState.FAILED: frozenset(),
}


class EventKind(TextEnum):
    """What an event row records; its message is a JSON object whose keys depend on the kind."""

    DUPLICATE = "duplicate"      # source, sha256, existing (source of the stored copy), label_conflict
    QUARANTINE = "quarantine"    # source, reason, moved_to
    REFUSED = "refused"          # manifest, line, reason (the entry named nothing the daemon may touch)
    JOB = "job"                  # job, state, error
    VERSION = "version"          # version, promoted, reason
    ROLLBACK = "rollback"        # from, to
    ERROR = "error"              # where, error
    INFO = "info"                # message
    REMOVED = "removed"          # why, samples, bytes, by_label, unlabeled (retention), or quarantine files and bytes
    LABELED = "labeled"          # sha256, label, split, source (the inbox path or answer that gave it), sample_source


class RemovalReason(TextEnum):
    """Why the retention policy removed a sample (:mod:`edgerev_daemon.storage.retention`)."""

    BYTES = "max_bytes"          # the data directory was over storage.max_bytes
    SAMPLES = "max_samples"      # the store held more than storage.max_samples


@dataclass(frozen=True)
class NewSample:
    """A sample about to be recorded: ``sha256`` of the dropped file, ``blob_sha256`` of the stored
    normalized PNG, the original ``width`` and ``height``, and ``source`` (its path in the inbox);
    ``label`` is ``None`` for an unlabelled image."""

    sha256: str
    label: str | None
    width: int
    height: int
    blob_sha256: str
    source: str


@dataclass(frozen=True)
class NewLabel:
    """A label given to a stored unlabelled sample: ``source`` is what gave it (the inbox path of the same
    image dropped again with a label, or an answer such as ``"answer"``)."""

    sha256: str
    label: str
    source: str


@dataclass(frozen=True)
class Sample:
    """A stored sample. An unlabelled one has ``label`` and ``split`` ``None``: it enters no training, no
    held-out evaluation, no gate; its split is decided when it gets its label (:meth:`labeled`).

    ``batch_id`` orders samples for the schedule and the jobs: the ingest batch it arrived in, or, for one
    labelled later, the batch that gave it its label (from then on it is new data)."""

    sha256: str
    label: str | None
    split: Split | None
    width: int
    height: int
    blob_sha256: str
    source: str
    added_at: float
    batch_id: int

    @property
    def labeled(self) -> bool:
        return self.label is not None


@dataclass(frozen=True)
class Job:
    """``data_batch_id``: the last ingest batch whose samples the job sees (later ones are new)."""

    id: int
    state: JobState
    reason: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    data_batch_id: int
    checkpoint_dir: str | None
    error: str | None


@dataclass(frozen=True)
class Version:
    """A model version: ``promoted`` once it passed the promotion gate; ``reason`` says why or why not."""

    id: str
    created_at: float
    job_id: int | None
    parent_id: str | None
    promoted: bool
    metrics: dict = field(default_factory=dict)
    reason: str = ""


@dataclass(frozen=True)
class Event:
    """``repeats``: how many times the same event was seen in a row (a fault lasting many polls is one
    event); ``last_at``: when it was last seen (``None``: once only)."""

    id: int
    at: float
    kind: EventKind
    message: dict
    repeats: int = 1
    last_at: float | None = None

    def to_json(self) -> dict:
        return {"id": self.id, "at": self.at, "kind": self.kind.value, "message": self.message,
                "repeats": self.repeats, "last_at": self.last_at}


def dumps(obj: dict) -> str:
    """JSON for a message or metrics column (sorted keys, so equal objects store equal text)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))
