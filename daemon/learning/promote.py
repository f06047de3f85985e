"""Evaluate a candidate against the model in service on paired evidence, then promote it or keep the current one.

Both models are scored on the same held-out samples (the split fixed by each sample's hash): each sample
is right or wrong under each model (a label a model does not know is always wrong for it). The gate
judges the *recent* samples: for each class, those that arrived within ``promotion.recent_window_days``
before that class's newest held-out sample (:func:`recent_flags`), so a device whose world drifts is
judged on how each class looks now, and a class that stopped arriving on how it last looked.

The gate (:func:`judge`; the tests are :mod:`edgerev_daemon.learning.evidence`), whose reason names the first
rule a candidate fails, forgetting first (the most specific):

1. *Better now.* On the recent samples of every class, the candidate must be better with confidence:
   one-sided exact McNemar p-value of its gains against its losses at most ``promotion.alpha``. A class
   the current model does not know counts as wrong for it, so a candidate that learns new classes
   gains every one of their samples it gets right.
2. *No forgetting beyond the evidence.* On the recent samples of the classes the current model knows
   (the old classes), the candidate is refused when the evidence says it lost more than
   ``promotion.forgetting_margin`` of accuracy (p-value at most ``promotion.alpha``); the reason says by
   how much, how many samples were lost and gained, and with what p-value. Losing 2 of 80 old samples
   is within the noise; losing 20 of 80 is not.
3. *No dead class.* A candidate that leaves a class it knows at 0 % on at least
   ``promotion.min_heldout_per_class`` of its recent held-out samples is refused, and the reason names
   the class (``promotion.refuse_class_at_zero: false`` turns this off): a head row that is never right
   is a defect, whatever the totals say.

A first model, with nothing in service, is promoted when it beats chance on the recent held-out samples
(anything above chance serves better than no model, so no evidence is asked for), and rule 3 holds for
it too. The metrics keep every figure compared: accuracy on all held-out samples and on the recent ones,
on the old and new classes, per class, the paired counts and p-values, and the candidate's confusion
matrix on all held-out samples.

Promotion writes the version directory completely (weights, ONNX, resolved config, metrics) before
``current`` switches (:class:`edgerev_daemon.storage.registry.Registry`); any failure on the way (a full
disk) leaves the current model in service and is recorded.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from edgerev.models.directory import load_model
from edgerev.train.evaluate import EvaluationStopped, predict_logits
from edgerev.train.evaluate import confusion as confusion_of
from edgerev.train.labeled import LabeledImages
from edgerev_daemon.config import PromotionConfig
from edgerev_daemon.errors import Stopped
from edgerev_daemon.learning.evidence import Paired, paired, weighed
from edgerev_daemon.learning.jobs import load_samples
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.records import Job, Sample, Split
from edgerev_daemon.storage.store import Store

log = logging.getLogger(__name__)

DAY = 86400.0


@dataclass
class Decision:
    promote: bool
    reason: str
    metrics: dict = field(default_factory=dict)


@dataclass(frozen=True)
class HeldOut:
    """The held-out samples both models are scored on: each one's label, whether it lies in its class's
    recent window, and the images (None where only outcomes are judged)."""

    labels: tuple[str, ...]
    recent: tuple[bool, ...]
    data: LabeledImages | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if len(self.labels) != len(self.recent):
            raise ValueError(f"{len(self.labels)} labels but {len(self.recent)} recent flags")


@dataclass(frozen=True)
class Scores:
    """One model on the held-out samples: whether it got each right, the labels it knows, and its
    confusion matrix (rows: true label, columns: predicted label)."""

    right: tuple[bool, ...]
    known: tuple[str, ...]
    confusion: dict = field(default_factory=dict, compare=False)


def recent_flags(samples: Sequence[Sample], window_days: float | None) -> list[bool]:
    """Whether each sample (in arrival order) arrived within ``window_days`` before the newest sample of
    its class (None: every sample is recent).

    The window ends at each class's newest sample, not at the clock: a device that saw nothing for a
    month still judges on its last month of data, and a class that stopped arriving on how it last
    looked. Times are the daemon's clock at ingest; the newest sample is the last in arrival order (the
    ingest batch), so a clock that jumped back makes a window hold more samples, never lose the newest.
    """
    if window_days is None:
        return [True] * len(samples)
    newest: dict[str, float] = {}
    for s in samples:
        newest[s.label] = s.added_at
    return [s.added_at >= newest[s.label] - window_days * DAY for s in samples]


def _predicted(model_dir: Path, data: LabeledImages, trust_factories: Sequence[str] = (),
               stop: Callable[[], bool] | None = None) -> tuple[list[str], tuple[str, ...]]:
    """The model's top class of each sample, and the classes it knows (``trust_factories``: the factories its
    directory may name, the daemon's ``training.model.factories``).

    Raises:
        Stopped: ``stop()``, asked once the model is loaded and between two batches, said so.
    """
    model, info, _ = load_model(model_dir, trust_factories=trust_factories)
    if len(data) == 0:
        return [], tuple(info.classes)
    if stop is not None and stop():  # the model is loaded: before its first batch too
        raise Stopped("the evaluation")
    try:
        logits = predict_logits(model, data, info, stop=stop)
    except EvaluationStopped:
        raise Stopped("the evaluation") from None
    return [info.classes[k] for k in logits.argmax(1).tolist()], tuple(info.classes)


def score(model_dir: Path, held: HeldOut, trust_factories: Sequence[str] = (),
          stop: Callable[[], bool] | None = None) -> Scores:
    """Whether the model gets each held-out sample right (its top class is the sample's label; a label it
    does not know is always wrong), and its confusion matrix.

    Raises:
        Stopped: ``stop()``, asked before the first batch of samples and between two, said so.
    """
    data = held.data
    predicted, known = _predicted(model_dir, data, trust_factories, stop)
    truth = list(held.labels)
    columns = list(dict.fromkeys([*known, *data.classes]))
    return Scores(tuple(p == t for p, t in zip(predicted, truth, strict=True)), known,
                  confusion_of(truth, predicted, list(data.classes), columns))


def held_out(store: Store, blobs: BlobStore, job: Job, window_days: float | None,
             held_back: Collection[str] = (), stop: Callable[[], bool] | None = None) -> HeldOut:
    """The held-out samples up to the job's data, none of a ``held_back`` label (neither model was trained
    on it), with their recent windows (:func:`recent_flags`).

    Raises:
        Stopped: ``stop()`` said so while the samples were decoded.
    """
    samples = [s for s in store.samples(Split.HELDOUT, upto_batch=job.data_batch_id) if s.label not in held_back]
    return HeldOut(tuple(s.label for s in samples), tuple(recent_flags(samples, window_days)),
                   load_samples(samples, blobs, store.labels(), stop, "the evaluation"))


def decide(candidate: Path, current: Path | None, held: HeldOut, gate: PromotionConfig,
           stop: Callable[[], bool] = lambda: False, trust_factories: Sequence[str] = ()) -> Decision:
    """Score both models on the same held-out samples and apply :func:`judge` (``trust_factories``: the
    factories their directories may name).

    Raises:
        Stopped: ``stop()`` said so before a model or a batch of samples was scored (a model takes about a second
            on a few thousand samples, and a device may hold many more: the evaluation stops between batches).
    """
    if stop():
        raise Stopped("the evaluation")
    cand = score(candidate, held, trust_factories, stop)
    if current is None:
        return judge(held, cand, None, gate)
    return judge(held, cand, score(current, held, trust_factories, stop), gate)


# figures ---------------------------------------------------------------------------------------------

def _accuracy(right: Sequence[bool]) -> float | None:
    return sum(right) / len(right) if right else None


def _pick(values: Sequence, keep: Sequence[bool]) -> list:
    return [v for v, k in zip(values, keep) if k]


def per_class(held: HeldOut, s: Scores, recent: bool = True) -> dict[str, list[int]]:
    """``{label: [right, samples]}`` on the recent samples (or all), labels in order of first appearance."""
    out: dict[str, list[int]] = {}
    for label, r, fresh in zip(held.labels, s.right, held.recent):
        if fresh or not recent:
            counts = out.setdefault(label, [0, 0])
            counts[0] += r
            counts[1] += 1
    return out


def figures(held: HeldOut, s: Scores, old: Collection[str] | None) -> dict:
    """One model's accuracy on all held-out samples, the recent ones, the recent ones of the ``old`` classes
    and of the others (None: no sample), and per class on the recent ones."""
    recent = _pick(s.right, held.recent)
    labels = _pick(held.labels, held.recent)
    out = {"all": _accuracy(s.right), "recent": _accuracy(recent)}
    if old is not None:
        out["old_classes"] = _accuracy([r for r, c in zip(recent, labels) if c in old])
        out["new_classes"] = _accuracy([r for r, c in zip(recent, labels) if c not in old])
    pc = per_class(held, s)
    return out | {"per_class": {c: (r / n if n else None) for c, (r, n) in pc.items()},
                  "per_class_samples": {c: n for c, (_, n) in pc.items()}}


def comparisons(held: HeldOut, cand: Scores, cur: Scores) -> tuple[Paired, Paired]:
    """The paired counts on the recent samples of every class (``now``) and of the classes the current
    model knows (``old``)."""
    keep_old = [fresh and c in cur.known for c, fresh in zip(held.labels, held.recent)]
    return (paired(_pick(cand.right, held.recent), _pick(cur.right, held.recent)),
            paired(_pick(cand.right, keep_old), _pick(cur.right, keep_old)))


# the rules ---------------------------------------------------------------------------------------------

def dead_classes(held: HeldOut, cand: Scores, gate: PromotionConfig) -> list[tuple[str, int]]:
    """Classes the candidate knows, with at least ``gate.min_heldout_per_class`` recent held-out samples, of
    which it gets none right: ``(label, samples)``."""
    return [(c, n) for c, (right, n) in per_class(held, cand).items()
            if c in cand.known and n >= gate.min_heldout_per_class and right == 0]


def dead_reason(held: HeldOut, cand: Scores, gate: PromotionConfig) -> str | None:
    """Why the candidate is refused for a class at 0 % (:func:`dead_classes`), or None: none, or the gate
    does not refuse for it (``promotion.refuse_class_at_zero``)."""
    dead = dead_classes(held, cand, gate) if gate.refuse_class_at_zero else []
    if not dead:
        return None
    more = f" (and {len(dead) - 1} more: {', '.join(c for c, _ in dead[1:])})" if len(dead) > 1 else ""
    return (f"class {dead[0][0]} at 0 % on its {dead[0][1]} recent held-out samples{more} "
            "(promotion.refuse_class_at_zero)")


def _points(x: float) -> str:
    return f"{100 * abs(x):.1f} points"


def _counts(p: Paired) -> str:
    return f"{p.gained} gained, {p.lost} lost of {p.n}"


def forgetting_reason(old: Paired, gate: PromotionConfig) -> str | None:
    """Why the candidate is refused for its loss on the old classes (rule 2), or None."""
    p = old.p_worse(gate.forgetting_margin)
    if p > gate.alpha:
        return None
    beyond = f", more than the allowed {_points(gate.forgetting_margin)}" if gate.forgetting_margin > 0 else ""
    return (f"worse on the old classes by {_points(old.change)} ({old.lost} of {old.n} lost, {old.gained} gained): "
            + weighed(p, gate.alpha, f"too many losses to be chance{beyond}", ""))


def judge(held: HeldOut, cand: Scores, cur: Scores | None, gate: PromotionConfig) -> Decision:
    """The gate of the module docstring on two models' outcomes; the metrics hold every figure compared."""
    if len(cand.right) != len(held.labels) or (cur is not None and len(cur.right) != len(held.labels)):
        raise ValueError("both models must be scored on the held-out samples given")
    old = None if cur is None else set(cur.known)
    m: dict = {"heldout_samples": {"all": len(held.labels), "recent": sum(held.recent)},
               "recent_window_days": gate.recent_window_days,
               "candidate": figures(held, cand, old), "candidate_confusion": cand.confusion}
    dead = dead_reason(held, cand, gate)
    if cur is None:
        recent = _pick(cand.right, held.recent)
        if not recent:
            return Decision(True, "first model (no held-out sample yet to score it)", m)
        chance = 1.0 / (len(set(_pick(held.labels, held.recent))) or 1)
        acc = _accuracy(recent)
        if not acc > chance:
            return Decision(False, f"first model at chance: recent held-out accuracy {acc:.4f} (chance {chance:.4f})",
                            m)
        if dead:
            return Decision(False, f"first model refused: {dead}", m)
        return Decision(True, f"first model: recent held-out accuracy {acc:.4f} (chance {chance:.4f})", m)
    m["current"] = figures(held, cur, old)
    now, lost_old = comparisons(held, cand, cur)
    p_now, p_old = now.p_better(), lost_old.p_worse(gate.forgetting_margin)
    m["test"] = {"alpha": gate.alpha, "forgetting_margin": gate.forgetting_margin,
                 "recent": {"n": now.n, "gained": now.gained, "lost": now.lost, "p_better": p_now},
                 "old_classes": {"n": lost_old.n, "gained": lost_old.gained, "lost": lost_old.lost, "p_worse": p_old}}
    if now.n == 0:
        return Decision(False, "no recent held-out sample to compare the models on", m)
    unknown = " (classes the model in service does not know count as wrong for it)" if set(held.labels) - old else ""
    if forgot := forgetting_reason(lost_old, gate):  # first: the most specific thing wrong with a candidate
        return Decision(False, forgot, m)
    if p_now > gate.alpha:
        sign = "+" if now.change >= 0 else "-"
        return Decision(False, "not better with confidence on the recent held-out samples: "
                               f"{sign}{_points(now.change)} ({_counts(now)}): "
                               + weighed(p_now, gate.alpha, "", "chance alone could give as much")
                               + unknown, m)
    if dead:
        return Decision(False, f"refused: {dead}", m)
    if lost_old.n == 0:
        old_text = ""
    else:
        word = "lower" if lost_old.change < 0 else "higher" if lost_old.change > 0 else "unchanged"
        over = f" over {_points(gate.forgetting_margin)}" if gate.forgetting_margin else ""
        old_text = (f"; old classes {_points(lost_old.change)} {word} ({_counts(lost_old)}): "
                    + weighed(p_old, gate.alpha, "", f"no evidence of a loss{over}"))
        if word == "unchanged":
            old_text = f"; old classes unchanged ({_counts(lost_old)})"
    return Decision(True, f"better on the recent held-out samples by {_points(now.change)} ({_counts(now)}): "
                          + weighed(p_now, gate.alpha, "too many gains to be chance", "") + f"{unknown}{old_text}", m)


VERSION_FILES = ("model.safetensors", "model.json", "replay.safetensors", "config.yaml", "summary.json",
                 "curves.png", "classes.png", "metrics.jsonl")


def version_files(run_dir: Path, onnx: Path, metrics: dict) -> dict[str, Path | bytes]:
    """What a version directory holds, from a finished job's run directory."""
    files: dict[str, Path | bytes] = {n: run_dir / n for n in VERSION_FILES if (run_dir / n).is_file()}
    files["model.onnx"] = onnx
    files["metrics.json"] = (json.dumps(metrics, indent=2, sort_keys=True) + "\n").encode()
    return files

