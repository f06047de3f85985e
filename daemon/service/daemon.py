"""The service: one cycle is ingest, then (when due) train, evaluate, promote or keep, export.

:class:`Daemon` owns the data directory for its lifetime (the single-instance lock). Opening it
repairs what a crash can leave: partial version directories and temporary links, orphan blobs, a
``current`` link the store had not yet recorded, a job that was running (queued again, so it
resumes from its checkpoint). :meth:`Daemon.cycle` takes the time as an argument (huey's
``loop(now)``): tests drive the schedule instead of sleeping. :meth:`Daemon.serve` is the
long-running loop of ``edgerev daemon run``.

Every step that changes state is safe to interrupt (kill -9, power cut) and to run again:

- ingest records a file before removing it (see :mod:`edgerev_daemon.intake.ingest`);
- a job trains in ``jobs/<id>/`` with checkpoints and is resumed, not restarted;
- the promotion decision is recorded (a version row) before the version directory is written, the
  directory is complete before ``current`` switches, and a job is only marked done after that, so a
  restart finishes a promotion it finds half done instead of deciding again.

A stop (SIGTERM) is honoured within a bounded time in every phase: between two inbox files, every 256
samples a job decodes, after the training step under way, between the batches of an evaluation (the
trainer's and the gate's), and at once during the ONNX export and a model's first stage profile, which run
in child processes the stop kills (:mod:`edgerev_daemon.learning.children`); a promotion whose version
directory is being written finishes (a fraction of a second), so ``current`` is the old version or the new
one. ``benchmarks/stop_latency.py`` measures each phase. ``edgerev daemon run`` then ends without the
interpreter's teardown (:mod:`edgerev_daemon.service.cli`).

Nothing that cannot be recreated is destroyed: a lost or damaged store next to blobs or a journal is
refused before it is opened (:func:`edgerev_daemon.storage.rebuild.guard_start`), journal lines the store lacks
are recorded again at start, and a blob is only removed on the word of an intact store that holds
samples. Storage faults (a full disk, an I/O error) are conditions, not crashes
(:mod:`edgerev_daemon.storage.faults`): logged once, ingest and training wait, status keeps being served, and
the cycle resumes by itself when they clear; below ``storage.min_free_space`` ingest and training wait
before the disk is full at all.
"""

from __future__ import annotations

import logging
import shutil
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from edgerev.errors import EdgerevError
from edgerev.export.runtime import onnxruntime
from edgerev.train.progress import Progress
from edgerev.train.semi import semi_counts
from edgerev_daemon.config import DaemonConfig, load_config, validate_paths
from edgerev_daemon.errors import Stopped
from edgerev_daemon.intake.ingest import ingest_inbox
from edgerev_daemon.intake.watch import InboxWatch
from edgerev_daemon.layout import prepare
from edgerev_daemon.learning import answers, questions
from edgerev_daemon.learning.base import names_base, write_base
from edgerev_daemon.learning.exporting import export
from edgerev_daemon.learning.handoff import serve_requests
from edgerev_daemon.learning.jobs import JobOutcome, check_training, job_dir, run_job, set_running
from edgerev_daemon.learning.profiling import ensure_profile
from edgerev_daemon.learning.promote import decide, held_out, version_files
from edgerev_daemon.learning.schedule import Schedule, daemon_schedule, listed
from edgerev_daemon.service.lock import DataDirLock
from edgerev_daemon.service.memory import give_back
from edgerev_daemon.service.notify import Notifier
from edgerev_daemon.service.signals import Requests
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.check import check_consistency, remove_garbage
from edgerev_daemon.storage.faults import Conditions, free_bytes, storage_fault
from edgerev_daemon.storage.rebuild import damage, guard_start, refusal, replay
from edgerev_daemon.storage.records import EventKind, Job, JobState, Version
from edgerev_daemon.storage.registry import Registry
from edgerev_daemon.storage.retention import enforce, finish_removals, fits_disk
from edgerev_daemon.storage.store import Store
from edgerev_daemon.storage.usage import DiskUsage

log = logging.getLogger("edgerev.daemon")

CYCLE_ERRORS = (EdgerevError, OSError, sqlite3.Error)  # what a cycle may raise without ending the service


@dataclass
class CycleReport:
    ingest: dict = field(default_factory=dict)
    job: dict | None = None
    due: str | None = None
    waiting: str | None = None  # a storage condition kept this cycle from ingesting or training
    not_due: str | None = None  # why no job ran (the schedule's word: samples still needed, a back-off)
    fleet: int = 0  # fleet requests carried out (edgerev_daemon.learning.handoff)
    base: str | None = None  # the version the base model was installed as (edgerev_daemon.learning.base)
    storage: dict | None = None  # the storage budget's check (edgerev_daemon.storage.retention)
    answers: int = 0  # requests of answers applied (edgerev_daemon.learning.answers)
    questions: int | None = None  # the questions of a new list, when this cycle made one

    def to_json(self) -> dict:
        return {"ingest": self.ingest, "due": self.due, "not_due": self.not_due, "job": self.job,
                "waiting": self.waiting, "fleet": self.fleet, "storage": self.storage, "answers": self.answers,
                "questions": self.questions}

    def summary(self) -> str:
        """One line for systemd's STATUS=: what this cycle did."""
        i = self.ingest or {}
        parts = [f"ingest {i.get('accepted', 0)} stored"] if i else []
        if i.get("budget"):
            parts.append("the rest of the inbox waits for the storage budget")
        if self.job is not None:
            j = self.job
            what = j.get("status") or ("promoted" if j.get("promoted") else "kept out")
            parts.append(f"job {j.get('job')} {what}" + (f" ({j['version']})" if j.get("version") else ""))
        elif self.not_due:
            parts.append(f"next job: {self.not_due}")
        if self.waiting:
            parts.append(f"waiting for {self.waiting}")
        return "; ".join(parts) or "idle"

    @property
    def failed(self) -> bool:
        """The cycle did not do what it should: its job failed, or a storage condition held it back."""
        return self.waiting is not None or (self.job is not None and self.job.get("status") == "failed")


class Daemon:
    """The data directory of ``config``, held (locked) until :meth:`close`.

    Args:
        config: the daemon's configuration (paths are validated before anything is touched).
        config_path: the file it came from (re-read on :meth:`request_reload`).
        clock: seconds since the epoch (tests inject their own).
        requests: the stop and reload flags the signal handlers set (the CLI makes them before the
            daemon starts, so a signal during the start is not lost); by default the daemon's own.
        notifier: systemd's notification socket (by default from the environment; nothing outside systemd).
    """

    def __init__(self, config: DaemonConfig, config_path: str | Path | None = None,
                 clock: Callable[[], float] = time.time, requests: Requests | None = None,
                 notifier: Notifier | None = None) -> None:
        self.notifier = notifier if notifier is not None else Notifier()
        validate_paths(config)
        check_training(config)
        onnxruntime()  # every promoted version is exported and verified with it: refuse to start without
        self.config, self.config_path, self.clock = config, config_path, clock
        self.lock = DataDirLock(config.data_dir).acquire()
        try:
            prepare(config.layout, config.inbox_path)
            guard_start(config, config_path)
            self.blobs = BlobStore(config.layout.blobs)
            self.registry = Registry(config.layout.root)
            self.conditions = Conditions(lambda k, m, r: self.store.add_event(k, m, repeat=r), clock)
            self.store: Store | None = None
            self._recovered = False
            self._try_recover()  # on a full disk: comes up anyway, and retries at every cycle
        except BaseException:
            if getattr(self, "store", None) is not None:
                self.store.close()
            self.lock.release()
            raise
        # set from signal handlers: plain booleans and a self-pipe, nothing that takes a lock (signals.py)
        self._owns_requests = requests is None
        self.requests = Requests() if requests is None else requests
        self.watch = InboxWatch()  # settling and reported folders, across this process's cycles
        self._base_checked = False  # this process looked at training.model's base model (edgerev_daemon.learning.base)
        self.usage = DiskUsage(config.layout)  # caches each blob folder's sum between cycles
        self._say_if_budget_cannot_fit()

    # lifecycle --------------------------------------------------------------------------------------

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
        if self._owns_requests:
            self.requests.close()
        self.lock.release()

    def __enter__(self) -> Daemon:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def request_stop(self) -> None:
        """Finish the current training step (or ingest batch), checkpoint, and leave (SIGTERM).

        Safe to call from a signal handler, any number of times, re-entered or not: it sets a flag and
        writes a byte to a pipe, and takes no lock (see :mod:`edgerev_daemon.service.signals`).
        """
        self.requests.ask_stop()

    def request_reload(self) -> None:
        """Re-read the config file before the next cycle (SIGHUP); a burst of requests is one reload.

        Safe to call from a signal handler, like :meth:`request_stop`.
        """
        self.requests.ask_reload()

    @property
    def stopping(self) -> bool:
        return self.requests.stop

    def _try_recover(self) -> bool:
        """Open the store and :meth:`_recover`, with a storage fault turned into a condition (retried at
        the next cycle): on a full disk SQLite may not even open."""
        try:
            if self.store is None:
                guard_start(self.config, self.config_path)  # what could not be read at start is checked now
                self.store = Store(self.config.layout.database, self.clock)
            self._recover()
        except CYCLE_ERRORS as e:
            why = storage_fault(e)
            if why is None:
                damaged = damage(e)
                if damaged is not None:  # what guard_start's check of the file could not see: refused the same way
                    raise refusal(self.config.layout, damaged, self.config_path) from e
                raise
            self.conditions.begin("storage", f"start-up repair waits: {why}")
            return False
        self._recovered = True
        return True

    def _recover(self) -> None:
        removed = self.registry.recover()
        if removed:
            log.warning("removed what an interrupted promotion left: %s", ", ".join(removed))
        if self.store.ensure_journal():
            log.warning("wrote the journal %s from the store's %d samples", self.store.journal.path,
                        self.store.count_samples())
        finish_removals(self.store, self.blobs)  # before the replay: a removed sample is not recorded again
        replayed = replay(self.store, self.blobs)
        if replayed:
            log.warning("recorded %d samples from the journal that the store lacked", replayed)
            self.store.add_event(EventKind.INFO, {"message": f"{replayed} samples recorded again from the journal"})
        report = check_consistency(self.store, self.blobs, verify=False, inbox=self.config.inbox_path)
        if report.orphans or report.strays:
            log.info("removed %d orphan or stray blob files", remove_garbage(report, self.blobs))
        if not report.ok:
            log.error("store inconsistent: %d samples without blob, database: %s", len(report.missing),
                      "; ".join(report.database) or "ok")
            self.store.add_event(EventKind.ERROR, {"where": "startup check", "error": report.to_json()})
        self._repair_current()
        current = self.registry.current()
        if current is not None:
            v = self.store.get_version(current)
            if v is not None and not v.promoted:  # killed between the switch and its record
                self.store.update_version(current, promoted=True, reason=v.reason)
            if self.store.in_service() != current:
                self.store.set_in_service(current)
        job = self.store.active_job()
        if job is not None and job.state == JobState.RUNNING:
            self.store.set_job_state(job.id, JobState.QUEUED)
            log.info("job %d was interrupted; it resumes from its checkpoint", job.id)

    def _repair_current(self) -> None:
        """Restore a missing, dangling or replaced ``current`` from the store's record of the version in
        service (or, for a store that never recorded one, the newest promoted version on disk)."""
        state, _ = self.registry.link_state()
        if state == "ok":
            return
        recorded = self.store.in_service()
        promoted = [v.id for v in self.store.versions(promoted_only=True)]
        target = self.registry.latest_complete([recorded]) if recorded else None
        target = target or self.registry.latest_complete(promoted)
        if target is None:
            if state != "missing":
                log.error("%s %s, and no complete promoted version to restore it to", self.registry.link, state)
                self.store.add_event(EventKind.ERROR, {"where": "current", "error": f"current {state}"})
            return
        what = self.registry.repair(target)
        log.warning("%s", what)
        self.store.add_event(EventKind.ERROR, {"where": "current", "error": what})

    def _maintain(self, now: float) -> None:
        """Keep the event log within its bounds (age and count), at every cycle."""
        if self.store is None:
            return
        e = self.config.events
        try:
            self.store.prune_events(keep=e.keep_count, before=now - e.keep_days * 86400.0)
        except CYCLE_ERRORS as err:
            if storage_fault(err) is None:
                raise

    def _say_if_budget_cannot_fit(self) -> None:
        """Log (and record) at start when ``storage.max_bytes`` is more than the disk can give the daemon."""
        try:
            why = fits_disk(self.config, self.usage.measure())
        except OSError:
            return
        if why is not None:
            log.warning("%s", why)
            self.conditions.event(EventKind.ERROR, {"where": "storage budget", "error": why})

    def _budget(self, report: CycleReport) -> str | None:
        """Check the storage budget and remove what the retention policy says (at every cycle); returns why
        the data directory is still over it (ingest waits), or None."""
        if self.store is None or not self._recovered:
            return None
        try:
            budget = enforce(self.config, self.store, self.blobs, self.usage)
        except CYCLE_ERRORS as e:
            why = storage_fault(e)
            if why is None:
                raise
            self.conditions.begin("storage budget removal", f"waits: {why}")
            return None
        self.conditions.end("storage budget removal")
        report.storage = budget.to_json()
        if budget.over is None:
            self.conditions.end("storage budget")
            return None
        self.conditions.begin("storage budget", f"{budget.over}; ingest waits")
        return budget.over

    def _disk_low(self) -> str | None:
        floor = self.config.storage.min_free_space
        free = free_bytes(self.config.layout.root) if floor else None
        if free is None or free >= floor:
            return None
        return (f"{free} bytes free in {self.config.layout.root}, below storage.min_free_space ({floor}): "
                "ingest and training wait for space")

    # the cycle --------------------------------------------------------------------------------------

    def base(self) -> tuple[Path | None, int, str | None]:
        """(current version directory, the last ingest batch it was trained on, its name)."""
        name = self.registry.current()
        if name is None:
            return None, 0, None
        v = self.store.get_version(name)
        return self.registry.path(name), int(v.metrics.get("data_batch_id", 0)) if v else 0, name

    def _install_base(self) -> str | None:
        """Make ``training.model``'s base model version ``v0001`` when it is due (:mod:`edgerev_daemon.learning.base`):
        a base model with class names, and no version yet (or the base recorded and not yet promoted).
        Returns the version installed, or None."""
        t = self.config.training
        if not names_base(t):
            self._base_checked = True
            return None
        versions = self.store.versions()
        recorded = next((v for v in versions if v.metrics.get("base")), None)
        if (recorded is None and (versions or self.registry.current() is not None)) or \
                (recorded is not None and recorded.promoted):
            self._base_checked = True
            return None
        out = self.config.layout.jobs / "base"
        if not write_base(self.config, out):
            log.info("the base model %s names no classes: the first job starts from its weights", t.model.arch)
            self._base_checked = True
            return None
        version = recorded or self.store.add_version(
            None, None, promoted=False, metrics={"base": t.model.arch, "data_batch_id": 0, "promote": True},
            reason=f"the base model {t.model.arch}")
        try:
            self._promote(version, out, None)
        except Stopped:
            return None  # recorded: the next start installs it
        shutil.rmtree(out, ignore_errors=True)
        self._base_checked = True
        log.info("installed the base model %s as %s", t.model.arch, version.id)
        return version.id

    def due(self, now: float) -> str | None:
        """Why a job should run now, or None (:func:`edgerev_daemon.learning.schedule.next_job` says why not)."""
        return self.schedule(now).due

    def schedule(self, now: float) -> Schedule:
        """When the next job runs, or why not yet (:func:`edgerev_daemon.learning.schedule.next_job`)."""
        return daemon_schedule(self.config, self.store, self.registry.current_classes(), now)

    def cycle(self, now: float | None = None) -> CycleReport:
        """Ingest, then train, evaluate and promote if a job is due; then give back to the system the memory the
        cycle freed (:mod:`edgerev_daemon.service.memory`: otherwise the RSS keeps the largest job's)."""
        try:
            return self._cycle(now)
        finally:
            give_back()

    def _cycle(self, now: float | None) -> CycleReport:
        now = self.clock() if now is None else now
        report = CycleReport()
        self._maintain(now)
        if not self._recovered and not self._try_recover():
            report.waiting = "storage"
            return report
        over = self._budget(report)  # first: removing samples may also lift the free-space floor below
        low = self._disk_low()
        if low is not None:
            self.conditions.begin("disk space", low)
            report.waiting = "disk space"
            return report
        self.conditions.end("disk space")
        try:
            if not self._base_checked:
                report.base = self._install_base()
                if self.stopping:
                    return report
            # the first cycle (all of `once`) waits settle_seconds once for files not yet seen settled
            if over is None:
                report.ingest = ingest_inbox(self.config, self.store, self.clock, stop=self._alive,
                                             watch=self.watch, wait=self.requests.wakeup.wait,
                                             usage=self.usage).to_json()
            else:
                report.waiting = "storage budget"  # the job still runs: it may be what holds the samples
            if self.stopping:
                return report
            # a fleet's requests (a SuperNode beside this running daemon) come before the daemon's own job
            report.fleet = serve_requests(self, self._alive)
            # the owner's answers handed over by `edgerev daemon label` or the page: they may make a job due
            report.answers = answers.serve(self.config, self.store)
            if self.stopping:
                return report
            schedule = self.schedule(now)
            report.due, report.not_due = schedule.due, schedule.waiting
            if report.due is not None:
                report.job = self.run_job(report.due)
            if not self.stopping:  # after a job (promoted or not), a rollback, or new unlabelled samples
                asked = questions.refresh_if_due(self.config, self.store, self.blobs, self.registry, self.clock(),
                                                 self._alive)
                report.questions = None if asked is None else len(asked.questions)
        except CYCLE_ERRORS as e:
            why = storage_fault(e)
            if why is None:
                raise
            self.conditions.begin("storage", why)
            report.waiting = "storage"
            return report
        self.conditions.end("storage")
        return report

    def run_job(self, reason: str) -> dict:
        job = self.store.active_job() or self.store.create_job(reason)
        out = job_dir(self.config, job)
        if job.state == JobState.QUEUED:
            job = set_running(self.store, self.config, job)
        log.info("job %d: %s", job.id, reason)
        current, base_batch, current_name = self.base()
        done = self.decided(job)
        if done is not None:  # decided before a crash: finish that decision instead of deciding again
            return self.carry_out(job, done, out)
        try:
            outcome = self.train(job, current, base_batch)
        except (EdgerevError, OSError, RuntimeError) as e:
            return self._fail(job, f"training failed: {e}")
        if outcome.status == "stopped":
            log.info("job %d %s; it resumes at the next start", job.id, outcome.reason)
            return {"job": job.id, "status": "stopped", "reason": outcome.reason}
        if outcome.status == "skipped":
            self.store.set_job_state(job.id, JobState.DONE)
            self.store.add_event(EventKind.INFO, {"message": f"job {job.id} skipped: {outcome.reason}"})
            shutil.rmtree(out, ignore_errors=True)
            return {"job": job.id, "status": "skipped", "reason": outcome.reason}
        gate = self.config.promotion
        try:
            held = held_out(self.store, self.blobs, job, gate.recent_window_days, outcome.held_back, self._alive)
            decision = decide(outcome.run_dir, current, held, gate, self._alive, self.config.training.model.factories)
        except Stopped as e:  # the trained candidate waits in its folder: the next start evaluates it again
            return self._stopped(job, e)
        summary = outcome.summary or {}
        metrics = {"data_batch_id": job.data_batch_id, "base_batch": base_batch, "promote": decision.promote,
                   "evaluation": decision.metrics, "classes": summary.get("classes"),
                   "training": {k: summary.get(k) for k in ("steps", "train_samples", "forgetting", "plan",
                                                            "stopped_early")}
                   | {"semi": semi_counts(summary.get("semi"))},
                   "held_back": outcome.held_back}
        return self.record_decision(job, out, metrics, decision.reason)

    # a job's steps, for a job another module drives (a fleet round: edgerev_daemon.learning.fleet) ----------

    def train(self, job: Job, start: Path | None, base_batch: int, stop: Callable[[], bool] | None = None,
              config: DaemonConfig | None = None) -> JobOutcome:
        """Train (or resume) ``job``'s candidate from the model directory ``start`` as every job trains:
        under the cap, checkpointed, stopping at a step boundary when the daemon is asked to stop (or
        ``stop()`` says so), its progress and held-back labels logged and reported.

        Args:
            base_batch: the last ingest batch ``start`` was trained on (0: train on every sample).
            config: the daemon's config with another model or recipe (a fleet's); default: the daemon's.
        """
        extra = stop or (lambda: False)

        def halt() -> bool:
            return self._alive() or extra()

        config = config or self.config
        try:  # a model's first job measures its stage profile, in a child process that a stop ends
            if ensure_profile(config, job_dir(self.config, job), halt):
                log.info("job %d: measured the stage profile of %s", job.id, config.training.model.arch)
        except Stopped as e:
            return JobOutcome("stopped", job_dir(self.config, job), f"stopped in {e}")
        outcome = run_job(config, self.store, self.blobs, job, start, base_batch, halt,
                          report=lambda p: self._progress(job.id, p))
        if outcome.held_back:
            self._report_held_back(job.id, outcome.held_back)
        return outcome

    def decided(self, job: Job) -> Version | None:
        """The decision recorded on ``job``'s candidate (a crash came before it was carried out), or None."""
        found = [v for v in self.store.versions() if v.job_id == job.id]
        return found[-1] if found else None

    def record_decision(self, job: Job, out: Path, metrics: dict, reason: str) -> dict:
        """Record the gate's decision on the candidate in ``out`` (``metrics["promote"]``, and why) as a
        version whose parent is the model in service, then carry it out (:meth:`carry_out`)."""
        version = self.store.add_version(job.id, self.registry.current(), promoted=False, metrics=metrics,
                                         reason=reason)
        log.info("job %d: candidate %s %s: %s", job.id, version.id,
                 "promoted" if metrics.get("promote") else "kept out", reason)
        return self.carry_out(job, version, out)

    def carry_out(self, job: Job, version: Version, out: Path) -> dict:
        """Carry out the recorded decision (idempotent): promote the candidate in ``out`` (export, version
        directory, ``current`` switched) if it was to be, then mark the job done and remove ``out``."""
        result = {"job": job.id, "version": version.id, "promoted": False, "reason": version.reason}
        parent = version.parent_id  # what was in service when it was decided: what a rollback goes back to
        if version.metrics.get("promote") and not version.promoted:
            try:
                self._promote(version, out, parent)
            except Stopped as e:  # the decision is recorded: the next start carries it out
                return self._stopped(job, e) | {"version": version.id}
            except (OSError, EdgerevError) as e:  # a full disk, a failed export: the current model stays
                reason = f"promotion failed, {parent or 'no model'} stays in service: {e}"
                self.store.update_version(version.id, reason=reason)
                return self._fail(job, reason) | {"version": version.id}
            result["promoted"] = True
        elif version.promoted:
            result["promoted"] = True
        self.store.set_job_state(job.id, JobState.DONE)
        shutil.rmtree(out, ignore_errors=True)
        return result

    def _report_held_back(self, job_id: int, waiting: dict[str, int]) -> None:
        minimum = self.config.training.min_samples_per_label
        line = (f"job {job_id}: held back (fewer than {minimum} training samples): "
                + listed(waiting))
        log.info("%s", line)
        self.store.add_event(EventKind.INFO, {"message": line})

    def _progress(self, job_id: int, progress: Progress) -> None:
        """A training report: one log line, and systemd's ``STATUS=``."""
        line = f"job {job_id}: {progress.line()}"
        log.info("%s", line)
        self.notifier.status(line)

    def _promote(self, version: Version, out: Path, current_name: str | None) -> None:
        """Export, write the version directory, switch ``current`` to it, prune old versions.

        A stop is honoured until the version directory is written (:class:`Stopped`): the export runs in
        a child process that a stop kills (:mod:`edgerev_daemon.learning.exporting`). From the write on, the
        promotion finishes (a fraction of a second: files of a few MB fsynced, a link renamed), so a
        stop finds ``current`` on the old version or the new one, and the store saying the same.
        """
        if not self.registry.path(version.id).is_dir():
            onnx = out / "model.onnx"
            metrics = dict(version.metrics)
            metrics["export"] = export(out, onnx, self._alive, self.config.training.train.threads,
                                       self.config.training.model.factories, self.config.promotion.exporter)
            if self._alive():
                raise Stopped("the promotion (exported, the version not yet written)")
            self.registry.write(version.id, version_files(out, onnx, metrics))
        protect = [current_name] if current_name else []  # the version a rollback would go back to
        protect += [v.id for v in self.store.versions() if v.metrics.get("base")]  # the last resort
        self.registry.switch(version.id)
        self.store.update_version(version.id, promoted=True, reason=version.reason)
        self.store.set_in_service(version.id)
        pruned = self.registry.prune(self.config.promotion.keep_last, protect=set(protect))
        if pruned:
            log.info("pruned versions %s", ", ".join(pruned))

    def _stopped(self, job: Job, stopped: Stopped) -> dict:
        """A job asked to stop in ``stopped``'s phase: it stays running in the store (queued again at the
        next start, which resumes it where it left off)."""
        reason = f"stopped in {stopped}"
        log.info("job %d %s; it resumes at the next start", job.id, reason)
        return {"job": job.id, "status": "stopped", "reason": reason}

    def _fail(self, job: Job, error: str) -> dict:
        log.error("job %d: %s", job.id, error)
        self.store.set_job_state(job.id, JobState.FAILED, error=error)
        return {"job": job.id, "status": "failed", "error": error}

    # rollback ---------------------------------------------------------------------------------------

    def rollback(self, to: str | None = None) -> str:
        """Switch ``current`` to version ``to`` (default: the promoted version before the current one)."""
        from edgerev_daemon.storage.registry import RegistryError

        if not self._recovered and not self._try_recover():
            raise RegistryError("the data directory cannot be written now (a storage fault, see the log); "
                                "free space, then roll back")
        current = self.registry.current()
        on_disk = set(self.registry.versions())
        promoted = [v.id for v in self.store.versions(promoted_only=True) if v.id in on_disk]
        if to is None:
            earlier = [v for v in promoted if current is None or int(v[1:]) < int(current[1:])]
            if not earlier:
                raise RegistryError(f"no earlier promoted version on disk to roll back to (current: {current})")
            to = earlier[-1]
        if to not in on_disk:
            raise RegistryError(f"version {to} is not on disk (kept: {', '.join(sorted(on_disk)) or 'none'})")
        self.registry.switch(to)
        self.store.set_in_service(to)
        self.store.add_event(EventKind.ROLLBACK, {"from": current, "to": to})
        log.info("rolled back from %s to %s", current, to)
        try:  # the questions were the old version's doubts
            questions.refresh(self.config, self.store, self.blobs, self.registry, self.clock())
        except CYCLE_ERRORS as e:
            log.warning("questions not refreshed after the rollback (the next cycle tries again): %s", e)
        return to

    # the long-running loop --------------------------------------------------------------------------

    def _alive(self) -> bool:
        """Asked at every training step and between ingest batches: pings systemd's watchdog (a wedged
        loop stops pinging), and says whether to stop."""
        self.notifier.watchdog()
        return self.stopping

    def serve(self, poll_seconds: float = 5.0) -> None:
        """Cycle until :meth:`request_stop`; wait ``poll_seconds`` between cycles (a request wakes it).

        The logging a signal deserves happens here, never in its handler: the handler only set a flag.
        Under systemd (``Type=notify``) it says ``READY=1`` before the first cycle, a ``STATUS=`` line after
        each, and pings the watchdog (:mod:`edgerev_daemon.service.notify`).
        """
        log.info("serving %s (inbox %s)", self.config.data_dir, self.config.inbox_path)
        self.notifier.ready(f"serving {self.config.data_dir}")
        self.notifier.watchdog()  # the first ping at once: a first cycle may stop before any wait
        while not self.stopping:
            if self.requests.reload:
                self._apply_reload()
            try:
                report = self.cycle()
            except CYCLE_ERRORS as e:  # keep running: the next cycle tries again (logged once while it lasts)
                self.conditions.begin("cycle failed", str(e))
                self.notifier.status(f"cycle failed: {e}")
            else:
                self.conditions.end("cycle failed")
                self.notifier.status(report.summary())
            if self.stopping:
                break
            self._sleep(poll_seconds)
        self.notifier.stopping()
        log.info("stopped")

    def _sleep(self, seconds: float) -> None:
        """Wait ``seconds`` or until a request, pinging the watchdog at its pace meanwhile."""
        end = time.monotonic() + seconds
        half = self.notifier.watchdog_seconds / 2 if self.notifier.watchdog_seconds else seconds
        while True:
            self.notifier.watchdog()
            left = end - time.monotonic()
            if left <= 0 or self.requests.wakeup.wait(min(left, half)):
                return

    def _apply_reload(self) -> None:
        # cleared before reading, so a request that lands while the file is read is not lost: it reloads again
        self.requests.reload = False
        if self.config_path is None:
            return
        try:
            new = load_config(self.config_path)
            if new.data_dir != self.config.data_dir:
                raise EdgerevError("data_dir cannot change while the daemon runs; restart it")
            validate_paths(new)
        except EdgerevError as e:
            log.error("config not reloaded, the old one stays: %s", e)
            return
        self.config = new
        log.info("config reloaded from %s", self.config_path)
