"""Evaluate a candidate against the model in service, then promote it or keep the current one.

Both models are scored on the same held-out samples (the split fixed by each sample's hash), in two
groups: *new* samples, which arrived after the current version's data, and *old* ones. A model scores
a sample right when its top class is the sample's label (a label it does not know is always wrong).

The gate: the candidate must be better on new data (strictly higher accuracy on the new held-out
samples; when none of the new samples was held out, on all held-out samples) and no worse on old
data than ``promotion.tolerance``. A first model, with nothing in service, is promoted when it beats
chance on the held-out samples.

Promotion writes the version directory completely (weights, ONNX, resolved config, metrics) before
``current`` switches (:class:`edgerev_daemon.registry.Registry`); any failure on the way (a full
disk) leaves the current model in service and is recorded.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from edgerev.train.checkpoint import load_model
from edgerev.train.evaluate import predict_logits
from edgerev.train.labeled import LabeledImages
from edgerev_daemon.blobs import BlobStore
from edgerev_daemon.jobs import load_samples
from edgerev_daemon.records import Job, Sample, Split
from edgerev_daemon.store import Store

log = logging.getLogger(__name__)


@dataclass
class Decision:
    promote: bool
    reason: str
    metrics: dict = field(default_factory=dict)


def accuracy(model_dir: Path, data: LabeledImages) -> float | None:
    """Share of ``data`` whose label is the model's top class (None for no samples)."""
    if len(data) == 0:
        return None
    model, info, _ = load_model(model_dir)
    logits = predict_logits(model, data, info)
    predicted = [info.classes[k] for k in logits.argmax(1).tolist()]
    truth = [data.classes[k] for k in data.labels.tolist()]
    return sum(p == t for p, t in zip(predicted, truth)) / len(truth)


def held_out_groups(store: Store, blobs: BlobStore, job: Job, base_batch: int) -> dict[str, LabeledImages]:
    """The held-out samples up to the job's data: ``old`` (up to ``base_batch``), ``new``, ``all``."""
    classes = store.labels()
    held: list[Sample] = store.samples(Split.HELDOUT, upto_batch=job.data_batch_id)
    old = [s for s in held if s.batch_id <= base_batch]
    new = [s for s in held if s.batch_id > base_batch]
    return {"old": load_samples(old, blobs, classes), "new": load_samples(new, blobs, classes),
            "all": load_samples(held, blobs, classes)}


def decide(candidate: Path, current: Path | None, groups: dict[str, LabeledImages], tolerance: float) -> Decision:
    """Apply the gate of the module docstring; the metrics hold every accuracy compared."""
    m: dict = {"heldout_samples": {k: len(v) for k, v in groups.items()}}
    for name, folder in (("candidate", candidate), ("current", current)):
        if folder is None:
            continue
        m[name] = {k: accuracy(folder, v) for k, v in groups.items()}
    cand = m["candidate"]
    if current is None:
        n_classes = len(set(groups["all"].labels.tolist())) or 1
        chance = 1.0 / n_classes
        if cand["all"] is None:
            return Decision(True, "first model (no held-out sample yet to score it)", m)
        if cand["all"] > chance:
            return Decision(True, f"first model: held-out accuracy {cand['all']:.4f} (chance {chance:.4f})", m)
        return Decision(False, f"first model at chance: held-out accuracy {cand['all']:.4f}", m)
    cur = m["current"]
    key = "new" if cand["new"] is not None else "all"
    if cand[key] is None:
        return Decision(False, "no held-out sample to compare the models on", m)
    if not cand[key] > cur[key]:
        return Decision(False, f"not better on {key} held-out data: {cand[key]:.4f} vs {cur[key]:.4f}", m)
    if cand["old"] is not None and cand["old"] < cur["old"] - tolerance:
        return Decision(False, f"worse on old held-out data: {cand['old']:.4f} vs {cur['old']:.4f} "
                               f"(tolerance {tolerance:g})", m)
    old = f", old {cand['old']:.4f} vs {cur['old']:.4f}" if cand["old"] is not None else ""
    return Decision(True, f"better on {key} held-out data: {cand[key]:.4f} vs {cur[key]:.4f}{old}", m)


VERSION_FILES = ("model.safetensors", "model.json", "replay.safetensors", "config.yaml", "summary.json",
                 "curves.png", "metrics.jsonl")


def version_files(run_dir: Path, onnx: Path, metrics: dict) -> dict[str, Path | bytes]:
    """What a version directory holds, from a finished job's run directory."""
    files: dict[str, Path | bytes] = {n: run_dir / n for n in VERSION_FILES if (run_dir / n).is_file()}
    files["model.onnx"] = onnx
    files["metrics.json"] = (json.dumps(metrics, indent=2, sort_keys=True) + "\n").encode()
    return files


def export(run_dir: Path, out: Path) -> dict:
    """The candidate's ONNX file, verified against PyTorch (see :func:`edgerev.export.onnx.export_onnx`)."""
    from edgerev.export.onnx import export_onnx

    result = export_onnx(run_dir, out)
    return {"max_abs_diff": result.max_abs_diff, "opset": result.opset, "ir_version": result.ir_version,
            "export_seconds": round(result.seconds, 3), "size_bytes": result.size_bytes}
