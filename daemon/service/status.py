"""What the daemon is doing, read from the store and the version registry (never from the process).

Readers do not take the single-instance lock: SQLite's write-ahead log lets them read while the
daemon writes, so ``edgerev daemon status`` and the HTTP page work beside a running daemon.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

from edgerev_daemon.config import DaemonConfig
from edgerev_daemon.errors import DaemonError
from edgerev_daemon.layout import Layout
from edgerev_daemon.learning.schedule import daemon_schedule, held_back, listed
from edgerev_daemon.storage.records import JobState, Split
from edgerev_daemon.storage.registry import Registry, RegistryError
from edgerev_daemon.storage.store import Store


def holder_pid(config: DaemonConfig) -> int | None:
    """The pid of the daemon holding the data directory, or None if none runs."""
    import fcntl

    path = config.layout.lock
    if not path.exists():
        return None
    fd = os.open(path, os.O_RDONLY)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = os.pread(fd, 32, 0).decode(errors="replace").strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def status(config: DaemonConfig, events: int = 10, clock: Callable[[], float] = time.time) -> dict:
    """A JSON-ready snapshot: samples, labels, the model in service, versions, jobs, recent events.

    ``events``: how many of the latest events to include, as lines (:func:`~edgerev_daemon.service.events.fold`:
    a version's decision and its promotion are one line, a job's states one line). ``clock`` gives the time the
    schedule is judged at (injected by tests: two snapshots of an idle daemon taken a second apart are then
    equal).

    Raises:
        DaemonError: the data directory holds no store yet (the daemon never ran there).
    """
    from edgerev_daemon.errors import StoreError
    from edgerev_daemon.storage.faults import free_bytes, storage_fault
    from edgerev_daemon.storage.rebuild import evidence, store_state
    from edgerev_daemon.storage.retention import budget_status

    db = config.layout.database
    why = store_state(db, thorough=False)  # read-only: a lost store is reported, never replaced by an empty one here
    if why is not None:
        found = evidence(config.layout)
        if found:
            raise DaemonError(f"{db} {why}, next to {found.describe()}: the daemon refuses to start; run edgerev "
                              "daemon rebuild --config CONFIG" + (" --move-aside" if why != "is missing" else ""))
        raise DaemonError(f"{config.data_dir} holds no store yet: start the daemon (edgerev daemon run or once)")
    registry = Registry(config.layout.root)
    free, floor = free_bytes(config.layout.root), config.storage.min_free_space
    low = free is not None and floor > 0 and free < floor
    try:
        store, snapshot = Store(db), False
    except StoreError as e:
        if storage_fault(e) is None:
            raise
        store, snapshot = Store.snapshot(db), True  # a full disk: SQLite cannot create its shared memory
    with store:
        counts = store.counts()
        try:
            current = registry.current()
        except RegistryError as e:
            current = f"broken: {e}"
        link, _ = registry.link_state()
        versions = store.versions()
        cur = next((v for v in versions if v.id == current), None)
        active = store.active_job()
        last = store.last_job()
        quarantine = config.layout.quarantine
        return {
            "data_dir": config.data_dir,
            "inbox": str(config.inbox_path),
            "daemon_pid": holder_pid(config),
            # labelled samples are in a split; unlabelled ones wait for a label (no training, no held-out)
            "samples": {"total": store.count_samples(), "train": store.count_samples(Split.TRAIN),
                        "heldout": store.count_samples(Split.HELDOUT), "labeled": store.count_samples(labeled=True),
                        "unlabeled": store.count_samples(labeled=False)},
            "labels": store.labels(),
            # too few training samples to be trained as a class yet: label -> its training samples
            "labels_held_back": held_back(store, None, config.training.min_samples_per_label),
            "new_samples_since_last_job": store.new_samples_since_last_job(),
            "schedule": daemon_schedule(config, store, registry.current_classes(), clock()).to_json(),
            "inbox_problems": store.inbox_problems(),
            "quarantined_files": sum(1 for p in quarantine.iterdir() if not p.name.endswith(".reason.json"))
            if quarantine.is_dir() else 0,
            "current": None if current is None else _current(current, cur, registry),
            "versions": [_version(v, registry) for v in versions],
            "job": None if (active or last) is None else _job(active or last, config.layout),
            "jobs_failed": sum(1 for j in store.jobs(limit=1000) if j.state == JobState.FAILED),
            "counts": counts,
            "snapshot": snapshot,  # read from the database file alone (a storage fault): recent commits may lack
            "current_link": link,
            # the free space is shown only below the floor: a figure that moves at every call would make two
            # snapshots of an idle daemon differ
            "disk": {"min_free_bytes": floor, "below_floor": low} | ({"free_bytes": free} if low else {}),
            # what the data directory holds against storage.max_bytes, and what the retention policy removed
            "storage": budget_status(config, store),
            "events": _latest_events(store, events, versions) if events else [],
            "questions": _questions(config, store, versions),
            "pseudo_labels": pseudo_labels(versions),
        }


def pseudo_labels(versions: list) -> dict | None:
    """What the last job did with the unlabelled images (:func:`edgerev.train.semi.semi_counts`, kept in its
    version's record): ``None`` before a job; ``pool`` 0 for a job that had none. Pseudo-labels live inside a
    job's steps, never in the store: this is the count of the last job's last pass over its pool. ``None`` too
    for a version recorded before versions kept the counts (unknown, not zero)."""
    training = (versions[-1].metrics.get("training") or {}) if versions else {}
    if "semi" not in training:
        return None
    v = versions[-1]
    semi = training["semi"] or {}
    last = semi.get("last_epoch") or {}
    return {"version": v.id, "job": v.job_id, "pool": semi.get("unlabeled_pool", 0),
            "last_epoch_unlabeled": last.get("unlabeled", 0),
            "last_epoch_pseudo_labeled": last.get("pseudo_labeled", 0),
            "unlabeled_used": semi.get("unlabeled_used", 0), "pseudo_labeled": semi.get("pseudo_labeled", 0),
            "epochs": semi.get("epochs", 0)}


def pseudo_text(p: dict) -> str:
    """``job 3 (v0003) gave 537 of the 1392 unlabelled images of its last epoch a pseudo-label (pool ...)``"""
    if not p["pool"]:
        return f"none (job {p['job']}, {p['version']}, had no unlabelled image)"
    return (f"job {p['job']} ({p['version']}) gave {p['last_epoch_pseudo_labeled']} of the "
            f"{p['last_epoch_unlabeled']} unlabelled images of its last epoch a pseudo-label (pool "
            f"{p['pool']}; {p['pseudo_labeled']} of {p['unlabeled_used']} views over {p['epochs']} epochs)")


def _questions(config: DaemonConfig, store: Store, versions: list) -> dict:
    """The questions waiting (:mod:`edgerev_daemon.learning.questions`), the answers given and what the last
    ones gained (:func:`answer_gain`)."""
    from edgerev_daemon.learning.questions import read_list, skipped, waiting

    root = config.layout.root
    ql = read_list(root)
    answered = store.answered_batches()
    return {"waiting": len(waiting(root, store)), "skipped": len(skipped(root)), "answers": len(answered),
            "asked_by": None if ql is None else ql.version, "asked_at": None if ql is None else ql.made_at,
            "gain": answer_gain(store, answered, versions)}


def answer_gain(store: Store, answered: dict[str, int], versions: list) -> dict | None:
    """The accuracy gained from the last answers, or None ("not yet": no job has trained on an answer).

    The last answers are those a finished job trained on first (labelled after the data of the finished job
    before it, up to its own); the figure is, on that job's held-out samples, the accuracy of the version in
    service after the job (the candidate if the gate promoted it, else the same version as before) minus
    the accuracy of the version in service before it. A first model (nothing before it) has no gain.
    """
    batches = sorted(set(answered.values()))
    done = sorted((j for j in store.jobs(limit=1000) if j.state == JobState.DONE), key=lambda j: j.id)
    last, before_batch = None, 0
    for job in done:
        n = sum(1 for b in batches if before_batch < b <= job.data_batch_id)
        if n:
            last = (job, n)
        before_batch = job.data_batch_id
    if last is None:
        return None
    job, n = last
    version = next((v for v in versions if v.job_id == job.id), None)
    if version is None:
        return None
    ev = version.metrics.get("evaluation", {})
    cand, cur = ev.get("candidate", {}).get("all"), (ev.get("current") or {}).get("all")
    after = cand if version.promoted else cur
    return {"job": job.id, "version": version.id, "promoted": version.promoted, "answers": n,
            "heldout_samples": ev.get("heldout_samples", {}).get("all"), "before": cur, "after": after,
            "gained": None if cur is None or after is None else after - cur}


def questions_text(q: dict) -> str:
    """``12 waiting, 5 answers given; accuracy gained from the last answers: ...`` (status and the page)."""
    gain = q.get("gain")
    if gain is None:
        gained = "not yet (no job has trained on an answer)"
    elif gain["gained"] is None:
        gained = f"none to tell: job {gain['job']} made the first model ({gain['version']})"
    else:
        kept = "" if gain["promoted"] else f", not promoted: {gain['version']} kept out"
        gained = (f"{100 * gain['gained']:+.1f} points (job {gain['job']} trained on {gain['answers']} answers"
                  f"{kept}: {100 * gain['before']:.1f} % -> {100 * gain['after']:.1f} % on its "
                  f"{gain['heldout_samples']} held-out samples)")
    return (f"{q['waiting']} waiting, {q['answers']} answers given"
            + (f", {q['skipped']} skipped" if q.get("skipped") else "") + "; accuracy gained from the last answers: "
            + gained)


def _latest_events(store: Store, n: int, versions: list) -> list[dict]:
    """The latest ``n`` lines of the event log, oldest first, from its latest ``2 n`` rows (a promotion's two
    rows fold into one line: :func:`~edgerev_daemon.service.events.fold`)."""
    from edgerev_daemon.service.events import fold

    latest = store.events(limit=2 * n, latest=True)
    decisions = {v.id: v.metrics.get("promote") for v in versions}
    return fold([e.to_json() for e in latest], decisions)[-n:]


def _pictures(folder) -> list[str]:
    """The plots a version folder holds (``curves``, ``classes``), as the status page serves them."""
    return [name for name in ("curves", "classes") if (folder / f"{name}.png").is_file()]


def _version(v, registry: Registry) -> dict:
    """A version as JSON: whether it was promoted and why, when the gate decided (``decided_at``), what it
    decided (``promote``: None where not recorded), its held-out accuracy, and its plots while on disk."""
    folder = registry.versions_dir / v.id
    on_disk = folder.is_dir()
    figures = v.metrics.get("evaluation", {}).get("candidate", {})
    return {"version": v.id, "promoted": v.promoted, "on_disk": on_disk, "job": v.job_id, "reason": v.reason,
            "decided_at": v.created_at, "promote": v.metrics.get("promote"),
            "heldout_accuracy": figures.get("all"), "recent_heldout_accuracy": figures.get("recent"),
            "pictures": _pictures(folder) if on_disk else []}


def _current(name: str, version, registry: Registry) -> dict:
    """The model in service as its promotion judged it: held-out accuracy on all samples and on the recent
    window (None where unknown, e.g. a version judged before edgerev had windows), per class on the recent
    window (None: a class with no recent sample)."""
    ev = version.metrics.get("evaluation", {}) if version else {}
    figures, samples = ev.get("candidate", {}), ev.get("heldout_samples", {})
    return {
        "version": name,
        "path": str(registry.path(name)) if version else None,
        "onnx": str(registry.path(name) / "model.onnx") if version else None,
        "reason": version.reason if version else None,
        "decided_at": version.created_at if version else None,
        "pictures": _pictures(registry.path(name)) if version else [],
        "heldout_accuracy": figures.get("all"),
        "recent_heldout_accuracy": figures.get("recent"),
        "heldout_samples": {"all": samples.get("all"), "recent": samples.get("recent")},
        "recent_window_days": ev.get("recent_window_days"),
        "per_class": figures.get("per_class"),
    }


def _job(job, layout: Layout) -> dict:
    """A job as JSON; a running one with its trainer's latest report (``progress``: step, epoch, loss, ETA), read
    from the job's folder in this data directory (wherever it was when the job began)."""
    from edgerev.train.progress import read_progress  # no torch

    running = job.state == JobState.RUNNING
    return {"id": job.id, "state": job.state.value, "reason": job.reason, "started_at": job.started_at,
            "finished_at": job.finished_at, "error": job.error,
            "progress": read_progress(layout.job_dir(job.id)) if running else None}


def progress_line(progress: dict | None) -> str | None:
    """A job's progress report as the trainer prints it (None: none, or from another edgerev)."""
    from edgerev.train.progress import Progress

    try:
        return Progress(**progress).line() if progress else None
    except (TypeError, ValueError):
        return None


def accuracy_text(cur: dict) -> str:
    """``, held-out accuracy 0.9733 on all 375, 0.9750 on the recent 360 (30 days)``: the model in service's
    figures as its promotion measured them (empty where none is known)."""
    acc, recent = cur.get("heldout_accuracy"), cur.get("recent_heldout_accuracy")
    if acc is None:
        return ""
    n = cur.get("heldout_samples") or {}
    text = f", held-out accuracy {acc:.4f}" + (f" on all {n['all']}" if n.get("all") is not None else "")
    if recent is not None:
        days = cur.get("recent_window_days")
        window = "all samples" if days is None else f"{days:g} days before each class's newest"
        text += f", {recent:.4f} on the recent {n.get('recent')} ({window})"
    return text


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def storage_line(st: dict) -> str:
    """One line: what the data directory holds against its budget, what was removed, and why it is over."""
    used = st["usage"]["total"]
    if st["max_bytes"]:
        line = f"storage: {_size(used)} of {_size(st['max_bytes'])} ({100 * used / st['max_bytes']:.0f} %)"
    else:
        line = f"storage: {_size(used)} kept (no storage.max_bytes)"
    if st.get("max_samples"):
        line += f", {st['samples']} of {st['max_samples']} samples"
    removed = st.get("removed") or {}
    line += ("; removed by the retention policy: " + ", ".join(f"{n} ({why})" for why, n in sorted(removed.items()))
             if removed else "; nothing removed yet")
    if st.get("over"):
        line += f"; over its bounds: {st['over']}"
    return line


def format_status(s: dict, versions: bool = True) -> str:
    """The human-readable form of :func:`status` (``edgerev daemon status``); ``versions``: list the last
    five (the HTML page has a table of its own)."""
    n = s["samples"]
    lines = [f"data directory {s['data_dir']} (inbox {s['inbox']})",
             "daemon: " + (f"running, pid {s['daemon_pid']}" if s["daemon_pid"] else "not running"),
             f"samples: {n['total']}: {n.get('labeled', n['total'])} labelled ({n['train']} train, {n['heldout']} "
             f"held out), {n.get('unlabeled', 0)} unlabelled; labels: {', '.join(s['labels']) or 'none'}; "
             f"{s['new_samples_since_last_job']} new samples since the last job; "
             f"{s['quarantined_files']} files in quarantine"]
    disk = s.get("disk") or {}
    if disk.get("below_floor"):
        lines.append(f"disk: {disk['free_bytes']} bytes free, below storage.min_free_space "
                     f"({disk['min_free_bytes']}): ingest and training wait")
    if (storage := s.get("storage")) is not None:
        lines.append(storage_line(storage))
    if waiting := s.get("labels_held_back"):
        lines.append("labels held back (too few training samples yet): "
                     + listed(waiting))
    for folder, error in s.get("inbox_problems", {}).items():
        lines.append(f"inbox folder {folder} skipped: {error}")
    cur = s["current"]
    if s.get("current_link") not in (None, "ok", "missing"):
        lines.append(f"current link {s['current_link']} (repaired at the next start)")
    if cur is None:
        lines.append("model in service: none yet")
    else:
        lines.append(f"model in service: {cur['version']}{accuracy_text(cur)}")
        if cur.get("onnx"):
            lines.append(f"  ONNX: {cur['onnx']}")
        per_class = cur.get("per_class") or {}
        if per_class:
            which = " (recent)" if cur.get("recent_heldout_accuracy") is not None else ""
            lines.append(f"  per class{which}: " + ", ".join(f"{c} {'-' if a is None else f'{100 * a:.0f} %'}"
                                                            for c, a in per_class.items()))
    for v in s["versions"][-5:] if versions else ():
        mark = "promoted" if v["promoted"] else "kept out"
        lines.append(f"  {v['version']} {mark}{'' if v['on_disk'] else ' (pruned)'}: {v['reason']}")
    if s["job"] is not None:
        j = s["job"]
        what = "job" if j["state"] in ("queued", "running") else "last job"
        error = f": {j['error']}" if j["error"] else ""
        lines.append(f"{what}: {j['id']} {job_state_text(s)} ({j['reason']}){error}")
        if (line := progress_line(j.get("progress"))) is not None:
            lines.append(f"  {line}")
    if (line := next_job_text(s)) is not None:
        lines.append(f"next job: {line}")
    if (p := s.get("pseudo_labels")) is not None:
        lines.append(f"pseudo-labels: {pseudo_text(p)}")
    if (q := s.get("questions")) is not None:
        lines.append(f"questions: {questions_text(q)}" + (" (edgerev daemon label)" if q["waiting"] else ""))
    return "\n".join(lines)


def job_state_text(s: dict) -> str:
    """The state of the status's job as the owner should read it: a job the store says is running while no
    daemon runs was stopped (SIGTERM, a kill, a power cut) before it finished, and waits for the next start."""
    job = s["job"]
    if job["state"] == "running" and not s.get("daemon_pid"):
        return "interrupted (no daemon runs it; it resumes from its checkpoint at the next start)"
    return job["state"]


def next_job_text(s: dict) -> str | None:
    """When the next job runs, or why not yet (None: the schedule says nothing)."""
    sched = s.get("schedule") or {}
    job = s.get("job") or {}
    if job.get("state") in ("queued", "running"):  # the job above is the next one: not "due", under way
        when = "runs now" if s.get("daemon_pid") else "resumes from its checkpoint at the next start"
        return f"job {job['id']} {when}"
    if sched.get("due"):
        return f"due now ({sched['due']})"
    if sched.get("waiting"):
        return f"not yet: {sched['waiting']}"
    return None
