"""The daemon's configuration: a YAML file read into frozen dataclasses.

Every key but ``data_dir`` is optional. An unknown key or a wrong type is one error that names the
key's path and the type it expects (``training.epochs: expected int, got str 'ten'``); values out of
range are caught in each section's ``__post_init__``. Relative paths in a file are taken relative to
the file's folder, so a unit file can start the daemon from anywhere.

Start-up order (each step raises before the next touches anything)::

    config = load_config(path)   # keys, types, ranges
    validate_paths(config)       # inbox is a folder, data directory writable: nothing is created
    check_training(config)       # the model takes image_size; training.memory.budget is above the floor
    lock = DataDirLock(config.layout.root).acquire()
    prepare(config.layout, config.inbox_path)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from edgerev.config import ConfigError, byte_size, check, from_dict, load_yaml, merged
from edgerev.sizes import ByteSize, parse_bytes
from edgerev.train.config import ContinualConfig, MemoryConfig, ModelConfig, OptimConfig, SemiConfig, TrainConfig
from edgerev_daemon.layout import Layout

SUPPORTED_EXTENSIONS = (".png", ".jpg", ".jpeg")
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1")


@dataclass(frozen=True)
class LimitsConfig:
    """What an inbox file may be before it is decoded.

    ``max_file_size``: bytes, or a size such as ``"50MiB"`` (read once into an int). ``max_pixels``: width
    times height, read from the file's header before any pixel is decoded (a decompression bomb is refused
    there; Pillow's own hard limit of about 179 M pixels applies on top). ``extensions``: accepted endings,
    a subset of ``.png``, ``.jpg``, ``.jpeg``.
    """

    max_file_size: ByteSize = parse_bytes("50MiB")
    max_pixels: int = 50_000_000
    extensions: tuple[str, ...] = SUPPORTED_EXTENSIONS

    def __post_init__(self) -> None:
        object.__setattr__(self, "max_file_size", byte_size(self.max_file_size, "max_file_size"))
        check(self.max_pixels >= 1, "max_pixels", f"must be at least 1, got {self.max_pixels}")
        exts = tuple(e.lower() if e.startswith(".") else "." + e.lower() for e in self.extensions)
        check(len(exts) > 0, "extensions", "must name at least one extension")
        for e in exts:
            check(e in SUPPORTED_EXTENSIONS, "extensions", f"{e!r} is not supported; choose from "
                  f"{', '.join(SUPPORTED_EXTENSIONS)}")
        object.__setattr__(self, "extensions", exts)


@dataclass(frozen=True)
class IngestConfig:
    """``batch_files``: files recorded per database transaction. ``settle_seconds``: a file is ingested
    once its size and modification time stayed the same across scans this many seconds apart by the
    daemon's clock (it may still be being copied; its times are not trusted); 0: at once."""

    batch_files: int = 256
    settle_seconds: float = 2.0

    def __post_init__(self) -> None:
        check(self.batch_files >= 1, "batch_files", f"must be at least 1, got {self.batch_files}")
        check(self.settle_seconds >= 0, "settle_seconds", f"must be >= 0, got {self.settle_seconds}")


@dataclass(frozen=True)
class ScheduleConfig:
    """A fine-tuning job starts when ``min_new_samples`` samples arrived since the last job, or when
    ``max_interval_seconds`` passed since it and at least one new sample arrived, or (``new_classes``)
    as soon as a label the model in service does not know has ``training.min_samples_per_label``
    training samples and ``promotion.min_heldout_per_class`` held-out ones (enough to be learned and
    judged). After a failed job (a full disk, say) the next waits ``retry_seconds``, so a lasting fault
    does not retrain in a loop."""

    min_new_samples: int = 200
    max_interval_seconds: float = 24 * 3600.0
    retry_seconds: float = 600.0
    new_classes: bool = True

    def __post_init__(self) -> None:
        check(self.min_new_samples >= 1, "min_new_samples", f"must be at least 1, got {self.min_new_samples}")
        check(self.max_interval_seconds > 0, "max_interval_seconds",
              f"must be positive, got {self.max_interval_seconds}")
        check(self.retry_seconds >= 0, "retry_seconds", f"must be >= 0, got {self.retry_seconds}")


# What a daemon job trains with when its config says nothing: smaller and shorter than the trainer's
# recipe (a job fine-tunes on what arrived since the last one). Merged under the file's values, key by
# key, so ``training: {train: {epochs: 5}}`` keeps the daemon's batch.
TRAINING_DEFAULTS = {
    "train": {"epochs": 3, "batch": 64, "checkpoint_every": 20, "log_every": 10},
    "optim": {"lr": 0.05},
    "continual": {"replay": 2000, "distill": 1.0},
    "semi": {"enabled": True},
}


@dataclass(frozen=True)
class TrainingConfig:
    """One fine-tuning job: the trainer's own recipe sections (``edgerev.train.config``), same keys.

    ``model``: ``arch`` and ``args`` (``init`` is the daemon's: the current version). ``train``,
    ``optim``, ``continual``: as in a recipe (the daemon's defaults in :data:`TRAINING_DEFAULTS`). ``semi``:
    learning from the store's unlabelled images (FixMatch, on by default: it does nothing while none exists),
    at most the ``max_unlabeled`` newest of them per job; pseudo-labels stay inside a job's steps, never in
    its held-out evaluation or the promotion gate.
    ``memory``: ``budget``, the hard cap on a job's training memory (bytes or ``"400MiB"``, read once
    into an int; null: none), and the planner's ``mode`` and ``profile``. ``device``: where jobs train.
    The data, its size (``image_size``) and augmentation are the daemon's. ``min_samples_per_label``: a
    label with fewer training samples is held back (not trained as a class, not judged) and reported
    until enough arrive.
    """

    model: ModelConfig = field(default_factory=ModelConfig)
    train: TrainConfig = field(default_factory=lambda: TrainConfig(**TRAINING_DEFAULTS["train"]))
    optim: OptimConfig = field(default_factory=lambda: OptimConfig(**TRAINING_DEFAULTS["optim"]))
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    continual: ContinualConfig = field(default_factory=lambda: ContinualConfig(**TRAINING_DEFAULTS["continual"]))
    semi: SemiConfig = field(default_factory=lambda: SemiConfig(**TRAINING_DEFAULTS["semi"]))
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    min_samples_per_label: int = 5
    max_unlabeled: int = 5000

    def __post_init__(self) -> None:
        check(self.model.init is None, "model.init", "is the daemon's (the current version); leave it out")
        check(self.min_samples_per_label >= 1, "min_samples_per_label",
              f"must be at least 1, got {self.min_samples_per_label}")
        check(self.max_unlabeled >= 0, "max_unlabeled", f"must be >= 0 (0: none), got {self.max_unlabeled}")


@dataclass(frozen=True)
class PromotionConfig:
    """The promotion gate (:mod:`edgerev_daemon.learning.promote`): it decides on paired held-out outcomes.

    ``alpha``: the p-value at or below which the gate believes a difference: the candidate is promoted
    when it is better on the recent held-out samples with a one-sided exact McNemar p-value at most
    ``alpha``, and refused when it is worse on the old classes beyond ``forgetting_margin`` with a p-value
    at most ``alpha``. ``forgetting_margin``: the loss of accuracy on the old classes (a fraction) a
    candidate may have, e.g. for learning new ones; a loss is refused only once the evidence says it
    exceeds the margin. ``recent_window_days``: each class is judged on its held-out samples that
    arrived within this many days before its newest one (null: all of them). ``refuse_class_at_zero``:
    refuse a candidate that gets none of a known class's recent held-out samples right, when the class
    has at least ``min_heldout_per_class`` of them. ``keep_last``: version directories kept on disk.
    ``exporter``: torch's ONNX exporter for a promoted candidate, as ``edgerev export --exporter`` takes it:
    ``auto`` (the default: ``torch.export``'s from torch 2.7 on, falling back to the TorchScript one where it
    fails), ``dynamo``, or ``legacy``: the TorchScript exporter, which PyTorch has deprecated, and much faster
    (a fraction of a second against seconds for the CPU preset's model on one CPU thread). Either file is checked
    against PyTorch with ONNX Runtime before it is written; the version's metrics name the exporter."""

    alpha: float = 0.05
    forgetting_margin: float = 0.02
    recent_window_days: float | None = 30.0
    keep_last: int = 5
    refuse_class_at_zero: bool = True
    min_heldout_per_class: int = 5
    exporter: Literal["auto", "dynamo", "legacy"] = "auto"

    def __post_init__(self) -> None:
        check(0.0 < self.alpha <= 0.5, "alpha", f"is a p-value threshold in (0, 0.5], got {self.alpha}")
        check(0.0 <= self.forgetting_margin <= 1.0, "forgetting_margin",
              f"is a fraction of accuracy in [0, 1] (1: never refuse for a loss), got {self.forgetting_margin}")
        check(self.recent_window_days is None or self.recent_window_days > 0, "recent_window_days",
              f"must be positive (or null: all held-out samples), got {self.recent_window_days}")
        check(self.keep_last >= 1, "keep_last", f"must be at least 1, got {self.keep_last}")
        check(self.min_heldout_per_class >= 1, "min_heldout_per_class",
              f"must be at least 1, got {self.min_heldout_per_class}")


# promotion keys of an earlier edgerev, and why each went
REMOVED_PROMOTION_KEYS = {
    "tolerance": "the gate decides on paired evidence now, not on a fixed margin of point estimates; see "
                 "promotion.alpha and promotion.forgetting_margin (a loss on the old classes is refused only "
                 "once the evidence says it exceeds the margin); remove the key",
}


@dataclass(frozen=True)
class StorageConfig:
    """How much of the disk the daemon keeps, and what goes when that is reached
    (:mod:`edgerev_daemon.storage.retention`).

    ``min_free_space``: below this much free space on the data directory's file system (bytes, or a
    size such as ``"200MiB"``; 0: no floor) the daemon stops ingesting and training, keeps serving
    status, and resumes by itself once space returns: the guard for a disk shared with others, so that
    SQLite, the journal and a promotion can finish what they started.

    ``max_bytes``: the budget for everything the daemon keeps in its data directory (blobs, store,
    journal, versions, a job's checkpoints, quarantine); null: no budget. ``max_samples``: an optional
    bound on the number of samples kept (null: none). ``target``: the share of each bound the retention
    policy keeps the data directory under: above it at a cycle's check, samples are removed until it is
    5 points below. Ingest checks ``max_bytes`` before every file and stops once the data directory
    passes ``target`` of it: the files it took are recorded, the rest wait in the inbox, untouched, for
    the next cycle, whose removal makes room first. A burst takes the data directory no further than
    the target, and each later cycle takes it back there. The rest of the budget is headroom for what
    ingest overshoots by (the file that passed the target, and what one batch's rows add beyond their
    estimate), a job's checkpoints and the version it writes, and a removal's journal lines.
    ``max_samples`` is checked at a cycle's start only: that cycle's ingest may take the count past it,
    until the next. Above a bound itself (a job reads the samples, or only protected samples remain),
    ingest waits until the policy brings it under. ``max_quarantine_bytes``: quarantine's own bound
    (the oldest rejected files go first; part of ``max_bytes`` too). ``keep_newest_per_class``: samples
    of each class and split that are never removed, the newest ones. ``reservoir``: the share of
    samples (chosen by their hash, so spread evenly over a class's history) that outlive the others: a
    class's older samples go oldest first, those in the reservoir last."""

    min_free_space: ByteSize | Literal[0, "0"] = parse_bytes("100MiB")  # kept as a ByteSize, or 0: no floor
    max_bytes: ByteSize | None = None
    max_samples: int | None = None
    max_quarantine_bytes: ByteSize = parse_bytes("64MiB")
    target: float = 0.9
    keep_newest_per_class: int = 20
    reservoir: float = 0.5

    def __post_init__(self) -> None:
        # sizes given in code are read here, once (from_dict has read a file's); 0 stays 0: no floor
        floor = 0 if self.min_free_space in (0, "0") else byte_size(self.min_free_space, "min_free_space")
        object.__setattr__(self, "min_free_space", floor)
        if self.max_bytes is not None:
            object.__setattr__(self, "max_bytes", byte_size(self.max_bytes, "max_bytes"))
        check(self.max_samples is None or self.max_samples >= 1, "max_samples",
              f"must be at least 1 (or null: no bound), got {self.max_samples}")
        object.__setattr__(self, "max_quarantine_bytes", byte_size(self.max_quarantine_bytes, "max_quarantine_bytes"))
        check(0.5 <= self.target < 1.0, "target",
              f"is the share of each bound the retention policy keeps use under, in [0.5, 1), got {self.target}")
        check(self.keep_newest_per_class >= 1, "keep_newest_per_class",
              f"must be at least 1 (every class stays represented), got {self.keep_newest_per_class}")
        check(0.0 <= self.reservoir <= 1.0, "reservoir", f"is a share in [0, 1], got {self.reservoir}")
        if self.max_bytes is not None:
            check(self.max_quarantine_bytes < self.max_bytes, "max_quarantine_bytes",
                  f"({self.max_quarantine_bytes} bytes) must be below storage.max_bytes ({self.max_bytes} bytes)")


@dataclass(frozen=True)
class EventsConfig:
    """The event log is bounded whatever happens: events older than ``keep_days`` and all but the
    latest ``keep_count`` are pruned at every cycle; a fault that lasts is one event with a repeat count."""

    keep_days: float = 90.0
    keep_count: int = 20_000

    def __post_init__(self) -> None:
        check(self.keep_days > 0, "keep_days", f"must be positive, got {self.keep_days}")
        check(self.keep_count >= 100, "keep_count", f"must be at least 100, got {self.keep_count}")


@dataclass(frozen=True)
class HttpConfig:
    """The optional read-only status page; off unless ``enabled``, and never off the loopback."""

    enabled: bool = False
    host: str = "127.0.0.1"
    port: int = 9745

    def __post_init__(self) -> None:
        check(self.host in LOOPBACK_HOSTS, "host",
              f"must be a loopback address ({', '.join(LOOPBACK_HOSTS)}), got {self.host!r}")
        check(1 <= self.port <= 65535, "port", f"must lie in 1..65535, got {self.port}")


@dataclass(frozen=True)
class QuestionsConfig:
    """The label questions (:mod:`edgerev_daemon.learning.questions`): after each job the version in service
    scores the newest ``max_scored`` unlabelled samples (the bound on the time a refresh takes) and asks about
    ``count`` of them, picked for spread among the ``pool`` x ``count`` it is least sure of."""

    count: int = 20
    max_scored: int = 2000
    pool: int = 4

    def __post_init__(self) -> None:
        check(1 <= self.count <= 1000, "count", f"must lie in 1..1000, got {self.count}")
        check(self.max_scored >= self.count, "max_scored",
              f"must be at least count ({self.count}), got {self.max_scored}")
        check(1 <= self.pool <= 100, "pool", f"must lie in 1..100, got {self.pool}")


DEFAULT_IMAGE_SIZE = 32  # a daemon's image size when neither its config nor its model names one


@dataclass(frozen=True)
class DaemonConfig:
    """The whole daemon.

    ``data_dir``: everything the daemon writes (see :mod:`edgerev_daemon.layout`). ``inbox``: where
    images are dropped (default ``data_dir/inbox``). ``image_size``: the model's input; every stored
    image is normalized to it once, at ingest (null: the size ``training.model.arch`` carries, a model
    directory's or an ONNX file's fixed input, else 32). ``heldout_fraction``: share of samples held out for
    evaluation, chosen by each sample's hash (see :func:`edgerev_daemon.storage.store.split_of`).
    """

    data_dir: str
    inbox: str | None = None
    image_size: int | None = None
    heldout_fraction: float = 0.1
    limits: LimitsConfig = field(default_factory=LimitsConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    promotion: PromotionConfig = field(default_factory=PromotionConfig)
    http: HttpConfig = field(default_factory=HttpConfig)
    questions: QuestionsConfig = field(default_factory=QuestionsConfig)
    storage: StorageConfig = field(default_factory=StorageConfig)
    events: EventsConfig = field(default_factory=EventsConfig)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    def __post_init__(self) -> None:
        check(self.data_dir.strip() != "", "data_dir", "must name a directory")
        check(self.inbox is None or self.inbox.strip() != "", "inbox", "must name a directory (or be left out)")
        if self.image_size is None:  # frozen: set once, here, from the base model where it carries a size
            from edgerev.models.carried import carried_image_size

            object.__setattr__(self, "image_size", carried_image_size(self.training.model.arch) or DEFAULT_IMAGE_SIZE)
        check(4 <= self.image_size <= 1024, "image_size", f"must lie in 4..1024, got {self.image_size}")
        check(0.0 < self.heldout_fraction < 1.0, "heldout_fraction",
              f"must lie strictly between 0 and 1, got {self.heldout_fraction}")

    @property
    def layout(self) -> Layout:
        return Layout(Path(self.data_dir))

    @property
    def inbox_path(self) -> Path:
        return Path(self.inbox) if self.inbox is not None else self.layout.default_inbox


# the flat keys of the ``training:`` section before it embedded the trainer's recipe, and where each went
MOVED_TRAINING_KEYS = {"arch": "model.arch", "model_args": "model.args", "epochs": "train.epochs",
                       "batch": "train.batch", "lr": "optim.lr", "clip_grad_norm": "optim.clip_grad_norm",
                       "replay": "continual.replay", "distill": "continual.distill",
                       "temperature": "continual.temperature", "memory_budget": "memory.budget"}


def config_from_dict(data: dict, base: str | Path | None = None) -> DaemonConfig:
    """Validate ``data`` (a parsed YAML mapping); relative paths are taken relative to ``base``."""
    if isinstance(data, dict) and isinstance(data.get("training", {}), dict):
        moved = [k for k in (data.get("training") or {}) if k in MOVED_TRAINING_KEYS]
        if moved:  # a config written for an earlier edgerev: say where each key went
            raise ConfigError("; ".join(f"training.{k} is now training.{MOVED_TRAINING_KEYS[k]}" for k in moved)
                              + " (the training section takes the trainer's recipe sections; see configs/daemon/)")
        data = {**data, "training": merged(TRAINING_DEFAULTS, data.get("training") or {})}
    if isinstance(data, dict) and isinstance(data.get("promotion"), dict):
        gone = [k for k in data["promotion"] if k in REMOVED_PROMOTION_KEYS]
        if gone:  # a config written for an earlier edgerev: say why the key went and what replaces it
            raise ConfigError("; ".join(f"promotion.{k}: removed: {REMOVED_PROMOTION_KEYS[k]}" for k in gone))
    cfg = from_dict(DaemonConfig, data)
    base = Path(base) if base is not None else Path.cwd()

    def absolute(p: str) -> str:
        path = Path(p).expanduser()
        return str(path if path.is_absolute() else (base / path).absolute())

    return replace(cfg, data_dir=absolute(cfg.data_dir), inbox=None if cfg.inbox is None else absolute(cfg.inbox))


def load_config(path: str | Path) -> DaemonConfig:
    """Read and validate a daemon config file (``yaml.safe_load``)."""
    path = Path(path)
    return config_from_dict(load_yaml(path), base=path.absolute().parent)


def _nearest_existing(path: Path) -> Path:
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_write(folder: Path, key: str, what: str) -> None:
    """Create and remove a file in ``folder``: the only test of write access that root, ACLs,
    read-only mounts and sandboxes (systemd's ``ProtectSystem``) all answer truthfully."""
    try:
        fd, name = tempfile.mkstemp(prefix=".edgerev-probe-", dir=folder)
    except OSError as e:
        raise ConfigError(f"{key}: cannot write in {what} {folder} ({e.strerror or e})") from None
    os.close(fd)
    os.unlink(name)


def _writable_dir(path: Path, key: str) -> None:
    """``path`` is a writable folder, or does not exist yet and can be created."""
    if path.exists():
        check(path.is_dir(), key, f"{path} exists and is not a directory")
        _probe_write(path, key, "directory")
        return
    parent = _nearest_existing(path.parent)
    check(parent.is_dir(), key, f"cannot create {path}: {parent} is not a directory")
    _probe_write(parent, key, f"{path}'s nearest existing parent")


def _inside(child: Path, parent: Path) -> bool:
    return child == parent or parent in child.parents


def validate_paths(config: DaemonConfig) -> None:
    """Check the data directory and the inbox before anything is created, locked or written.

    Raises:
        ConfigError: the inbox exists and is not a directory; the data directory (or the folder it
            would be created in) is not writable; the inbox and the data directory overlap in a way
            that would make the daemon ingest its own files.
    """
    layout = config.layout
    root = layout.root.resolve()
    inbox = config.inbox_path.resolve()
    _writable_dir(layout.root, "data_dir")
    for d in layout.managed_dirs():
        check(not d.exists() or d.is_dir(), "data_dir", f"{d} exists and is not a directory")
    if config.inbox_path.exists():
        check(config.inbox_path.is_dir(), "inbox", f"{config.inbox_path} exists and is not a directory")
    check(inbox != root, "inbox", f"must not be the data directory itself ({root})")
    check(not _inside(root, inbox), "inbox", f"{inbox} contains the data directory {root}")
    for d in layout.managed_dirs():
        check(not _inside(inbox, d.resolve()), "inbox", f"{inbox} lies inside the daemon's own {d}")
    # files are removed from the inbox once stored: it must be writable too
    _writable_dir(config.inbox_path, "inbox")
