"""Image-classification data: image folders, CIFAR-10 binary files, and a generated data set.

Every source yields ``(image, label)`` with ``image`` a ``uint8`` tensor ``[3, H, W]`` and ``label`` an
int. Nothing is downloaded: real data sets are read from a local path the user gives. Pillow
decodes; torch does the rest.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from edgerev.errors import EdgerevError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
CIFAR10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck")


class DataError(EdgerevError):
    """A data path or file the caller named cannot be used."""


def decode_image(path: Path, size: int | None = None) -> Tensor:
    """Decode an image file to ``uint8 [3, H, W]`` (RGB), resized to ``size x size`` if given.

    Raises:
        DataError: the file is not an image Pillow can decode completely.
    """
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as im:
            im.load()  # decode everything now: a truncated file fails here, not later
            rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise DataError(f"cannot decode {path.name}: {e}") from None
    if size is not None and rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    arr = np.asarray(rgb, dtype=np.uint8).copy()
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()


class ImageFolder(torch.utils.data.Dataset):
    """``root/<class>/<image>`` with PNG or JPEG files; classes are the sorted sub-folder names.

    Files that cannot be decoded are skipped with a logged reason (see :attr:`skipped`), never
    crashing a run: they are found when the folder is scanned, not in the middle of an epoch.

    Args:
        root: the folder.
        size: resize every image to ``size x size`` (images of other sizes are an error without it).
    """

    def __init__(self, root: str | Path, size: int | None = None) -> None:
        self.root = Path(root)
        if not self.root.exists():
            raise DataError(f"data path {self.root} does not exist")
        if not self.root.is_dir():
            raise DataError(f"data path {self.root} is not a directory")
        self.classes = sorted(d.name for d in self.root.iterdir() if d.is_dir() and not d.name.startswith("."))
        if not self.classes:
            raise DataError(f"{self.root} has no class sub-folders (expected {self.root}/<class>/<image>)")
        self.size = size
        self.samples: list[tuple[Path, int]] = []
        self.skipped: list[tuple[Path, str]] = []
        shape: tuple[int, ...] | None = None
        for label, name in enumerate(self.classes):
            files = sorted(p for p in (self.root / name).iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not files:
                raise DataError(f"class folder {self.root / name} holds no PNG or JPEG image")
            for path in files:
                try:
                    img = decode_image(path, size)
                except DataError as e:
                    log.warning("skipping %s: %s", path, e)
                    self.skipped.append((path, str(e)))
                    continue
                if shape is None:
                    shape = tuple(img.shape)
                elif tuple(img.shape) != shape:
                    raise DataError(f"{path} is {img.shape[2]}x{img.shape[1]}, other images are "
                                    f"{shape[2]}x{shape[1]}; give a size to resize them all")
                self.samples.append((path, label))
        if not self.samples:
            raise DataError(f"no readable image under {self.root}")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        path, label = self.samples[i]
        return decode_image(path, self.size), label


class CIFAR10Binary(torch.utils.data.Dataset):
    """The CIFAR-10 *binary* version (``data_batch_1.bin`` ... ``data_batch_5.bin``, ``test_batch.bin``).

    Each record is one label byte and 3072 pixel bytes (1024 red, 1024 green, 1024 blue, row-major
    32x32). Read with numpy from a local folder: never downloaded, never unpickled.
    """

    RECORD = 1 + 3 * 32 * 32
    classes = CIFAR10_CLASSES

    def __init__(self, root: str | Path, train: bool = True) -> None:
        root = Path(root)
        if not root.is_dir():
            raise DataError(f"CIFAR-10 folder {root} does not exist")
        names = [f"data_batch_{i}.bin" for i in range(1, 6)] if train else ["test_batch.bin"]
        missing = [n for n in names if not (root / n).is_file()]
        if missing:
            raise DataError(f"{root} lacks {', '.join(missing)} (the CIFAR-10 binary version)")
        chunks = []
        for n in names:
            raw = np.fromfile(root / n, dtype=np.uint8)
            if raw.size % self.RECORD:
                raise DataError(f"{root / n} is {raw.size} bytes, not a whole number of {self.RECORD}-byte records")
            chunks.append(raw.reshape(-1, self.RECORD))
        data = np.concatenate(chunks)
        labels = data[:, 0]
        if labels.max(initial=0) > 9:
            raise DataError(f"{root} holds a label above 9: not CIFAR-10 binary data")
        self.labels = torch.from_numpy(labels.astype(np.int64))
        self.images = torch.from_numpy(data[:, 1:].reshape(-1, 3, 32, 32).copy())

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        return self.images[i], int(self.labels[i])


class SyntheticImages(torch.utils.data.Dataset):
    """A generated, learnable image-classification set, deterministic from its seed, of any size.

    Each class has a prototype: a colour and a stripe pattern of its own orientation and frequency.
    A sample is its class prototype, shifted by a random offset, with a random brightness and pixel
    noise, so it takes a real (if small) model to tell the classes apart. ``dataset[i]`` depends
    only on ``(seed, start + i)``: the seed fixes the classes (their prototypes), ``start`` picks which
    samples, so a held-out set is the same seed at another ``start``.

    Args:
        n: number of samples.
        num_classes: classes, cycling through ``i % num_classes``.
        size: image height and width.
        seed: the data set's identity.
        noise: standard deviation of the pixel noise, in 0..255 units.
        classes: restrict to these class indices (e.g. ``range(5)`` for old classes only).
        start: index of the first sample (disjoint ranges give disjoint samples of the same classes).
    """

    def __init__(self, n: int, num_classes: int = 10, size: int = 32, seed: int = 0, noise: float = 40.0,
                 classes: Sequence[int] | None = None, start: int = 0) -> None:
        if n < 1 or num_classes < 2 or size < 4 or start < 0:
            raise ValueError(f"need n >= 1, num_classes >= 2, size >= 4, start >= 0 (got {n}, {num_classes}, {size}, "
                             f"{start})")
        self.start = start
        self.n, self.num_classes, self.size, self.seed, self.noise = n, num_classes, size, seed, noise
        self.subset = list(classes) if classes is not None else list(range(num_classes))
        if any(not 0 <= c < num_classes for c in self.subset):
            raise ValueError(f"classes must lie in 0..{num_classes - 1}")
        self.classes = tuple(f"class{c}" for c in range(num_classes))
        g = torch.Generator().manual_seed(seed)
        self._colour = torch.rand(num_classes, 3, 1, 1, generator=g) * 0.6 + 0.2
        self._angle = torch.rand(num_classes, generator=g) * math.pi
        self._freq = 2 + torch.rand(num_classes, generator=g) * 4

    def __len__(self) -> int:
        return self.n

    def label(self, i: int) -> int:
        return self.subset[(self.start + i) % len(self.subset)]

    def __getitem__(self, i: int) -> tuple[Tensor, int]:
        if not 0 <= i < self.n:
            raise IndexError(i)
        c = self.label(i)
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.start + i)
        s = self.size
        yy, xx = torch.meshgrid(torch.arange(s, dtype=torch.float32), torch.arange(s, dtype=torch.float32),
                                indexing="ij")
        dx, dy = torch.rand(2, generator=g) * s
        phase = ((xx + dx) * math.cos(self._angle[c]) + (yy + dy) * math.sin(self._angle[c])) * (
            2 * math.pi * self._freq[c] / s)
        stripes = 0.5 + 0.5 * torch.sin(phase)
        img = self._colour[c] * (0.5 + stripes) * (0.7 + 0.6 * torch.rand(1, generator=g))
        img = img * 255 + torch.randn(3, s, s, generator=g) * self.noise
        return img.clamp(0, 255).to(torch.uint8), c
