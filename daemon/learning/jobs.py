"""A fine-tuning job: the store's samples in, a trained candidate model directory out.

A job sees the labelled samples of every ingest batch up to its ``data_batch_id`` (fixed when it is
created), so a job resumed after a crash trains on exactly the data it started with. An unlabelled
sample enters neither its labelled training nor its held-out evaluation (it is in no split); once it gets a
label it is data of the batch that labelled it, so the next job sees it as new. With ``training.semi``
enabled, the newest ``training.max_unlabeled`` unlabelled samples up to the job's batch are the trainer's
unlabelled images (FixMatch: pseudo-labels inside the steps only); with none, the job is the labelled one.
It runs the trainer
(:func:`edgerev.train.trainer.train`) in ``DATA_DIR/jobs/<id>/``:

- with no model in service, from scratch on every training sample;
- otherwise from the current version (``model.init``): on the samples that arrived after that
  version's data, plus the replay sample kept beside it and distillation from it on the old classes,
  the head growing for new labels.

The trainer checkpoints as it goes; :func:`run_job` resumes from the checkpoint when one exists. A stop
is asked between steps, between batches of every evaluation, and while the samples are decoded (every
:data:`DECODE_CHUNK` of them: a device may hold a hundred thousand).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from edgerev.models.directory import model_classes
from edgerev.train.config import AugmentConfig, DataConfig, RunConfig
from edgerev.train.data import decode_image
from edgerev.train.labeled import LabeledImages
from edgerev.train.progress import Progress
from edgerev.train.state import has_checkpoint
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import Stopped
from edgerev_daemon.learning.schedule import held_back, listed
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.records import Job, JobState, Sample, Split
from edgerev_daemon.storage.store import Store

DECODE_CHUNK = 256  # samples decoded between two looks at the stop flag (about 25 ms of CPU)


@dataclass(frozen=True)
class JobOutcome:
    status: str  # "trained", "stopped", "skipped"
    run_dir: Path
    reason: str = ""
    summary: dict | None = None
    held_back: dict[str, int] = field(default_factory=dict)  # label -> its training samples (too few)


def load_samples(samples: Sequence[Sample], blobs: BlobStore, classes: Sequence[str],
                 stop: Callable[[], bool] | None = None, what: str = "reading the samples") -> LabeledImages:
    """Decode the normalized blobs of ``samples`` into memory; labels index ``classes``.

    Raises:
        ValueError: a sample has no label (unlabelled samples are never trained or judged on as labelled).
        Stopped: ``stop()`` said so (:func:`decode_samples`; ``what`` names the phase).
    """
    classes = tuple(classes)
    unlabeled = [s.sha256[:12] for s in samples if s.label is None]
    if unlabeled:
        raise ValueError(f"{len(unlabeled)} unlabelled samples ({', '.join(unlabeled[:3])}) among labelled ones: "
                         "an unlabelled sample enters training or the held-out evaluation only with a label")
    if not samples:
        return LabeledImages(torch.zeros(0, 3, 1, 1, dtype=torch.uint8), torch.zeros(0, dtype=torch.long), classes)
    images = decode_samples(samples, blobs, stop, what)
    labels = torch.tensor([classes.index(s.label) for s in samples], dtype=torch.long)
    return LabeledImages(images, labels, classes)


def load_unlabeled(store: Store, blobs: BlobStore, job: Job, newest: int,
                   stop: Callable[[], bool] | None = None) -> torch.Tensor | None:
    """The normalized images of the ``newest`` latest unlabelled samples up to the job's data (None: none).

    A job resumed after a crash reads them again: one labelled or removed since is no longer among them.

    Raises:
        Stopped: ``stop()`` said so (:func:`decode_samples`).
    """
    samples = store.unlabeled_samples(upto_batch=job.data_batch_id)[-newest:] if newest > 0 else []
    if not samples:
        return None
    return decode_samples(samples, blobs, stop, "reading the job's unlabelled samples")


def decode_samples(samples: Sequence[Sample], blobs: BlobStore, stop: Callable[[], bool] | None = None,
                   what: str = "reading the samples") -> torch.Tensor:
    """The normalized images of ``samples`` (their blobs), decoded and stacked: (N, 3, H, W) uint8.

    Raises:
        Stopped: ``stop()``, asked before every :data:`DECODE_CHUNK` samples, said so (``what``: the phase).
    """
    images = []
    for i, s in enumerate(samples):
        if stop is not None and i % DECODE_CHUNK == 0 and stop():
            raise Stopped(what)
        images.append(decode_image(blobs.path(s.sha256)))
    return torch.stack(images)


def recipe(config: DaemonConfig, init: Path | None) -> RunConfig:
    """The trainer's recipe for one job: the daemon's training section as it is (the same dataclasses),
    with what only the daemon knows: the model to start from, the image size and its augmentation."""
    t = config.training
    return RunConfig(
        model=replace(t.model, init=str(init) if init else None),
        data=DataConfig(size=config.image_size, val_fraction=0.1),
        augment=AugmentConfig(pad=max(1, config.image_size // 16), flip=0.0, cutout=0),
        optim=t.optim, train=t.train, memory=t.memory,
        continual=t.continual if init else replace(t.continual, distill=0.0),
        semi=t.semi, device=t.device,
    )


def job_dir(config: DaemonConfig, job: Job) -> Path:
    return config.layout.job_dir(job.id)


def set_running(store: Store, config: DaemonConfig, job: Job) -> Job:
    """``job`` set running in ``store``, with its folder as the store records it: relative to the data directory,
    which may move."""
    return store.set_job_state(job.id, JobState.RUNNING,
                               checkpoint_dir=str(job_dir(config, job).relative_to(config.layout.root)))


def job_data(store: Store, blobs: BlobStore, job: Job, base_batch: int, known: Sequence[str] = (),
             minimum: int = 1, stop: Callable[[], bool] | None = None
             ) -> tuple[LabeledImages, LabeledImages, dict[str, int]]:
    """(training samples, held-out samples, held-back labels) up to the job's data.

    The training samples are those new since ``base_batch`` plus, for a label the model in service does
    not know (``known``: its classes), every earlier one: a label held back by earlier jobs brings all
    its samples once it has ``minimum``. Held-back labels (:func:`held_back`) are left out of both.

    Raises:
        Stopped: ``stop()`` said so while the samples were decoded.
    """
    classes = store.labels()
    waiting = held_back(store, job.data_batch_id, minimum)
    known = set(known)
    train = [s for s in store.samples(Split.TRAIN, upto_batch=job.data_batch_id)
             if s.label not in waiting and (s.batch_id > base_batch or s.label not in known)]
    held = [s for s in store.samples(Split.HELDOUT, upto_batch=job.data_batch_id) if s.label not in waiting]
    what = "reading the job's samples"
    return load_samples(train, blobs, classes, stop, what), load_samples(held, blobs, classes, stop, what), waiting


def run_job(config: DaemonConfig, store: Store, blobs: BlobStore, job: Job, current: Path | None,
            base_batch: int, stop: Callable[[], bool],
            report: Callable[[Progress], None] | None = None) -> JobOutcome:
    """Train (or resume) ``job``'s candidate from ``current`` (a version directory, or None).

    Args:
        base_batch: the last ingest batch the current version was trained on (0: none).
        stop: polled while the samples are decoded, after every training step and between the batches of an
            evaluation; the job checkpoints (once it has trained a step) and returns ``"stopped"``.
        report: called with the trainer's progress reports (each epoch's end, and every
            ``training.train.progress_seconds`` within one); the latest is also in ``progress.json`` in the
            job's folder, which ``status`` reads.
    """
    from edgerev.train.trainer import train

    out = job_dir(config, job)
    known = model_classes(current) if current is not None else ()
    try:
        train_new, held, waiting = job_data(store, blobs, job, base_batch, known,
                                            config.training.min_samples_per_label, stop)
    except Stopped as e:
        return JobOutcome("stopped", out, f"stopped in {e}")
    if len(train_new) == 0:
        why = "no new training sample (every new sample is held out" + (", or held back)" if waiting else ")")
        return JobOutcome("skipped", out, why, held_back=waiting)
    present = train_new.present() if current is None else ()
    if current is None and len(present) < 2:
        return JobOutcome("skipped", out, f"a first model needs two labels with at least "
                          f"{config.training.min_samples_per_label} training samples each, the store has "
                          f"{list(present)}" + (f" (held back: {listed(waiting)})" if waiting else ""),
                          held_back=waiting)
    val = held if len(held) else None
    resume = has_checkpoint(out)
    if not resume and out.exists():
        shutil.rmtree(out)  # killed before its first checkpoint: start the job again
    cfg = recipe(config, current)
    if val is not None and current is not None:
        # the held-out samples of labels the candidate will know; a label seen only in held-out is left out
        known = tuple(dict.fromkeys([*known, *train_new.present()]))
        val = val.restrict([c for c in val.classes if c in known])
    elif val is not None:
        val = val.restrict(train_new.present())
    if val is None or len(val) == 0:
        val = None  # the trainer holds out data.val_fraction of the training samples
        if cfg.train.patience is not None and len(train_new.held_out(cfg.data.val_fraction)[1]) == 0:
            # too few samples to hold any out (the trainer's own split): no plateau to see, the maximum runs
            cfg = replace(cfg, train=replace(cfg.train, patience=None))
    try:
        unlabeled = load_unlabeled(store, blobs, job, config.training.max_unlabeled, stop) if cfg.semi.enabled else None
    except Stopped as e:
        return JobOutcome("stopped", out, f"stopped in {e}", held_back=waiting)
    source = (f"the daemon's store, job {job.id}: training samples of ingest batches {base_batch + 1}-"
              f"{job.data_batch_id} (and earlier ones of labels new to the model in service), held-out samples "
              f"up to batch {job.data_batch_id}"
              + (f"; {len(unlabeled)} unlabelled samples (the newest up to that batch)" if unlabeled is not None
                 else ""))
    result = train(None if resume else cfg, out, resume=resume, stop=stop, progress=False, report=report,
                   data=(train_new, val), source=source, unlabeled=unlabeled)
    if result.status == "stopped":
        where = result.summary.get("stopped_in")
        return JobOutcome("stopped", out, f"stopped in {where}" if where else
                          f"stopped at step {result.step} of {result.total_steps}",
                          held_back=waiting)
    return JobOutcome("trained", out, "", result.summary, waiting)


def check_training(config: DaemonConfig) -> None:
    """Refuse, at start, a model that cannot take ``image_size``, or a memory cap too small to train it.

    The floor is the trainer's own accounting of a job's step (:func:`edgerev.train.memory.floor`):
    batch 1 in the least-memory plan, with the recipe's whole batch, the optimizer's momentum and, when
    distilling, the teacher and its logits (a job after the first has one), with ``training.semi``, the
    strong views of ``ratio`` unlabelled images per labelled one and their weak views' forward, exact on fake
    tensors.

    Raises:
        ConfigError: the model cannot take the image size, or ``training.memory.budget`` is below
            that floor (the message names it).
    """
    import copy

    from edgerev.config import ConfigError
    from edgerev.models.resolve import resolve_model
    from edgerev.models.spec import check_size
    from edgerev.train.memory import floor

    t = config.training
    try:
        handle = resolve_model(t.model.arch, weights=t.model.weights, args=t.model.args, num_classes=2,
                               trust_factories=t.model.factories)
        check_size(handle, config.image_size)
        model = handle.module
    except ValueError as e:
        raise ConfigError(f"training: {e} (image_size {config.image_size})") from None
    budget = t.memory.budget
    if budget is None:
        return
    cfg = recipe(config, None)
    teacher = copy.deepcopy(model) if t.continual.distill > 0 else None  # every job after the first distills
    if teacher is not None:
        cfg = replace(cfg, continual=t.continual)
    unlabeled = cfg.semi.ratio * cfg.train.batch if cfg.semi.enabled and t.max_unlabeled > 0 else 0
    smallest = floor(cfg, model, teacher, unlabeled=unlabeled, budget=budget).total
    if budget < smallest:
        raise ConfigError(f"training.memory.budget: {budget:,} bytes is too small to train {t.model.arch} at "
                          f"{config.image_size}x{config.image_size}; the smallest budget that fits is "
                          f"{smallest:,} bytes")
