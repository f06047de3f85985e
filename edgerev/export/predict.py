"""Classify images with an exported model, using ONNX Runtime, Pillow and numpy only.

Nothing on this module's import chain imports torch (``edgerev/__init__`` loads its torch-backed
names lazily), so a device with ONNX Runtime and without PyTorch can run it:

    >>> predictor = Predictor("model.onnx")                      # doctest: +SKIP
    >>> predictor.predict(["cat.jpg"], top=3)[0].label           # doctest: +SKIP
    'cat'
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from edgerev.errors import ExportError
from edgerev.export.images import ImageError, decode, normalize
from edgerev.export.metadata import ModelMeta
from edgerev.export.runtime import first_line, inference_session


@dataclass(frozen=True)
class Prediction:
    """One image's class: the most probable label, its probability, and the ``top`` labels; or, for a
    file that could not be read, ``error`` (and no label)."""

    source: str
    label: str | None
    probability: float
    top: tuple[tuple[str, float], ...]
    error: str | None = None

    @classmethod
    def failed(cls, source: str, error: str) -> Prediction:
        return cls(source=source, label=None, probability=0.0, top=(), error=error)

    def to_json(self) -> dict:
        if self.error is not None:
            return {"image": self.source, "error": self.error}
        return {"image": self.source, "label": self.label, "probability": self.probability,
                "top": [{"label": c, "probability": p} for c, p in self.top]}


def softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise softmax in float64 (no overflow for large logits)."""
    z = logits.astype(np.float64)
    z -= z.max(axis=1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(axis=1, keepdims=True)


class Predictor:
    """An exported model with its metadata: decode, resize, normalize, batch, run, softmax.

    Args:
        onnx_path: a file written by :func:`edgerev.export.onnx.export_onnx` (or fine-tuned by
            :mod:`edgerev.export.finetune`).

    Raises:
        ExportError: the file is missing, not a model ONNX Runtime can load, or lacks edgerev metadata.
    """

    def __init__(self, onnx_path: str | Path) -> None:
        self.path = Path(onnx_path)
        self.session = inference_session(self.path)
        self.meta = ModelMeta.from_props(self.session.get_modelmeta().custom_metadata_map, str(self.path))
        inp = self.session.get_inputs()[0]
        self.input_name = inp.name
        s = self.meta.input_size
        expected = [len(self.meta.mean), s, s]
        if len(inp.shape) != 4 or list(inp.shape[1:]) != expected:
            raise ExportError(f"{self.path} takes input {inp.shape}, its metadata says "
                              f"[batch, {expected[0]}, {s}, {s}]")
        out = self.session.get_outputs()[0].shape
        if len(out) != 2 or out[1] != len(self.meta.classes):
            raise ExportError(f"{self.path} returns logits {out} for {len(self.meta.classes)} classes")

    @property
    def classes(self) -> tuple[str, ...]:
        return self.meta.classes

    @property
    def outputs_probabilities(self) -> bool:
        """The file outputs probabilities, not logits (an imported model that ended in a Softmax)."""
        return self.meta.extra.get("outputs") == "probabilities"

    def logits(self, pixels: np.ndarray) -> np.ndarray:
        """The model's outputs for ``uint8 [B, 3, S, S]`` pixels (S the model's input size): logits, or
        probabilities where :attr:`outputs_probabilities`."""
        x = normalize(pixels, self.meta.mean, self.meta.std)
        try:
            return self.session.run(None, {self.input_name: x})[0]
        except Exception as e:  # ORT's pybind exceptions derive from Exception only
            raise ExportError(f"ONNX Runtime failed on {self.path}: {first_line(e)}") from None

    def classify(self, pixels: np.ndarray, top: int = 5, sources: Sequence[str] | None = None) -> list[Prediction]:
        """Predictions for ``uint8 [B, 3, S, S]`` pixels; ``sources`` name them (default: their index)."""
        if top < 1:
            raise ExportError(f"top must be positive, got {top}")
        scores = self.logits(pixels)
        # a model imported with a Softmax at its end exports it again (metadata outputs=probabilities)
        probs = scores.astype(np.float64) if self.outputs_probabilities else softmax(scores)
        k = min(top, probs.shape[1])
        out = []
        for i, p in enumerate(probs):
            order = np.argsort(-p, kind="stable")[:k]
            ranked = tuple((self.classes[j], float(p[j])) for j in order)
            name = sources[i] if sources is not None else str(i)
            out.append(Prediction(source=name, label=ranked[0][0], probability=ranked[0][1], top=ranked))
        return out

    def predict(self, images: Sequence[str | Path], top: int = 5, batch: int = 32) -> list[Prediction]:
        """Classify image files, ``batch`` at a time, one prediction per file in order: a file that is
        missing or not an image gets a :meth:`Prediction.failed` naming the reason, and the rest are
        classified."""
        if batch < 1:
            raise ExportError(f"batch must be positive, got {batch}")
        if top < 1:
            raise ExportError(f"top must be positive, got {top}")
        out: dict[int, Prediction] = {}
        readable: list[tuple[int, np.ndarray]] = []
        for i, path in enumerate(images):
            try:
                readable.append((i, decode(path, self.meta.input_size)))
            except ImageError as e:
                out[i] = Prediction.failed(str(path), str(e))
        for start in range(0, len(readable), batch):
            chunk = readable[start:start + batch]
            preds = self.classify(np.stack([px for _, px in chunk]), top, [str(images[i]) for i, _ in chunk])
            out.update((i, p) for (i, _), p in zip(chunk, preds))
        return [out[i] for i in range(len(images))]
