"""Training: data, augmentation, the recipe, the trainer, checkpoints, continual learning.

The names below load on first use, so importing a light module of this package (the recipe,
:mod:`edgerev.train.config`, which the daemon's config embeds) never imports torch: ``edgerev daemon
status`` and ``check`` stay light.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from edgerev.lazy import lazy_attributes

_LAZY = {
    **dict.fromkeys(("Augment", "cutout", "pad_crop", "random_flip"), "edgerev.train.augment"),
    **dict.fromkeys(("CheckpointError", "ModelInfo", "load_model", "save_model"), "edgerev.models.directory"),
    **dict.fromkeys(("RunConfig", "load_config"), "edgerev.train.config"),
    **dict.fromkeys(("CIFAR10Binary", "DataError", "ImageFolder", "SyntheticImages"), "edgerev.train.data"),
    "evaluate": "edgerev.train.evaluate",
    **dict.fromkeys(("LabeledImages", "load_source"), "edgerev.train.labeled"),
    **dict.fromkeys(("RunError", "RunResult", "train"), "edgerev.train.trainer"),
}

if TYPE_CHECKING:
    from edgerev.models.directory import CheckpointError, ModelInfo, load_model, save_model
    from edgerev.train.augment import Augment, cutout, pad_crop, random_flip
    from edgerev.train.config import RunConfig, load_config
    from edgerev.train.data import CIFAR10Binary, DataError, ImageFolder, SyntheticImages
    from edgerev.train.evaluate import evaluate
    from edgerev.train.labeled import LabeledImages, load_source
    from edgerev.train.trainer import RunError, RunResult, train

__all__ = [
    "Augment", "CIFAR10Binary", "CheckpointError", "DataError", "ImageFolder", "LabeledImages", "ModelInfo",
    "RunConfig", "RunError", "RunResult", "SyntheticImages", "cutout", "evaluate", "load_config", "load_model",
    "load_source", "pad_crop", "random_flip", "save_model", "train",
]

__getattr__, __dir__ = lazy_attributes("edgerev.train", _LAZY, globals())
