"""Labelled images held in memory as one ``uint8`` tensor: what the trainer iterates over.

A device's data set is small enough to keep decoded (50 000 CIFAR images are 150 MB as ``uint8``);
holding it as one tensor makes batches a single index, epochs a permutation, and replay and
class remapping plain tensor operations.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from edgerev.train.data import CIFAR10Binary, DataError, ImageFolder, SyntheticImages


@dataclass(frozen=True)
class LabeledImages:
    """``images``: ``uint8 [N, 3, S, S]``; ``labels``: ``int64 [N]`` indexing ``classes``."""

    images: Tensor
    labels: Tensor
    classes: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.images.dtype != torch.uint8 or self.images.dim() != 4:
            raise DataError(f"images must be uint8 [N, C, H, W], got {self.images.dtype} {tuple(self.images.shape)}")
        if len(self.labels) != len(self.images):
            raise DataError(f"{len(self.images)} images but {len(self.labels)} labels")
        if len(self.labels) and (int(self.labels.min()) < 0 or int(self.labels.max()) >= len(self.classes)):
            raise DataError(f"labels must lie in 0..{len(self.classes) - 1}")

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def size(self) -> int:
        return self.images.shape[-1]

    def subset(self, idx: Tensor | Sequence[int]) -> LabeledImages:
        idx = torch.as_tensor(idx, dtype=torch.long)
        return LabeledImages(self.images[idx], self.labels[idx], self.classes)

    def present(self) -> tuple[str, ...]:
        """Names of the classes that have at least one sample, in class order."""
        counts = torch.bincount(self.labels, minlength=len(self.classes))
        return tuple(c for c, n in zip(self.classes, counts.tolist()) if n > 0)

    def relabel(self, classes: Sequence[str]) -> LabeledImages:
        """The same samples with labels indexing ``classes`` (which must name every class present)."""
        classes = tuple(classes)
        missing = [c for c in self.present() if c not in classes]
        if missing:
            raise DataError(f"classes {missing} are not among {list(classes)}")
        table = torch.tensor([classes.index(c) if c in classes else -1 for c in self.classes], dtype=torch.long)
        return LabeledImages(self.images, table[self.labels], classes)

    def restrict(self, classes: Sequence[str]) -> LabeledImages:
        """Only the samples of ``classes``, relabelled to index them."""
        keep = torch.tensor([c in set(classes) for c in self.classes], dtype=torch.bool)
        if len(self.labels) == 0:
            return LabeledImages(self.images, self.labels, tuple(classes))
        return self.subset(torch.nonzero(keep[self.labels]).flatten()).relabel(classes)

    def resized(self, size: int) -> LabeledImages:
        if self.size == size and self.images.shape[-2] == size:
            return self
        x = F.interpolate(self.images.float(), size=(size, size), mode="bilinear", align_corners=False,
                          antialias=True)
        return LabeledImages(x.round().clamp(0, 255).to(torch.uint8), self.labels, self.classes)

    @staticmethod
    def concat(parts: Sequence[LabeledImages]) -> LabeledImages:
        """Samples of all parts; their classes are merged, first-seen order."""
        classes: list[str] = []
        for p in parts:
            classes += [c for c in p.classes if c not in classes]
        parts = [p.relabel(classes) for p in parts]
        return LabeledImages(torch.cat([p.images for p in parts]), torch.cat([p.labels for p in parts]), tuple(classes))

    def balanced_sample(self, n: int, seed: int = 0) -> LabeledImages:
        """At most ``n`` samples, as equal per present class as the data allows; deterministic from ``seed``."""
        if n >= len(self):
            return self
        g = torch.Generator().manual_seed(seed)
        per_class = [torch.nonzero(self.labels == k).flatten() for k in range(len(self.classes))]
        per_class = [p[torch.randperm(len(p), generator=g)] for p in per_class if len(p)]
        taken = [0] * len(per_class)
        left = n
        while left > 0:  # round-robin: a class with fewer samples gives its share to the others
            share = max(1, left // sum(1 for k, p in enumerate(per_class) if taken[k] < len(p)))
            for k, p in enumerate(per_class):
                give = min(share, len(p) - taken[k], left)
                taken[k] += give
                left -= give
        idx = torch.cat([p[:t] for p, t in zip(per_class, taken)])
        return self.subset(idx.sort().values)

    def held_out(self, fraction: float) -> tuple[LabeledImages, LabeledImages]:
        """Split into (train, held-out) by a hash of each sample's pixels: the split never moves when
        samples are added or reordered."""
        if fraction <= 0:
            return self, self.subset([])
        flat = self.images.reshape(len(self), -1).numpy()
        keep = torch.tensor([int.from_bytes(hashlib.sha256(row.tobytes()).digest()[:4], "big") % 10_000
                             >= fraction * 10_000 for row in flat], dtype=torch.bool)
        return self.subset(torch.nonzero(keep).flatten()), self.subset(torch.nonzero(~keep).flatten())


def _stack(dataset, size: int) -> LabeledImages:
    n = len(dataset)
    if n == 0:
        raise DataError("the data source is empty")
    first, _ = dataset[0]
    images = torch.empty((n, *first.shape), dtype=torch.uint8)
    labels = torch.empty(n, dtype=torch.long)
    for i in range(n):
        images[i], labels[i] = dataset[i]
    return LabeledImages(images, labels, tuple(dataset.classes)).resized(size)


def load_source(cfg, size: int) -> LabeledImages:
    """Decode a :class:`~edgerev.train.config.SourceConfig` into memory, resized to ``size``."""
    if cfg.kind == "synthetic":
        ds = SyntheticImages(cfg.samples, cfg.num_classes, size, cfg.seed, cfg.noise, cfg.classes, cfg.start)
        data = _stack(ds, size)
        return data
    if cfg.kind == "folder":
        return _stack(ImageFolder(cfg.path, size), size)
    if cfg.kind == "provided":
        raise DataError(f"a provided source ({cfg.description or 'images a program gave'}) is not read from a "
                        "recipe: give its images to train(data=...), or a synthetic, folder or cifar10 source")
    ds = CIFAR10Binary(cfg.path, train=cfg.split == "train")
    return LabeledImages(ds.images, ds.labels, ds.classes).resized(size)
