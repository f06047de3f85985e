"""Head fine-tuning of an exported model: a device adapts its classifier without PyTorch.

The backbone stays frozen, so it runs once per image (an ONNX Runtime inference session over the
exported graph cut at the head's input); only the linear head trains, on those features:

1. split the exported graph at the head (:mod:`edgerev.export.graph`) and compute ``[N, F]`` features;
2. train the head with a backend: ``numpy`` (default, :mod:`edgerev.export.head_numpy`: softmax
   regression, needs nothing beyond inference) or ``onnxruntime`` (:mod:`edgerev.export.ort_training`:
   ONNX Runtime training, ``pip install 'edgerev[ort-training]'``, the deprecated line for Python <= 3.11);
   both apply the same updates from the same seed;
3. write the exported model back with the trained head initializers, its metadata kept plus a
   ``fine_tuned`` record, after checking its logits against the head computed in numpy.

A file that outputs probabilities (a final Softmax over the classes after the head, which an ONNX import's export
keeps) trains its head on the logits and keeps the Softmax. Inference-mode batch norms that kept their three
outputs are cut to one (:func:`graph.drop_extra_bn_outputs`), and a head exported without a bias gets a zero one
(:func:`graph.give_head_a_bias`: the logits do not change), before anything runs. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from edgerev.atomic import atomic_write
from edgerev.errors import ExportError
from edgerev.export import graph, head_numpy
from edgerev.export.images import ImageError, load_folder, normalize
from edgerev.export.metadata import ModelMeta, get_props, set_props
from edgerev.export.predict import softmax
from edgerev.export.runtime import first_line, inference_session, logits_apart, training_modules

BACKENDS = ("numpy", "onnxruntime")

OPTIMIZERS = ("adamw", "sgd")
Data = str | Path | tuple[np.ndarray, np.ndarray]


@dataclass(frozen=True)
class FinetuneResult:
    """What :func:`finetune_head` trained and wrote."""

    path: Path
    samples: int
    epochs: int
    lr: float
    optimizer: str
    losses: tuple[float, ...]  # mean training loss per epoch
    train_accuracy_before: float
    train_accuracy_after: float
    val_samples: int = 0
    val_accuracy_before: float | None = None
    val_accuracy_after: float | None = None
    max_abs_diff: float = 0.0  # logits of the written model against the head computed in numpy
    seconds: float = 0.0
    skipped: tuple[tuple[str, str], ...] = field(default_factory=tuple)  # undecodable files: (path, reason)
    backend: str = ""  # what trained the head, with its version (also recorded in the model's metadata)

    def to_json(self) -> dict:
        d = asdict(self)
        d["path"], d["losses"] = str(self.path), list(self.losses)
        d["skipped"] = [{"path": p, "reason": r} for p, r in self.skipped]
        return d


def load_onnx(path: str | Path):
    """Read an ONNX file; returns ``(ModelProto, SHA-256 of the file)``, or one-line errors."""
    import onnx

    path = Path(path)
    if not path.is_file():
        raise ExportError(f"ONNX model {path} does not exist")
    raw = path.read_bytes()
    try:
        return onnx.load_model_from_string(raw), hashlib.sha256(raw).hexdigest()
    except Exception as e:  # protobuf's DecodeError and friends
        raise ExportError(f"{path} is not an ONNX model: {first_line(e)}") from None


def features(session, pixels: np.ndarray, meta: ModelMeta, batch: int = 64) -> np.ndarray:
    """Backbone features ``[N, F]`` of ``uint8 [N, 3, S, S]`` pixels, ``batch`` images at a time."""
    name = session.get_inputs()[0].name
    out = [session.run(None, {name: normalize(pixels[i:i + batch], meta.mean, meta.std)})[0]
           for i in range(0, len(pixels), batch)]
    return np.concatenate(out).astype(np.float32)


def finetune_head(onnx_path: str | Path, data: Data, out_path: str | Path, *, val: Data | None = None,
                  epochs: int = 10, lr: float = 1e-2, batch: int = 32, optimizer: str = "adamw", seed: int = 0,
                  tolerance: float = 1e-4, backend: str = "numpy") -> FinetuneResult:
    """Train the head of an exported model on a frozen backbone; write a new model.

    Args:
        onnx_path: a model written by ``edgerev export`` (or by this function).
        data: a folder ``<class>/<image>`` (class names among the model's), or ``(pixels, labels)``
            with ``pixels`` ``uint8 [N, 3, S, S]`` at the model's input size and ``labels`` class indices.
        out_path: the ``.onnx`` file to write (may be ``onnx_path`` itself: it is replaced atomically).
        val: held-out data of the same kinds; its accuracy is reported before and after.
        epochs: passes over the data.
        lr: learning rate.
        batch: mini-batch size.
        optimizer: ``"adamw"`` or ``"sgd"``.
        seed: seed of the shuffling.
        tolerance: largest accepted difference between the written model's logits and the head in numpy,
            relative to the largest logit when that is above 1 (float32 rounding grows with the logits).
        backend: ``"numpy"`` (needs only ONNX Runtime inference) or ``"onnxruntime"`` (ONNX Runtime training).

    Raises:
        ExportError: bad arguments, a model that is not an edgerev export, the backend not installed.
        ImageError: unusable data.
    """
    if epochs < 1 or batch < 1:
        raise ExportError(f"epochs and batch must be positive, got {epochs} and {batch}")
    if not lr > 0:
        raise ExportError(f"learning rate must be positive, got {lr}")
    if optimizer not in OPTIMIZERS:
        raise ExportError(f"unknown optimizer {optimizer!r}; choose from {', '.join(OPTIMIZERS)}")
    if backend not in BACKENDS:
        raise ExportError(f"unknown backend {backend!r}; choose from {', '.join(BACKENDS)}")
    out_path = Path(out_path)
    if not out_path.parent.is_dir():
        raise ExportError(f"cannot write {out_path}: folder {out_path.parent} does not exist")
    start = time.perf_counter()
    if backend == "onnxruntime":
        training_modules()  # fail early when ONNX Runtime training is missing
    source, source_sha = load_onnx(onnx_path)
    meta = ModelMeta.from_props(get_props(source), str(onnx_path))
    graph.lower_ir(source)
    graph.drop_extra_bn_outputs(source)
    graph.give_head_a_bias(source)  # a bias-free head exported before export put a zero bias back
    head = graph.find_head(source)
    w0, b0 = graph.head_weights(source, head)

    pixels, labels, skipped = _load(data, meta, "data")
    session = inference_session(graph.backbone(source, head).SerializeToString(), f"the backbone of {onnx_path}")
    feats = features(session, pixels, meta)
    if val is not None:
        val_pixels, val_labels, _ = _load(val, meta, "validation data")
        val_feats = features(session, val_pixels, meta)

    if backend == "onnxruntime":
        from edgerev.export import ort_training

        w1, b1, losses = ort_training.train_head(feats, labels, w0, b0, head, epochs=epochs, lr=lr, batch=batch,
                                                 optimizer=optimizer, seed=seed)
        backend_name = f"onnxruntime-training {ort_training.version()}"
    else:
        w1, b1, losses = head_numpy.train_head(feats, labels, w0, b0, epochs=epochs, lr=lr, batch=batch,
                                               optimizer=optimizer, seed=seed)
        backend_name = f"numpy {np.__version__}"

    tuned = graph.with_head(source, head, w1, b1)
    record = {"backend": backend_name, "what": "head", "epochs": epochs, "lr": lr,
              "optimizer": optimizer, "samples": len(labels),
              "source_sha256": source_sha}
    if meta.fine_tuned is not None:
        record["previous"] = meta.fine_tuned
    set_props(tuned, {"fine_tuned": json.dumps(record)})
    data_bytes = tuned.SerializeToString()
    diff = _check(data_bytes, pixels[:64], feats[:64], w1, b1, meta, tolerance, str(out_path),
                  probabilities=head.softmax is not None)
    atomic_write(out_path, data_bytes)

    val_stats = {}
    if val is not None:
        val_stats = {"val_samples": len(val_labels), "val_accuracy_before": _accuracy(val_feats, val_labels, w0, b0),
                     "val_accuracy_after": _accuracy(val_feats, val_labels, w1, b1)}
    return FinetuneResult(
        path=out_path, samples=len(labels), epochs=epochs, lr=lr, optimizer=optimizer, losses=tuple(losses),
        train_accuracy_before=_accuracy(feats, labels, w0, b0), train_accuracy_after=_accuracy(feats, labels, w1, b1),
        max_abs_diff=diff, seconds=time.perf_counter() - start, skipped=tuple((str(p), r) for p, r in skipped),
        backend=backend_name,
        **val_stats)


def _load(data: Data, meta: ModelMeta, what: str) -> tuple[np.ndarray, np.ndarray, list]:
    """Pixels, labels and skipped files of a folder or an array pair, checked against the model."""
    if isinstance(data, (str, Path)):
        return load_folder(data, meta.classes, meta.input_size)
    pixels, labels = (np.asarray(a) for a in data)
    s, c = meta.input_size, len(meta.mean)
    if pixels.dtype != np.uint8 or pixels.ndim != 4 or pixels.shape[1:] != (c, s, s):
        raise ImageError(f"{what} must be uint8 pixels [N, {c}, {s}, {s}], got {pixels.dtype} {list(pixels.shape)}")
    if labels.shape != (len(pixels),) or not np.issubdtype(labels.dtype, np.integer):
        raise ImageError(f"{what} needs one integer label per image, got {labels.dtype} {list(labels.shape)}")
    if len(labels) == 0:
        raise ImageError(f"{what} is empty")
    if labels.min() < 0 or labels.max() >= len(meta.classes):
        raise ImageError(f"{what} has labels outside 0..{len(meta.classes) - 1}")
    return pixels, labels.astype(np.int64), []


def _logits(feats: np.ndarray, w: np.ndarray, b: np.ndarray) -> np.ndarray:
    return feats.astype(np.float64) @ w.T.astype(np.float64) + b


def _accuracy(feats: np.ndarray, labels: np.ndarray, w: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(_logits(feats, w, b).argmax(axis=1) == labels))


def _check(model: bytes, pixels: np.ndarray, feats: np.ndarray, w: np.ndarray, b: np.ndarray, meta: ModelMeta,
           tolerance: float, what: str, probabilities: bool = False) -> float:
    """The written model's logits (its probabilities, for a file that ends in a Softmax) against backbone
    features times the trained head, in numpy."""
    session = inference_session(model, what)
    got = session.run(None, {session.get_inputs()[0].name: normalize(pixels, meta.mean, meta.std)})[0]
    expected = _logits(feats, w, b)
    if probabilities:
        expected = softmax(expected)
    diff, allowed = logits_apart(got, expected, tolerance)
    if not diff <= allowed:
        raise ExportError(f"the fine-tuned model's logits differ from the trained head by {diff:.3g} "
                          f"(tolerance {allowed:.3g}); nothing written")
    return diff
