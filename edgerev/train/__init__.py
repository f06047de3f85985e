"""Training: data, augmentation, the recipe, the trainer, checkpoints, continual learning."""

from edgerev.train.augment import Augment, cutout, pad_crop, random_flip
from edgerev.train.checkpoint import CheckpointError, ModelInfo, load_model, save_model
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
