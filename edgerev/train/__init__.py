"""Training: data sources and augmentation (the trainer, continual learning and export build on them)."""

from edgerev.train.augment import Augment, cutout, pad_crop, random_flip
from edgerev.train.data import CIFAR10Binary, ImageFolder, SyntheticImages

__all__ = ["Augment", "CIFAR10Binary", "ImageFolder", "SyntheticImages", "cutout", "pad_crop", "random_flip"]
