"""Images to model input with Pillow and numpy only (the torch-free twin of :mod:`edgerev.train.data`).

Decoding and resizing match :func:`edgerev.train.data.decode_image` (RGB, bilinear resize to
``size x size``), so an exported model sees the pixels the trainer saw.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from edgerev.errors import EdgerevError

log = logging.getLogger(__name__)

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


class ImageError(EdgerevError):
    """An image file or image folder cannot be read."""


def decode(path: str | Path, size: int) -> np.ndarray:
    """Decode an image file to ``uint8 [3, size, size]`` (RGB, bilinear resize).

    Raises:
        ImageError: the file does not exist or is not an image Pillow can decode completely.
    """
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    if not path.is_file():
        raise ImageError(f"image {path} does not exist")
    try:
        with Image.open(path) as im:
            im.load()  # decode everything now: a truncated file fails here
            rgb = im.convert("RGB")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"cannot decode image {path}: {e}") from None
    if rgb.size != (size, size):
        rgb = rgb.resize((size, size), Image.BILINEAR)
    return np.ascontiguousarray(np.asarray(rgb, dtype=np.uint8).transpose(2, 0, 1))


def normalize(pixels: np.ndarray, mean: Sequence[float], std: Sequence[float]) -> np.ndarray:
    """``uint8 [B, C, H, W]`` pixels to the model's ``float32`` input ``(pixels / 255 - mean) / std``."""
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    return ((pixels.astype(np.float32) / 255 - m) / s).astype(np.float32)


def load_folder(root: str | Path, classes: Sequence[str], size: int
                ) -> tuple[np.ndarray, np.ndarray, list[tuple[Path, str]]]:
    """Read ``root/<class>/<image>`` for a model with ``classes``.

    Sub-folder names must be among ``classes`` (a model cannot learn a class it has no logit for);
    a class may have no folder. Files that cannot be decoded are skipped with a logged reason, as
    :class:`edgerev.train.data.ImageFolder` does.

    Returns:
        ``(pixels uint8 [N, 3, size, size], labels int64 [N], skipped [(path, reason)])``, labels
        indexing ``classes``.
    """
    root = Path(root)
    if not root.is_dir():
        raise ImageError(f"data folder {root} does not exist" if not root.exists() else f"{root} is not a folder")
    folders = sorted(d for d in root.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not folders:
        raise ImageError(f"{root} has no class sub-folders (expected {root}/<class>/<image>)")
    unknown = [d.name for d in folders if d.name not in classes]
    if unknown:
        raise ImageError(f"{root} has folders for classes the model does not have: {', '.join(unknown)} "
                         f"(the model's classes: {', '.join(classes)})")
    images, labels, skipped = [], [], []
    for d in folders:
        for path in sorted(p for p in d.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES):
            try:
                images.append(decode(path, size))
            except ImageError as e:
                log.warning("skipping %s", e)
                skipped.append((path, str(e)))
                continue
            labels.append(classes.index(d.name))
    if not images:
        raise ImageError(f"no readable PNG or JPEG image under {root}")
    return np.stack(images), np.asarray(labels, dtype=np.int64), skipped
