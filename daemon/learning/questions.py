"""The questions: the unlabelled samples whose label would help most, ranked for the device's owner.

**What is asked.** The version in service scores the newest ``questions.max_scored`` unlabelled samples
(newest first: the bound on a refresh's time, and the device's present is what the owner can still judge).
A sample's *margin* is the gap between the model's two highest class probabilities: a small margin is a
sample the model cannot decide between two classes, where a label moves the boundary most (margin
sampling, Scheffer et al. 2001). The ``questions.pool`` x ``questions.count`` smallest margins are the
candidates.

**Spread.** A camera's stream holds runs of near-identical frames; by margin alone the list would be twenty
frames of one scene. Among the candidates, :func:`rank` picks greedily the one farthest (Euclidean) from
every pick so far (farthest-first, the 2-approximation of k-center; Sener and Savarese, ICLR 2018, used it
on features for active learning), starting from the smallest margin, each distance weighted by the doubt
left, ``1 - margin`` (at least 0.01): a pool larger than the doubtful samples also holds sure ones, and
unweighted farthest-first would pick them first for being far from every doubt; a model sure of everything
still gets a spread list. Distance is measured on the model's *logits* (each row less its mean: what
softmax sees), not on a penultimate layer: every model the daemon may serve (ours, an ONNX import, a
factory's) gives its logits, and only ours has a known feature layer; nor on probabilities, which saturate
(a sure model's are one-hot, and every sure sample of a class looks the same). Two frames of one scene get
nearly the same vector, so the second is picked only after every other kind of doubt (another pair of
classes, another degree of doubt) has one question. The picks are then listed smallest margin first.

**Kept.** The list is one JSON file, ``DATA_DIR/questions/list.json``, written by :func:`edgerev.atomic.
atomic_write` (a temporary file, fsynced, renamed over the old one, the folder fsynced): a kill at any point
leaves the old list or the new one, never half of one. Samples the owner skipped are a second such file,
``skipped.json``; they are never asked again. Only the process holding the data directory's lock writes
either. A reader (:func:`waiting`) drops every question whose sample was removed or labelled since, so a list
never names one; the daemon makes a new list after each job (promoted or not), when the version in service
changed (a rollback), and when the list ran short while newer unlabelled samples arrived (:func:`due`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from edgerev.atomic import atomic_write
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.records import JobState, Sample
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.store import Store

if TYPE_CHECKING:  # torch is imported where a list is made: status and the page read lists without it
    import torch

log = logging.getLogger("edgerev.daemon.questions")

FORMAT = 1
BATCH = 256  # samples decoded and scored at a time (the stop flag is read between them)


def folder(root: Path) -> Path:
    return Path(root) / "questions"


def list_path(root: Path) -> Path:
    return folder(root) / "list.json"


def skipped_path(root: Path) -> Path:
    return folder(root) / "skipped.json"


@dataclass(frozen=True)
class Question:
    """One sample to label: its hash, the model's guess, the margin between its two top classes (0..1),
    its three most likely classes with their probabilities, and the file it came from."""

    sample: str
    guess: str
    margin: float
    top: tuple[tuple[str, float], ...]
    source: str

    def to_json(self) -> dict:
        return asdict(self) | {"top": [list(t) for t in self.top]}

    @classmethod
    def from_json(cls, d: dict) -> Question:
        return cls(str(d["sample"]), str(d["guess"]), float(d["margin"]),
                   tuple((str(c), float(p)) for c, p in d["top"]), str(d["source"]))


@dataclass(frozen=True)
class QuestionList:
    """A ranked list and what it was made from: the version in service, the last finished job, and the
    newest ingest batch holding an unlabelled sample at the time (what :func:`due` compares)."""

    version: str | None
    job: int | None
    newest_batch: int
    made_at: float
    scored: int
    questions: tuple[Question, ...]

    def to_json(self) -> dict:
        return {"format": FORMAT, "version": self.version, "job": self.job, "newest_batch": self.newest_batch,
                "made_at": self.made_at, "scored": self.scored, "questions": [q.to_json() for q in self.questions]}


def read_list(root: Path) -> QuestionList | None:
    """The list as last written, or None (none yet, or unreadable: a new one is made at the next cycle)."""
    try:
        d = json.loads(list_path(root).read_text())
        if d.get("format") != FORMAT:
            return None
        return QuestionList(d["version"], d["job"], int(d["newest_batch"]), float(d["made_at"]), int(d["scored"]),
                            tuple(Question.from_json(q) for q in d["questions"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def write_list(root: Path, ql: QuestionList) -> None:
    folder(root).mkdir(parents=True, exist_ok=True)
    atomic_write(list_path(root), json.dumps(ql.to_json(), indent=1).encode())


def skipped(root: Path) -> set[str]:
    """The hashes of the samples the owner chose not to label (never asked again)."""
    try:
        return set(json.loads(skipped_path(root).read_text()))
    except (OSError, ValueError, TypeError):
        return set()


def add_skipped(root: Path, hashes: Sequence[str], stored: set[str]) -> None:
    """Remember ``hashes`` as skipped (the caller holds the data directory's lock); a skipped sample no longer
    among the ``stored`` unlabelled ones is forgotten (the file stays as small as the questions it spares)."""
    folder(root).mkdir(parents=True, exist_ok=True)
    atomic_write(skipped_path(root), json.dumps(sorted((skipped(root) | set(hashes)) & stored)).encode())


def waiting(root: Path, store: Store) -> list[Question]:
    """The questions of the list still worth asking: their sample is stored, unlabelled and not skipped."""
    ql = read_list(root)
    if ql is None:
        return []
    unlabeled = set(store.unlabeled_hashes())
    gone = skipped(root)
    return [q for q in ql.questions if q.sample in unlabeled and q.sample not in gone]


# ranking ------------------------------------------------------------------------------------------------

def margins(probs: torch.Tensor) -> torch.Tensor:
    """Top-1 minus top-2 probability of each row (1 for a model of one class: nothing to decide)."""
    import torch

    if probs.shape[1] < 2:
        return torch.ones(len(probs))
    top = probs.topk(2, dim=1).values
    return top[:, 0] - top[:, 1]


def rank(logits: torch.Tensor, count: int, pool: int) -> list[int]:
    """The rows of ``logits`` ([N, C]) to ask about, smallest margin first: farthest-first, weighted by doubt,
    among the ``pool * count`` smallest margins (see the module docstring)."""
    import torch

    if len(logits) == 0 or count <= 0:
        return []
    m = margins(logits.softmax(1))
    cand = torch.argsort(m, stable=True)[: pool * count]
    vectors = logits[cand] - logits[cand].mean(1, keepdim=True)
    doubt = (1.0 - m[cand]).clamp_min(0.01)
    picked = [0]  # the smallest margin first
    nearest = torch.cdist(vectors, vectors[:1]).squeeze(1)
    while len(picked) < min(count, len(cand)):
        far = int(torch.argmax(nearest * doubt))  # ties: the first, i.e. the smaller margin
        if float(nearest[far] * doubt[far]) <= 0.0:  # only copies of picks (or sure ones) are left: a shorter list
            break
        picked.append(far)
        nearest = torch.minimum(nearest, torch.cdist(vectors, vectors[far:far + 1]).squeeze(1))
    chosen = [int(cand[i]) for i in picked]
    return sorted(chosen, key=lambda i: (float(m[i]), i))


def score(model_dir: Path, samples: Sequence[Sample], blobs: BlobStore,
          stop: Callable[[], bool] = lambda: False, trust_factories: Sequence[str] = ()
          ) -> tuple[torch.Tensor, tuple[str, ...]] | None:
    """The logits the model in ``model_dir`` gives each sample, and its classes; None when ``stop()`` said so
    (asked between batches of :data:`BATCH` samples: a stop request is not kept waiting by a long list).
    ``trust_factories``: the factories ``model_dir`` may name (the daemon's ``training.model.factories``)."""
    import torch

    from edgerev.models.directory import load_model
    from edgerev.train.evaluate import predict_logits
    from edgerev.train.labeled import LabeledImages
    from edgerev_daemon.learning.jobs import decode_samples

    model, info, _ = load_model(model_dir, trust_factories=trust_factories)
    classes = tuple(info.classes)
    out = [torch.zeros(0, len(classes))]
    for i in range(0, len(samples), BATCH):
        if stop():
            return None
        part = samples[i:i + BATCH]
        images = decode_samples(part, blobs)
        out.append(predict_logits(model, LabeledImages(images, torch.zeros(len(part), dtype=torch.long), classes),
                                  info))
    return torch.cat(out), classes


# refresh ------------------------------------------------------------------------------------------------

def _last_job(store: Store) -> int | None:
    job = next((j for j in store.jobs(limit=50) if j.state in (JobState.DONE, JobState.FAILED)), None)
    return None if job is None else job.id


def due(config: DaemonConfig, store: Store, registry: Registry) -> str | None:
    """Why the list should be made again now, or None."""
    root = config.layout.root
    newest = store.newest_unlabeled_batch()
    if newest == 0 and not list_path(root).exists():
        return None  # nothing to ask about, and no list to empty
    ql = read_list(root)
    if ql is None:
        return "no list yet"
    if ql.version != registry.current():
        return f"the version in service is {registry.current()} (the list was made with {ql.version})"
    if ql.job != _last_job(store):
        return "a job finished"
    if newest > ql.newest_batch and len(waiting(root, store)) < config.questions.count // 2 + 1:
        return "the list ran short and newer unlabelled samples arrived"
    return None


def refresh(config: DaemonConfig, store: Store, blobs: BlobStore, registry: Registry, now: float,
            stop: Callable[[], bool] = lambda: False) -> QuestionList | None:
    """Score the newest unlabelled samples with the version in service and write the new list (the caller
    holds the data directory's lock). No version in service: an empty list (nothing can guess yet). None:
    ``stop()`` said so while scoring, and the old list stays (the next cycle makes the new one)."""
    q = config.questions
    root = config.layout.root
    current = registry.current()
    gone = skipped(root)
    candidates = [s for s in store.unlabeled_samples() if s.sha256 not in gone][-q.max_scored:][::-1]
    chosen: list[Question] = []
    scored = 0
    if current is not None and candidates:
        scores = score(registry.path(current), candidates, blobs, stop, config.training.model.factories)
        if scores is None:
            return None
        logits, classes = scores
        scored = len(candidates)
        probs = logits.softmax(1)
        m = margins(probs)
        for i in rank(logits, q.count, q.pool):
            p, k = probs[i].topk(min(3, len(classes)))
            chosen.append(Question(candidates[i].sha256, classes[int(k[0])], round(float(m[i]), 4),
                                   tuple((classes[int(c)], round(float(v), 4)) for v, c in zip(p, k)),
                                   candidates[i].source))
    ql = QuestionList(current, _last_job(store), store.newest_unlabeled_batch(), now, scored, tuple(chosen))
    write_list(root, ql)
    log.info("questions: %d of %d unlabelled samples scored by %s asked", len(chosen), scored, current)
    return ql


def refresh_if_due(config: DaemonConfig, store: Store, blobs: BlobStore, registry: Registry, now: float,
                   stop: Callable[[], bool] = lambda: False) -> QuestionList | None:
    """:func:`refresh` when :func:`due` says so; the new list, or None (not due, or stopped)."""
    why = due(config, store, registry)
    if why is None:
        return None
    log.debug("questions: refreshing (%s)", why)
    return refresh(config, store, blobs, registry, now, stop)
