"""When the next fine-tuning job runs, and why not yet: one function for the service and ``status``.

A job is due when one is interrupted (it resumes), when ``schedule.min_new_samples`` new (labelled) samples
arrived since the data of the last finished job, when a new class became ready since that job (a label
the model in service does not know reached ``training.min_samples_per_label`` training samples and
``promotion.min_heldout_per_class`` held-out ones, so the gate can judge what the job learns of it;
``schedule.new_classes``), or when there is at least one new sample and ``schedule.max_interval_seconds``
passed since that job (or since the first sample). A failed job
holds the schedule back for ``schedule.retry_seconds`` after it failed: retried, not in a loop.

The words, everywhere (this module, the gate, ``status``, the summary and the plots): *new samples*
are labelled samples that arrived (or were labelled) after the data of the last finished job (or of the
model in service); *new classes* are labels the model in service does not know. Unlabelled samples make no
job due: they make the label questions due (:mod:`edgerev_daemon.learning.questions`), and the next job
learns from them with pseudo-labels when ``training.semi`` is on (as in the daemon's defaults).
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from edgerev_daemon.config import DaemonConfig, ScheduleConfig
from edgerev_daemon.storage.records import JobState, Split
from edgerev_daemon.storage.store import Store


@dataclass(frozen=True)
class Schedule:
    """``due``: why a job runs now (None: none is due); ``waiting``: why not, in one line (None when
    one is due); ``retry_at``: the time a failed job's back-off ends; ``new_samples``,
    ``samples_needed``: the count and how many more samples make a job due."""

    due: str | None
    waiting: str | None
    new_samples: int = 0
    samples_needed: int = 0
    retry_at: float | None = None

    def to_json(self) -> dict:
        return {"due": self.due, "waiting": self.waiting, "new_samples": self.new_samples,
                "samples_needed": self.samples_needed, "retry_at": self.retry_at}


def next_job(store: Store, s: ScheduleConfig, now: float, known: Collection[str] = (), minimum: int = 1,
             minimum_heldout: int = 0, semi: bool = False) -> Schedule:
    """Whether a job is due at ``now``, and if not, why not.

    Args:
        known: the classes of the model in service (() before the first: its first job waits for the
            thresholds like any other).
        minimum: the training samples a label needs to be trained (``training.min_samples_per_label``).
        minimum_heldout: the held-out samples a new class needs before it makes a job due (the gate's
            ``promotion.min_heldout_per_class``: fewer cannot show what the job learned of it).
        semi: jobs learn from the unlabelled samples too (``training.semi.enabled``): said when only
            unlabelled samples arrived, which make no job due.
    """
    if store.active_job() is not None:
        return Schedule("resume the interrupted job", None)
    n = store.new_samples_since_last_job()
    needed = max(0, s.min_new_samples - n)
    last = store.last_job()
    if last is not None and last.state == JobState.FAILED and last.finished_at is not None:
        retry_at = last.finished_at + s.retry_seconds
        if now < retry_at:
            return Schedule(None, f"job {last.id} failed; retried after schedule.retry_seconds, in "
                                  f"{retry_at - now:.0f} s ({n} new samples wait)", n, needed, retry_at)
    if n >= s.min_new_samples:
        return Schedule(f"{n} new samples (threshold {s.min_new_samples})", None, n, 0)
    ready = new_classes_ready(store, known, minimum, minimum_heldout) if s.new_classes else {}
    if ready:
        return Schedule(f"new class{'es' if len(ready) > 1 else ''} to learn: {listed(ready)}", None, n, needed)
    if n == 0:
        return Schedule(None, "no new samples since the last job" + _unlabeled_note(store, semi), 0, needed)
    done = store.last_job(JobState.DONE)
    since = done.finished_at if done is not None and done.finished_at else store.first_sample_time()
    if since is not None and now - since >= s.max_interval_seconds:
        return Schedule(f"{n} new samples and {now - since:.0f} s since the last job", None, n, needed)
    wait = "" if since is None else f", or {s.max_interval_seconds - (now - since):.0f} s"
    return Schedule(None, f"{n} new samples: {needed} more (schedule.min_new_samples {s.min_new_samples}){wait}",
                    n, needed)


def _unlabeled_note(store: Store, semi: bool) -> str:
    """What the unlabelled samples waiting do, when no labelled one arrived: they make no job due."""
    u = store.count_samples(labeled=False)
    if u == 0:
        return ""
    use = ("the next job learns from them with pseudo-labels (training.semi)" if semi
           else "they are trained on once labelled (training.semi is off)")
    return (f"; {u} unlabelled samples wait, which make no job due: {use}, and answering the questions "
            "(edgerev daemon label) labels some")


def daemon_schedule(config: DaemonConfig, store: Store, known: Collection[str], now: float) -> Schedule:
    """:func:`next_job` with the daemon's settings; ``known``: the classes of the version in service."""
    return next_job(store, config.schedule, now, known, config.training.min_samples_per_label,
                    config.promotion.min_heldout_per_class, config.training.semi.enabled)


def new_classes_ready(store: Store, known: Collection[str], minimum: int, minimum_heldout: int = 0) -> dict[str, int]:
    """Labels the model in service does not know that became ready since the last finished job (at least
    ``minimum`` training and ``minimum_heldout`` held-out samples now, not in that job's data): label ->
    training samples.

    Each new class makes one job due, the first after it has enough samples: a job that then trains it
    (promoted or refused) moves the comparison past it, so a refused class waits for the thresholds.
    """
    if not known:
        return {}
    last = store.last_job(JobState.DONE)

    def ready(upto: int | None) -> dict[str, int]:
        train = store.label_counts(Split.TRAIN, upto_batch=upto)
        held = store.label_counts(Split.HELDOUT, upto_batch=upto)
        return {label: n for label, n in train.items() if n >= minimum and held.get(label, 0) >= minimum_heldout}

    before = ready(last.data_batch_id) if last is not None else {}
    return {label: n for label, n in sorted(ready(None).items()) if label not in known and label not in before}


def held_back(store: Store, upto_batch: int | None, minimum: int) -> dict[str, int]:
    """Labels with fewer than ``minimum`` training samples up to ``upto_batch``: label -> that count.

    Such a label is not trained as a class (a class of one sample teaches the head nothing but that
    sample) and its held-out samples are not judged; it waits, reported, until enough arrive, and is
    then trained on every sample it has (see :func:`edgerev_daemon.learning.jobs.job_data`).
    """
    return {label: n for label, n in store.label_counts(Split.TRAIN, upto_batch=upto_batch).items() if n < minimum}


def listed(waiting: dict[str, int]) -> str:
    """``cat (2), dog (0)``: held-back labels with their training samples (log, events, status alike)."""
    return ", ".join(f"{label} ({n})" for label, n in waiting.items())
