"""The device's side of a federated round: a job of the daemon's kind, started from weights received.

A fleet (``edgerev.fleet``, on Flower) asks a device's daemon for two things, and nothing else crosses
from the daemon to the fleet but weights and per-class sample counts (what travels, and how every side builds
the fleet's model from it, is the library's: :mod:`edgerev.fleet.model`):

- **a round** (:func:`train_round`): the fleet model arrives as the shared tensors (which ones is the
  fleet's ``sharing`` setting) and the fleet's class list (the head's rows, in the fleet registry's
  order). The daemon composes a model directory from them and from what it keeps locally (the
  tensors not shared, batch-norm statistics: FedBN), and runs :func:`edgerev_daemon.learning.jobs.run_job` on it
  as the model to start from (at the fleet's ``lr``; when the fleet shares batch-norm statistics, with
  them frozen at the fleet's, and the device's own measured after the job, layer after layer, go back
  with the weights: :func:`measure_norms`): the device's own training samples, the device's
  ``continual`` settings (``continual.distill`` > 0: distillation from the received model on every fleet
  class, LwF), under the daemon's memory cap, checkpointed; the job is a row in the store like any
  other. What keeps the other devices' classes is the averaging; distillation from a fleet model that
  does not know them yet held a non-IID fleet at chance for its first round (docs/guides/fleet.md), so
  the presets turn it off. Its output becomes the device's local state and its shared tensors the reply.
- **a candidate** (:func:`consider`): the aggregated fleet model, composed with the local state the
  same way (and with ``adopt_epochs``, fine-tuned on the device's own samples while distilling from the
  fleet model: a job like a round's), goes through the device's own gate (:func:`fleet_judge`): promoted
  (exported, versioned, ``current`` switched by the daemon's own promotion) only if it is no worse than
  the model in service on this device's recent held-out samples beyond ``promotion.forgetting_margin``,
  with the evidence of a paired exact test at ``promotion.alpha``; the reason is recorded on the version
  either way.

A round interrupted (the daemon stopped, the device dropped out) leaves its job with a checkpoint: the
same round asked again resumes it; a later round supersedes it (the job is marked failed, its folder
removed). Weights with the wrong names or shapes, or not finite, are refused before anything is written;
each refusal is one log line and one event in the store (``edgerev daemon status`` shows it).

Layout: ``DATA_DIR/fleet/local/`` is the device's local state (a model directory); each round's model to
start from (and with ``adopt_epochs``, each fleet model to fine-tune) is written beside its job as
``jobs/job-NNNNN.base/``.
"""

from __future__ import annotations

import logging
import shutil
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from edgerev.atomic import fsync_dir, fsync_tree
from edgerev.errors import EdgerevError
from edgerev.fleet.model import (
    Consideration,
    FleetError,
    FleetModel,
    RoundResult,
    check_shared,
    device_model,
    fleet_head,
    fleet_info,
    to_wire,
)
from edgerev.models.directory import load_tensors, read_info, save_model
from edgerev.train.config import ModelConfig
from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.learning.host import JobHost
from edgerev_daemon.storage.records import EventKind, Job, JobState, Split

if TYPE_CHECKING:
    from edgerev.models.handle import ModelHandle
    from edgerev_daemon.learning.jobs import JobOutcome

log = logging.getLogger("edgerev.daemon.fleet")

JOB_PREFIX = "fleet round "
CANDIDATE_PREFIX = "fleet model "


# the device's local state -----------------------------------------------------------------------------

def fleet_dir(root: Path) -> Path:
    return root / "fleet"


def local_state(root: Path) -> tuple[dict[str, torch.Tensor], tuple[str, ...]] | None:
    """The tensors and classes of the device's last round (``DATA_DIR/fleet/local/``), or None."""
    folder = fleet_dir(root) / "local"
    if not (folder / "model.json").is_file():
        folder = folder.with_name("local.old")  # a stop between the two renames of _replace_dir
        if not (folder / "model.json").is_file():
            return None
    info, raw = read_info(folder)
    return load_tensors(folder / "model.safetensors", raw.get("weights_sha256")), info.classes


def write_model(folder: Path, fm: FleetModel, model: ModelHandle) -> None:
    """A model directory the trainer and the promotion read (weights, description; no replay sample: a
    round trains on all of the device's samples)."""
    if folder.exists():
        shutil.rmtree(folder)
    save_model(folder, model, fleet_info(fm, model), {"fleet_round": fm.round})


def _replace_dir(new: Path, final: Path) -> None:
    """Put the complete folder ``new`` in the place of ``final``; between the renames ``final.old`` holds
    the previous one (:func:`local_state` reads it then)."""
    old = final.with_name(final.name + ".old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        final.rename(old)
    new.rename(final)
    fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def check_source(daemon: JobHost, fm: FleetModel, what: str) -> None:
    """Refuse a fleet model whose ``arch`` is a factory this device's owner has not allowed: the fleet's message
    arrives as data, and a factory's module runs code on import (:mod:`edgerev.models.trust`). A registry name
    or a model source on the device (whose own files are checked when read) passes.

    Raises:
        FleetError: recorded as a refusal.
    """
    from edgerev.models.names import SourceKind, source_kind
    from edgerev.models.trust import ENTRY_POINT_GROUP, allows

    try:
        kind = source_kind(fm.arch)
    except ValueError as e:
        raise refuse(daemon, what, f"the fleet's model: {e}") from None
    if kind is SourceKind.FACTORY and not allows(fm.arch, daemon.config.training.model.factories):
        raise refuse(daemon, what, f"the fleet's model {fm.arch!r} is a factory (code in module "
                                   f"{fm.arch.partition(':')[0]}) that this device's owner has not allowed: allow it, "
                                   f"if you trust its module, in training.model.trust_factories of the daemon's "
                                   f"config, or through an installed package's {ENTRY_POINT_GROUP!r} entry point")


def refuse(daemon: JobHost, what: str, error: str) -> FleetError:
    """One log line and one event for a fleet request refused; the exception to raise."""
    log.error("fleet %s refused: %s", what, error)
    try:
        daemon.store.add_event(EventKind.ERROR, {"where": f"fleet {what}", "error": error})
    except Exception:  # noqa: BLE001 - the refusal matters more than its record (a full disk)
        log.exception("could not record the refusal")
    return FleetError(error)


def device_config(daemon: JobHost, fm: FleetModel, adopt: bool = False) -> DaemonConfig:
    """The daemon's config with the fleet's model, round length and learning rate, batch norms frozen at the
    fleet's statistics once measured (every other key: the device's own). ``adopt``: for the fine-tuning
    before the gate (:func:`consider`): its epochs, learning rate and distillation from the fleet model."""
    t = daemon.config.training
    epochs, lr = (fm.adopt_epochs, fm.adopt_lr or fm.lr) if adopt else (fm.epochs, fm.lr)
    bn_stats = "frozen" if fm.share_bn_stats and fm.norms_measured else t.train.bn_stats
    training = replace(t, model=ModelConfig(arch=fm.arch, args=dict(fm.args), trust_factories=t.model.trust_factories),
                       train=replace(t.train, epochs=epochs, bn_stats=bn_stats),
                       optim=replace(t.optim, lr=lr or t.optim.lr),
                       continual=replace(t.continual, distill=fm.adopt_distill) if adopt else t.continual)
    return replace(daemon.config, training=training)


def measure_norms(daemon: JobHost, folder: Path) -> dict[str, torch.Tensor]:
    """The batch-norm statistics of the model in ``folder`` measured over this device's training samples,
    layer after layer (:func:`edgerev.train.norms.calibrate`, ``train.eval_batch`` images a forward): this
    device's part of the fleet's statistics. Returns the running means and variances by tensor name.

    Each layer is measured behind the layers before it at *this device's* statistics, not the fleet's: a
    layer's input measured behind the fleet's statistics of the round before is a round late, and those
    lags compound over the depth (measured: a fleet of the preset at chance for six rounds)."""
    from edgerev.models.directory import load_model, normalize
    from edgerev.train.norms import calibrate, norms
    from edgerev_daemon.learning.jobs import load_samples

    model, info, _ = load_model(folder, trust_factories=daemon.config.training.model.factories)
    images = load_samples(daemon.store.samples(Split.TRAIN), daemon.blobs, daemon.store.labels()).images
    step = daemon.config.training.train.eval_batch
    calibrate(model, lambda: (normalize(images[k:k + step], info) for k in range(0, len(images), step)))
    return {f"{n}.{k}": getattr(m, k).detach().clone() for n, m in norms(model) for k in ("running_mean",
                                                                                           "running_var")}


def label_counts(daemon: JobHost) -> dict[str, int]:
    """Training samples per label in the device's store (what the fleet registry learns, and nothing more)."""
    counts: dict[str, int] = {}
    for s in daemon.store.samples(Split.TRAIN):
        counts[s.label] = counts.get(s.label, 0) + 1
    return counts


# a round ----------------------------------------------------------------------------------------------

def _round_job(daemon: JobHost, fm: FleetModel) -> Job:
    """The job of this round: the one interrupted (resumed), or a new one; an older round is superseded."""
    store = daemon.store
    reason = f"{JOB_PREFIX}{fm.round}"
    active = store.active_job()
    if active is not None and active.reason == reason:
        return active
    if active is not None and active.reason.startswith(JOB_PREFIX):
        store.set_job_state(active.id, JobState.FAILED, error=f"superseded by {reason}")
        shutil.rmtree(_job_out(daemon, active), ignore_errors=True)
        shutil.rmtree(_job_out(daemon, active).with_suffix(".base"), ignore_errors=True)
    elif active is not None:
        raise refuse(daemon, "round", f"job {active.id} ({active.reason}) is under way; the round waits for it")
    return store.create_job(reason)


def _job_out(daemon: JobHost, job: Job) -> Path:
    from edgerev_daemon.learning.jobs import job_dir

    return job_dir(daemon.config, job)



def _train(daemon: JobHost, job: Job, base: Path, stop: Callable[[], bool] | None, config: DaemonConfig, what: str,
           failed: str) -> JobOutcome:
    """Train ``job`` from the model directory ``base`` as a job of ``daemon``; its outcome.

    Raises:
        FleetError: the training failed (``failed``: what the reason starts with) or was skipped or stopped,
            recorded on the job and refused as ``what`` (:func:`refuse`).
    """
    try:
        outcome = daemon.train(job, base, 0, stop, config)
    except (EdgerevError, OSError, RuntimeError) as e:
        daemon.store.set_job_state(job.id, JobState.FAILED, error=str(e))
        raise refuse(daemon, what, f"{failed}: {e}") from None
    if outcome.status != "trained":
        if outcome.status == "skipped":
            daemon.store.set_job_state(job.id, JobState.FAILED, error=outcome.reason)
        raise refuse(daemon, what, f"job {job.id} {outcome.status}: {outcome.reason}")
    return outcome


def train_round(daemon: JobHost, fm: FleetModel, stop: Callable[[], bool] = lambda: False) -> RoundResult:
    """Run one federated round as a job of ``daemon`` (the service's ``Daemon``, as
    :class:`~edgerev_daemon.learning.host.JobHost`).

    Raises:
        FleetError: the weights do not fit, the cap cannot train the fleet's model, a local job is under
            way, or the round was stopped (it resumes when asked again); logged and recorded.
    """
    import time

    from edgerev.config import ConfigError
    from edgerev_daemon.learning.jobs import check_training, set_running

    check_source(daemon, fm, "round")
    try:
        fresh = check_shared(fm)
    except FleetError as e:
        raise refuse(daemon, "round", str(e)) from None
    if fm.input_size != daemon.config.image_size:
        raise refuse(daemon, "round", f"the fleet trains at {fm.input_size}x{fm.input_size}, this device stores "
                                      f"{daemon.config.image_size}x{daemon.config.image_size} images")
    config = device_config(daemon, fm)
    try:
        check_training(config)
    except ConfigError as e:
        raise refuse(daemon, "round", f"this device's cap cannot train the fleet's model: {e}") from None
    counts = label_counts(daemon)
    if not counts:
        raise refuse(daemon, "round", "no training sample on this device yet")
    job = _round_job(daemon, fm)
    out = _job_out(daemon, job)
    base = out.with_suffix(".base")
    if job.state == JobState.QUEUED:
        job = set_running(daemon.store, daemon.config, job)
    started = time.perf_counter()
    if not (base / "model.json").is_file():
        write_model(base, fm, device_model(fm, fresh, local_state(daemon.config.layout.root)))
    log.info("job %d: %s", job.id, job.reason)
    outcome = _train(daemon, job, base, stop, config, "round", "training failed")
    trained = load_tensors(out / "model.safetensors", read_info(out)[1].get("weights_sha256"))
    if fm.share_bn_stats:  # it trained at the fleet's statistics (or its batches', in round 1): send its own
        trained.update(measure_norms(daemon, out))
    trained = to_wire(trained, fleet_head(fm))
    info, _ = read_info(out)
    # a label this device has and the fleet does not know yet was grown by the trainer after the fleet's
    # rows: it is not sent (the registry learns it from the counts, and the next round carries its row)
    rows = [info.classes.index(c) for c in fm.classes]
    shared = {n: (trained[n][rows] if n.startswith("head.") else trained[n]).contiguous() for n in fm.shared}
    fleet = fleet_dir(daemon.config.layout.root)
    fleet.mkdir(exist_ok=True)
    staged = fleet / "local.new"
    shutil.rmtree(staged, ignore_errors=True)
    shutil.copytree(out, staged, ignore=shutil.ignore_patterns("checkpoints", "*.png", "replay.safetensors"))
    fsync_tree(staged)  # copytree does not: the renamed folder must be whole after a power cut
    _replace_dir(staged, fleet / "local")
    plan = (outcome.summary or {}).get("plan") or {}
    daemon.store.set_job_state(job.id, JobState.DONE)
    shutil.rmtree(out, ignore_errors=True)
    shutil.rmtree(base, ignore_errors=True)
    per_class = [counts.get(c, 0) for c in fm.classes]
    return RoundResult(shared, per_class, sum(per_class), peak_of(plan), plan.get("budget_bytes"), job.id,
                       time.perf_counter() - started)


def peak_of(plan: Mapping) -> int | None:
    """A job's peak training memory: measured by the cap's tracker when it ran, else the plan's prediction."""
    peak = plan.get("measured_peak_bytes") or plan.get("predicted_peak_bytes")
    return int(peak) if peak else None


# a candidate ------------------------------------------------------------------------------------------

def fleet_judge(held, cand, cur, gate) -> tuple[bool, str]:
    """The gate for a fleet model: not worse than the model in service on this device's recent held-out
    samples beyond ``gate.forgetting_margin`` with a p-value at most ``gate.alpha`` (a fleet model knows
    more classes; it need not beat a local model on the local ones: :mod:`edgerev_daemon.learning.evidence`), and
    no known class at 0 % (``promotion.refuse_class_at_zero``)."""
    from edgerev_daemon.learning.evidence import weighed
    from edgerev_daemon.learning.promote import comparisons, dead_reason

    if not any(held.recent):
        return False, "no held-out sample on this device to judge the fleet model on"
    if dead := dead_reason(held, cand, gate):
        return False, f"fleet model refused: {dead}"
    c = sum(r for r, fresh in zip(cand.right, held.recent) if fresh) / sum(held.recent)
    if cur is None:
        return True, f"fleet model, first in service: recent held-out accuracy {c:.4f}"
    now, _ = comparisons(held, cand, cur)
    p = now.p_worse(gate.forgetting_margin)
    counts = f"{now.gained} gained, {now.lost} lost of {now.n}"
    if p <= gate.alpha:
        return False, (f"fleet model worse on this device's recent held-out samples by {100 * -now.change:.1f} points "
                       f"({counts}): {weighed(p, gate.alpha, 'too many losses to be chance', '')}; the model in "
                       "service stays")
    return True, (f"fleet model on this device's recent held-out samples: {100 * now.change:+.1f} points ({counts}): "
                  + weighed(p, gate.alpha, "", f"no evidence of a loss over {100 * gate.forgetting_margin:.1f} points"))


def _fine_tune(daemon: JobHost, job: Job, fm: FleetModel, fresh: dict[str, torch.Tensor], out: Path) -> None:
    """Train ``job``'s candidate into ``out``: the device's copy of the fleet model fine-tuned on the device's
    own samples, distilling from it (:func:`device_config` with ``adopt``), as a job of the daemon (under
    its cap, checkpointed: a consideration interrupted resumes here).

    Raises:
        FleetError: the fine-tuning failed or was stopped (logged and recorded; the job fails or waits).
    """
    base = out.with_suffix(".base")
    if not (base / "model.json").is_file():
        write_model(base, fm, device_model(fm, fresh, local_state(daemon.config.layout.root)))
    _train(daemon, job, base, None, device_config(daemon, fm, adopt=True), "model",
           "fine-tuning the fleet model failed")
    shutil.rmtree(base, ignore_errors=True)


def consider(daemon: JobHost, fm: FleetModel) -> Consideration:
    """Put the aggregated model ``fm`` through this device's gate; promote it (the daemon's own promotion:
    export, version directory, ``current`` switched) when it passes. The decision and its reason are
    recorded on a version row either way."""
    from edgerev_daemon.learning.jobs import job_dir, set_running
    from edgerev_daemon.learning.promote import figures, held_out, score

    check_source(daemon, fm, "model")
    try:
        fresh = check_shared(fm)
    except FleetError as e:
        raise refuse(daemon, "model", str(e)) from None
    store = daemon.store
    reason = f"{CANDIDATE_PREFIX}{fm.round}"
    active = store.active_job()
    if active is not None:
        if active.reason != reason and not active.reason.startswith(CANDIDATE_PREFIX):
            raise refuse(daemon, "model", f"job {active.id} ({active.reason}) is under way; the fleet model waits")
        if active.reason != reason:
            store.set_job_state(active.id, JobState.FAILED, error=f"superseded by {reason}")
            shutil.rmtree(job_dir(daemon.config, active), ignore_errors=True)
            shutil.rmtree(job_dir(daemon.config, active).with_suffix(".base"), ignore_errors=True)
            active = None
    job = active or store.create_job(reason)
    out = job_dir(daemon.config, job)
    if job.state == JobState.QUEUED:
        job = set_running(store, daemon.config, job)
    log.info("job %d: %s", job.id, job.reason)
    current, _, _ = daemon.base()
    done = daemon.decided(job)
    if done is not None:  # decided before a crash: finish that decision
        result = daemon.carry_out(job, done, out)
        return Consideration(bool(result.get("promoted")), done.reason, done.id,
                             done.metrics.get("evaluation", {}).get("candidate", {}).get("all"), 0, done.metrics)
    if fm.adopt_epochs:
        _fine_tune(daemon, job, fm, fresh, out)
    else:
        write_model(out, fm, device_model(fm, fresh, local_state(daemon.config.layout.root)))
    gate = daemon.config.promotion
    held = held_out(store, daemon.blobs, job, gate.recent_window_days)
    trust = daemon.config.training.model.factories
    cand = score(out, held, trust)
    cur = score(current, held, trust) if current is not None else None
    promote, why = fleet_judge(held, cand, cur, gate)
    old = None if cur is None else set(cur.known)
    samples = {"all": len(held.labels), "recent": sum(held.recent)}
    metrics = {"data_batch_id": job.data_batch_id, "base_batch": 0, "promote": promote, "fleet_round": fm.round,
               "fine_tuned_epochs": fm.adopt_epochs,
               "evaluation": {"candidate": figures(held, cand, old),
                              **({"current": figures(held, cur, old)} if cur else {}), "heldout_samples": samples},
               "classes": list(fm.classes)}
    result = daemon.record_decision(job, out, metrics, why)
    version = result.get("version")
    accuracy = metrics["evaluation"]["candidate"]["all"]
    if result.get("status") == "failed":
        return Consideration(False, result.get("error", why), version, accuracy, samples["all"], metrics)
    return Consideration(bool(result.get("promoted")), why, version, accuracy, samples["all"], metrics)
