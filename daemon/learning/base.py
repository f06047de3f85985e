"""A daemon that starts from a base model: the owner's pretrained model becomes version ``v0001``.

``training.model`` names a *base model* when it brings trained weights: a model directory, an ONNX file, or a
registry name or factory with ``weights`` (:mod:`edgerev.models.resolve`). When that model also names its
classes (a model directory does; an ONNX file does when its metadata or sidecar lists them), the daemon
installs it, before its first job, as version ``v0001``: exported and verified like every version,
``current`` switched to it, so the device predicts with the owner's model from the start. Each job then
fine-tunes the current version as always (new labels grow its head, its own rows kept), the gate judges
every candidate against it on the held-out samples once there are some, and it is never pruned: the
rollback target of last resort.

A base model without class names cannot be a version (its outputs name nothing the store knows): the first
job starts from its weights instead, its classifier re-made for the store's labels, and is judged like any
first model.

Crash safety: the version is recorded in the store (``metrics.base``) before its directory is written,
and installing is idempotent: a start that finds a base version recorded but not promoted writes it
again and promotes it, as a promotion interrupted after its decision is carried out at the next start.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from edgerev_daemon.config import DaemonConfig, TrainingConfig

if TYPE_CHECKING:
    from edgerev.models.handle import ModelHandle


def names_base(t: TrainingConfig) -> bool:
    """Whether ``training.model`` brings trained weights (a model directory, an ONNX file, or ``weights``)."""
    from edgerev.models.names import SourceKind, source_kind

    return source_kind(t.model.arch) in (SourceKind.DIRECTORY, SourceKind.ONNX) or t.model.weights is not None


def base_classes(model: ModelHandle) -> tuple[str, ...]:
    """The class names a base model carries, in output order (a model directory's; an ONNX file's metadata or
    sidecar), or ``()``."""
    return model.classes


def write_base(config: DaemonConfig, out: Path) -> tuple[str, ...]:
    """Write the base model as a model directory in ``out``; returns its classes (``()``: it has none, and
    nothing is written).

    Its normalization is the one it carries (a model directory's, an ONNX file's metadata), else the
    trainer's default; its input size is the daemon's ``image_size`` (the start check refused a model that
    cannot take it).
    """
    from edgerev.models.directory import ModelInfo, read_info, save_model
    from edgerev.models.resolve import resolve_model
    from edgerev.models.spec import model_spec

    t = config.training
    model = resolve_model(t.model.arch, weights=t.model.weights, args=t.model.args, trust_factories=t.model.factories)
    classes = base_classes(model)
    spec = model_spec(model)
    if not classes or len(classes) != spec.num_classes:
        return ()
    extra = {}
    if spec.mean is not None and spec.std is not None and len(spec.mean) == spec.in_channels:
        extra = {"mean": spec.mean, "std": spec.std}
    elif Path(t.model.arch).expanduser().is_dir():
        saved = read_info(Path(t.model.arch).expanduser())[0]
        extra = {"mean": saved.mean, "std": saved.std}
    info = ModelInfo(model.arch, classes, config.image_size, model_args=dict(model.args), **extra)
    if out.exists():
        shutil.rmtree(out)
    model.module.cpu().eval()
    save_model(out, model, info, {"base": t.model.arch})
    return classes
