"""The rows of the store as frozen dataclasses, and the enums their state and kind columns take."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import Enum


class Split(str, Enum):
    TRAIN = "train"
    HELDOUT = "heldout"


class JobState(str, Enum):
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


class EventKind(str, Enum):
    """What an event row records; its message is a JSON object whose keys depend on the kind."""

    DUPLICATE = "duplicate"      # source, sha256, existing (source of the stored copy), label_conflict
    QUARANTINE = "quarantine"    # source, reason, moved_to
    REFUSED = "refused"          # manifest, line, reason (the entry named nothing the daemon may touch)
    JOB = "job"                  # job, state, error
    VERSION = "version"          # version, promoted, reason
    ROLLBACK = "rollback"        # from, to
    ERROR = "error"              # where, error
    INFO = "info"                # message
    REMOVED = "removed"          # why, samples, bytes, by_label (retention), or quarantine files and bytes


class RemovalReason(str, Enum):
    """Why the retention policy removed a sample (:mod:`edgerev_daemon.storage.retention`)."""

    BYTES = "max_bytes"          # the data directory was over storage.max_bytes
    SAMPLES = "max_samples"      # the store held more than storage.max_samples


@dataclass(frozen=True)
class NewSample:
    """A sample about to be recorded: ``sha256`` of the dropped file, ``blob_sha256`` of the stored
    normalized PNG, the original ``width`` and ``height``, and ``source`` (its path in the inbox)."""

    sha256: str
    label: str
    width: int
    height: int
    blob_sha256: str
    source: str


@dataclass(frozen=True)
class Sample:
    sha256: str
    label: str
    split: Split
    width: int
    height: int
    blob_sha256: str
    source: str
    added_at: float
    batch_id: int


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
