"""Evaluate a candidate against the model in service, then promote it or keep the current one.

Both models are scored on the same held-out samples (the split fixed by each sample's hash), in two
groups: *new* samples, which arrived after the current version's data, and *old* ones. A model scores
a sample right when its top class is the sample's label (a label it does not know is always wrong).

The gate: the candidate must be better on new data (strictly higher accuracy on the new held-out
samples; when none of the new samples was held out, on all held-out samples) and no worse on old
data than ``promotion.tolerance``. A first model, with nothing in service, is promoted when it beats
chance on the held-out samples. Either way, a candidate that leaves a class it knows at 0 % on at
least ``promotion.min_heldout_per_class`` held-out samples of that class is refused, and the reason
names the class (``promotion.refuse_class_at_zero: false`` turns this off). The metrics keep each
model's per-class accuracy and the candidate's confusion matrix on all held-out samples.

Promotion writes the version directory completely (weights, ONNX, resolved config, metrics) before
``current`` switches (:class:`edgerev_daemon.registry.Registry`); any failure on the way (a full
disk) leaves the current model in service and is recorded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path

from edgerev.train.checkpoint import load_model
from edgerev.train.evaluate import confusion as confusion_of
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


@dataclass(frozen=True)
class Gate:
    """The promotion policy (``promotion:`` in the daemon config)."""

    tolerance: float = 0.02
    min_heldout_per_class: int = 5
    refuse_class_at_zero: bool = True


@dataclass(frozen=True)
class Scores:
    """One model on the held-out groups: accuracy per group (None: no sample), per class on ``all``
    (``{label: [right, samples]}``), the labels it knows, and its confusion matrix on ``all``
    (rows: true label in ``labels`` order, columns: predicted label)."""

    accuracy: dict[str, float | None]
    per_class: dict[str, list[int]]
    known: tuple[str, ...]
    confusion: dict = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> dict:
        return {**self.accuracy, "per_class": {c: (r / n if n else None) for c, (r, n) in self.per_class.items()},
                "per_class_samples": {c: n for c, (_, n) in self.per_class.items()}}


def _predicted(model_dir: Path, data: LabeledImages) -> tuple[list[str], tuple[str, ...]]:
    """The model's top class of each sample, and the classes it knows."""
    model, info, _ = load_model(model_dir)
    if len(data) == 0:
        return [], tuple(info.classes)
    logits = predict_logits(model, data, info)
    return [info.classes[k] for k in logits.argmax(1).tolist()], tuple(info.classes)


def score(model_dir: Path, groups: dict[str, LabeledImages]) -> Scores:
    """Accuracy on each group, per-class accuracy and the confusion matrix on ``all``. A model scores
    a sample right when its top class is the sample's label (a label it does not know is always wrong)."""
    acc: dict[str, float | None] = {}
    per_class: dict[str, list[int]] = {}
    known: tuple[str, ...] = ()
    confusion: dict = {}
    samples: dict[str, int] = {}
    for name, data in groups.items():
        predicted, known = _predicted(model_dir, data)
        truth = [data.classes[k] for k in data.labels.tolist()]
        acc[name] = sum(p == t for p, t in zip(predicted, truth)) / len(truth) if truth else None
        samples[name] = len(truth)
        if name == "all":
            labels = list(data.classes)
            for t, p in zip(truth, predicted):
                counts = per_class.setdefault(t, [0, 0])
                counts[0] += p == t
                counts[1] += 1
            confusion = confusion_of(truth, predicted, labels, list(dict.fromkeys([*known, *labels])))
    return Scores(acc, per_class, known, confusion, samples)


def accuracy(model_dir: Path, data: LabeledImages) -> float | None:
    """Share of ``data`` whose label is the model's top class (None for no samples)."""
    return score(model_dir, {"all": data}).accuracy["all"]


def held_out_groups(store: Store, blobs: BlobStore, job: Job, base_batch: int,
                    held_back: Collection[str] = ()) -> dict[str, LabeledImages]:
    """The held-out samples up to the job's data: ``old`` (up to ``base_batch``), ``new``, ``all``; none
    of a ``held_back`` label (neither model was trained on it)."""
    classes = store.labels()
    held: list[Sample] = [s for s in store.samples(Split.HELDOUT, upto_batch=job.data_batch_id)
                          if s.label not in held_back]
    old = [s for s in held if s.batch_id <= base_batch]
    new = [s for s in held if s.batch_id > base_batch]
    return {"old": load_samples(old, blobs, classes), "new": load_samples(new, blobs, classes),
            "all": load_samples(held, blobs, classes)}


def decide(candidate: Path, current: Path | None, groups: dict[str, LabeledImages], gate: Gate) -> Decision:
    """Score both models on the same groups and apply :func:`judge`."""
    return judge(score(candidate, groups), score(current, groups) if current is not None else None, gate)


def dead_classes(cand: Scores, gate: Gate) -> list[tuple[str, int]]:
    """Classes the candidate knows, with at least ``gate.min_heldout_per_class`` held-out samples, of
    which it gets none right: ``(label, samples)``."""
    return [(c, n) for c, (right, n) in cand.per_class.items()
            if c in cand.known and n >= gate.min_heldout_per_class and right == 0]


def dead_reason(cand: Scores, gate: Gate) -> str | None:
    """Why the candidate is refused for a class at 0 % (:func:`dead_classes`), or None: none, or the gate
    does not refuse for it (``promotion.refuse_class_at_zero``)."""
    dead = dead_classes(cand, gate) if gate.refuse_class_at_zero else []
    if not dead:
        return None
    more = f" (and {len(dead) - 1} more: {', '.join(c for c, _ in dead[1:])})" if len(dead) > 1 else ""
    return f"class {dead[0][0]} at 0 % on its {dead[0][1]} held-out samples{more} (promotion.refuse_class_at_zero)"


# the groups in the schedule's words (edgerev_daemon.schedule): new samples arrived after the data of the model
# in service, old ones before; "new classes" are labels it does not know
WORDS = {"new": "held-out new samples", "old": "held-out old samples", "all": "held-out samples"}


def judge(cand: Scores, cur: Scores | None, gate: Gate) -> Decision:
    """The gate of the module docstring on two models' scores; the metrics hold every figure compared."""
    m: dict = {"heldout_samples": cand.samples, "candidate": cand.to_json(), "candidate_confusion": cand.confusion}
    if cur is not None:
        m["current"] = cur.to_json()
    refuse_dead = dead_reason(cand, gate)
    c = cand.accuracy
    if cur is None:
        n_classes = len([n for _, n in cand.per_class.values() if n]) or 1
        chance = 1.0 / n_classes
        if c.get("all") is None:
            return Decision(True, "first model (no held-out sample yet to score it)", m)
        if not c["all"] > chance:
            return Decision(False, f"first model at chance: held-out accuracy {c['all']:.4f}", m)
        if refuse_dead:
            return Decision(False, f"first model refused: {refuse_dead}", m)
        return Decision(True, f"first model: held-out accuracy {c['all']:.4f} (chance {chance:.4f})", m)
    r = cur.accuracy
    key = "new" if c.get("new") is not None else "all"
    if c.get(key) is None:
        return Decision(False, "no held-out sample to compare the models on", m)
    if not c[key] > r[key]:
        return Decision(False, f"not better on the {WORDS[key]}: {c[key]:.4f} vs {r[key]:.4f}", m)
    if c.get("old") is not None and c["old"] < r["old"] - gate.tolerance:
        return Decision(False, f"worse on the {WORDS['old']}: {c['old']:.4f} vs {r['old']:.4f} "
                               f"(tolerance {gate.tolerance:g})", m)
    if refuse_dead:
        return Decision(False, f"refused: {refuse_dead}", m)
    old = f", old {c['old']:.4f} vs {r['old']:.4f}" if c.get("old") is not None else ""
    return Decision(True, f"better on the {WORDS[key]}: {c[key]:.4f} vs {r[key]:.4f}{old}", m)


VERSION_FILES = ("model.safetensors", "model.json", "replay.safetensors", "config.yaml", "summary.json",
                 "curves.png", "classes.png", "metrics.jsonl")


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
