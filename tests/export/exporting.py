"""What the export, predict and ORT-training tests share: a tiny model directory, data as arrays and files."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from edgerev.models import create_model
from edgerev.models.directory import ModelInfo, build_model, save_model
from edgerev.train.data import SyntheticImages

CLASSES = ("cat", "dog", "owl")
SIZE = 16
#: a RevNeXt small enough to export in a few seconds (one hybrid block per level, stem width 8)
TINY = {"width": 8, "blocks": [1, 1, 1, 1, 1]}


def make_run(folder: Path, seed: int = 0, arch: str = "revnext", args: dict | None = None,
             size: int = SIZE) -> tuple[torch.nn.Module, ModelInfo]:
    """Write a model directory with random weights and non-trivial batch-norm statistics."""
    args = TINY if args is None else args
    torch.manual_seed(seed)
    info = ModelInfo(arch=arch, classes=CLASSES, input_size=size, mean=(0.4, 0.5, 0.6), std=(0.2, 0.25, 0.3),
                     model_args=dict(args))
    model = build_model(info).module
    with torch.no_grad():  # a few training-mode forwards move the running statistics off their defaults
        for _ in range(3):
            model(torch.randn(4, 3, size, size) * 2 + 0.5)
    model.eval()
    save_model(folder, model, info)
    return model, info


def tiny_model(arch: str, size: int = SIZE) -> tuple[torch.nn.Module, dict]:
    """A small variant of a registry model and the arguments that build it."""
    args = {"revnext": TINY, "layerwise": {"width": 8, "layers": [1, 1, 1, 1, 1]}}.get(
        arch, {"width": 8, "blocks": [1, 1]})
    return create_model(arch, **args, num_classes=len(CLASSES)), args


def synthetic(n: int, start: int = 0, seed: int = 0, size: int = SIZE) -> tuple[np.ndarray, np.ndarray]:
    """Samples ``start .. start + n`` of the generated data set, one of its classes per model class.

    The classes' prototypes depend on ``seed``: a held-out set is another range of the same seed.

    Returns:
        ``(uint8 [n, 3, size, size], int64 [n])``.
    """
    ds = SyntheticImages(start + n, num_classes=len(CLASSES), size=size, seed=seed, noise=20.0)
    items = [ds[i] for i in range(start, start + n)]
    return np.stack([x.numpy() for x, _ in items]), np.array([y for _, y in items], dtype=np.int64)


def save_images(root: Path, pixels: np.ndarray, labels: np.ndarray, suffix: str = ".png") -> list[Path]:
    """Write ``root/<class>/<i>.png`` files; returns their paths in order."""
    from PIL import Image

    paths = []
    for i, (img, label) in enumerate(zip(pixels, labels)):
        folder = root / CLASSES[label]
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{i:04d}{suffix}"
        Image.fromarray(img.transpose(1, 2, 0)).save(path)
        paths.append(path)
    return paths


def run_without_torch(code: str, cwd: Path) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter where ``import torch`` fails, as on a device without PyTorch."""
    prelude = "import sys\nsys.modules['torch'] = None  # any import of torch now raises ImportError\n"
    return subprocess.run([sys.executable, "-c", prelude + textwrap.dedent(code)], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


def needs_ort_training() -> None:
    """Skip where onnxruntime-training is not installed (CI installs it: the ``ort-training`` extra)."""
    ort = pytest.importorskip("onnxruntime")
    if not (Path(ort.__file__).parent / "training" / "api").is_dir():
        pytest.skip("onnxruntime-training is not installed (pip install 'edgerev[ort-training]')")
