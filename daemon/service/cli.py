"""``edgerev daemon ...``: run, once, status, label, rollback, check, rebuild, demo (thin: parse, build, call,
print)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import signal
import sqlite3
import sys
from pathlib import Path
from typing import NoReturn

from edgerev.exits import PARTIAL as EXIT_PARTIAL
from edgerev.exits import STOPPED as EXIT_STOPPED
from edgerev_daemon.service.logs import setup_logging
from edgerev_daemon.service.signals import Requests, handling

__all__ = ["add_parser", "setup_logging"]


def _config(args: argparse.Namespace):
    from edgerev_daemon.config import load_config

    return load_config(args.config)


def cmd_run(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.daemon import Daemon

    # handlers first: a signal during the start (reading the config, recovery) is kept for the loop
    # instead of killing the process with the default action
    requests = Requests()
    try:
        with handling({signal.SIGTERM: requests.ask_stop, signal.SIGINT: requests.ask_stop,
                       signal.SIGHUP: requests.ask_reload}, ignore_after=(signal.SIGHUP,), wakeup=requests.wakeup):
            config = _config(args)
            setup_logging(config.log_level)
            _serve(Daemon(config, config_path=args.config, requests=requests), args.poll)
    finally:
        requests.close()
    _exit_now(0)


def _exit_now(status: int) -> NoReturn:
    """End the process with ``status`` now, without the interpreter's teardown.

    Called once the service has stopped: the store is closed, the lock released, every file it wrote is whole
    or was never named. What the teardown would do next is free torch's and ONNX Runtime's modules object by
    object with full garbage collections: about a second of CPU, most of what a stop cost in every phase
    (``benchmarks/stop_latency.py``), and on a device whose cores are busy with other work 8.5 s of wall time
    for an idle daemon's stop (``--busy 12`` on 2 cores). The log's handlers are flushed first (what
    ``atexit`` would have done).
    """
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


def _serve(daemon, poll: float) -> None:
    with daemon:
        server = _http(daemon)
        try:
            daemon.serve(poll_seconds=poll)
        finally:
            if server is not None:
                server.stop()


def _http(daemon):
    if not daemon.config.http.enabled:
        return None
    from edgerev_daemon.service.http import StatusServer

    # an answer from the page is handed to this daemon: wake its loop to apply it
    return StatusServer(daemon.config, wakeup=daemon.requests.wakeup.notify).start()  # logs "status page on"


def cmd_once(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.daemon import Daemon

    config = _config(args)
    setup_logging(config.log_level if not args.json else "WARNING")
    requests = Requests()
    try:
        with (handling({signal.SIGTERM: requests.ask_stop}, wakeup=requests.wakeup),
              Daemon(config, config_path=args.config, requests=requests) as daemon):
            report = daemon.cycle()
        stopped = requests.stop  # SIGTERM came before the cycle ended: what it left resumes at the next start
    finally:
        requests.close()
    if args.json:
        print(json.dumps(report.to_json() | {"stopped": stopped}, indent=2))
    else:
        i = report.ingest
        print(f"ingest: {i['accepted']} stored, {i['duplicates']} duplicates, {len(i['quarantined'])} quarantined, "
              f"{len(i['refused'])} refused")
        if i.get("budget"):
            print(f"ingest stopped at the storage budget: {i['budget']}")
        print(f"job: {json.dumps(report.job)}" if report.job else f"no job due ({report.not_due})")
        if report.waiting:
            print(f"waiting: {report.waiting} (see the log and status)")
    if stopped:
        print("edgerev daemon once: stopped by SIGTERM before the cycle ended; a job under way resumes from its "
              "checkpoint at the next start", file=sys.stderr)
        return EXIT_STOPPED
    if report.failed:
        why = report.job.get("error") if report.job and report.job.get("error") else f"waiting for {report.waiting}"
        print(f"edgerev daemon once: error: {why}", file=sys.stderr)
        return EXIT_PARTIAL
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.status import format_status, status

    s = status(_config(args), events=args.events)
    print(json.dumps(s, indent=2) if args.json else format_status(s))
    return 0


def cmd_label(args: argparse.Namespace) -> int:
    from edgerev_daemon.errors import DaemonError
    from edgerev_daemon.learning.answers import Answer, parse_set
    from edgerev_daemon.learning.questions import waiting
    from edgerev_daemon.service.labelling import give, pending_text
    from edgerev_daemon.storage.store import Store

    config = _config(args)
    setup_logging("WARNING")
    try:
        answers = [parse_set(t, args.new_label) for t in args.set] + [Answer(t.strip(), None) for t in args.skip]
    except ValueError as e:
        raise DaemonError(str(e)) from None
    if not config.layout.database.exists():
        raise DaemonError(f"{config.data_dir} holds no store yet: start the daemon (edgerev daemon run or once)")
    if answers:
        given = give(config, answers, wait=args.wait)
        if given.outcomes is None:
            print(json.dumps({"pending": given.request}) if args.json else pending_text(given))
            return 0
        if args.json:
            print(json.dumps([o.__dict__ for o in given.outcomes], indent=2))
        else:
            for o in given.outcomes:
                print(f"{o.sample[:12]}: {o.text}")
        return 0 if all(o.ok for o in given.outcomes) else 1
    with Store(config.layout.database) as store:
        asked, labels = waiting(config.layout.root, store), store.labels()
    if args.json:
        print(json.dumps({"labels": labels, "questions": [q.to_json() for q in asked]}, indent=2))
        return 0
    if not asked:
        print("no question waits (the daemon asks after each job, about the unlabelled images it is least sure of)")
        return 0
    print(f"{len(asked)} questions, the most useful first (labels: {', '.join(labels) or 'none yet'}):")
    for q in asked:
        print(f"  {q.sample[:12]}  guess {q.guess} (margin {q.margin:.2f})  from {q.source}")
    print(f"answer: edgerev daemon label --config {args.config} --set {asked[0].sample[:12]}=LABEL "
          f"[--set ...] [--skip SAMPLE] [--new-label]")
    return 0


def cmd_rollback(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.daemon import Daemon

    config = _config(args)
    setup_logging(config.log_level)
    with Daemon(config, config_path=args.config) as daemon:
        before = daemon.registry.current()
        to = daemon.rollback(args.to)
    if args.json:
        print(json.dumps({"from": before, "to": to}))
    else:
        print(f"current: {to} (was {before})")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from edgerev_daemon.errors import DaemonError, StoreError
    from edgerev_daemon.storage.blobs import BlobStore
    from edgerev_daemon.storage.check import check_consistency
    from edgerev_daemon.storage.rebuild import evidence, store_state
    from edgerev_daemon.storage.registry import Registry
    from edgerev_daemon.storage.store import Store

    config = _config(args)
    why = store_state(config.layout.database)
    if why is not None:
        found = evidence(config.layout)
        if not found:
            raise DaemonError(f"{config.data_dir} holds no store yet")
        raise StoreError(f"{config.layout.database} {why}, next to {found.describe()}: run edgerev daemon rebuild "
                         f"--config {args.config}" + (" --move-aside" if why != "is missing" else ""))
    with Store(config.layout.database) as store:
        report = check_consistency(store, BlobStore(config.layout.blobs), verify=True, inbox=config.inbox_path,
                                   registry=Registry(config.layout.root))
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(f"{report.samples} samples, {report.blobs} blobs: " + ("consistent" if report.ok else "INCONSISTENT")
              + f" ({report.journal} samples in the journal)")
        for name in ("missing", "corrupt", "lost", "unjournaled", "pending", "removing", "orphans", "database",
                     "service"):
            values = getattr(report, name)
            if values:
                print(f"  {name}: {len(values)} ({', '.join(map(str, values[:3]))}{' ...' if len(values) > 3 else ''})")
        if report.lost or report.unjournaled:
            print(f"  the store lost rows or the journal is incomplete: stop the daemon, then run edgerev daemon "
                  f"rebuild --config {args.config} --move-aside (or start the daemon: it records journal lines again)")
        if report.removing:
            print("  removing: samples the retention policy removed as a crash came; the next start finishes it")
        history = ", ".join(f"{n} {what.replace('_', ' ')}" for what, n in report.history.items() if n)
        if history:
            print(f"  only the store holds {history}: a rebuild copies them from a readable old store, and loses "
                  "them when the store is lost")
    return 0 if report.ok else 1


def cmd_rebuild(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.lock import DataDirLock
    from edgerev_daemon.storage.rebuild import rebuild

    config = _config(args)
    setup_logging("WARNING" if args.json else config.log_level)
    with DataDirLock(config.layout.root):
        report = rebuild(config, move_aside=args.move_aside)
    if args.json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        labels = ", ".join(report.labels) or "none"
        print(f"rebuilt {config.layout.database}: {report.samples} samples, labels {labels}, "
              f"versions {', '.join(report.versions) or 'none'}")
        if report.moved_aside:
            print(f"  the old store was moved aside: {', '.join(report.moved_aside)}")
        if report.salvaged:
            print("  copied from the old store: " + ", ".join(f"{n} {t}" for t, n in report.salvaged.items()))
        if report.lost_history:
            print(f"  job history, refused versions and events not recovered: {report.lost_history}")
        if report.removed:
            print("  removed by the retention policy before: "
                  + ", ".join(f"{n} ({why})" for why, n in sorted(report.removed.items())))
        if report.without_blob or report.unlabeled_blobs or report.bad_lines:
            print(f"  not recorded: {report.without_blob} journal records without blob, {report.unlabeled_blobs} "
                  f"blobs no journal record names (kept on disk), {len(report.bad_lines)} unreadable journal lines")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from edgerev_daemon.service.demo import run_demo

    setup_logging("WARNING")
    return run_demo(Path(args.dir), images=args.images)


def _refusing_damage(command):
    """``command`` (one that reads the store), with a row of the store that cannot be read (SQLite's corruption
    codes, a text value that is not UTF-8: what the start's quick check does not read) said as the daemon's
    refusal to start: one line naming the store, what the data directory holds and the rebuild command, where a
    query found it; never a traceback."""

    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        from edgerev_daemon.storage.rebuild import damage, refusal

        try:
            return command(args)
        except sqlite3.DatabaseError as e:
            why = damage(e)
            if why is None:
                raise
            raise refusal(_config(args).layout, why, args.config) from None

    return run


def add_parser(sub) -> None:
    """Register ``daemon`` and its subcommands on the ``edgerev`` parser's subparsers."""
    d = sub.add_parser("daemon", help="the on-device service: ingest, retrain under the cap, promote, export",
                       description="The service a device runs: watches the inbox, stores images, fine-tunes the "
                                   "current model when enough new data arrived, promotes it if it is better, and "
                                   "exports every promoted version to ONNX.")
    dsub = d.add_subparsers(dest="daemon_command", required=True, metavar="SUBCOMMAND")

    def with_config(p):
        p.add_argument("--config", required=True, help="the daemon's YAML config (see configs/daemon/)")
        return p

    r = with_config(dsub.add_parser("run", help="long-running service (SIGTERM: stop at a step boundary; "
                                               "SIGHUP: reload the config)"))
    r.add_argument("--poll", type=float, default=5.0, help="seconds between inbox scans (default 5)")
    r.set_defaults(fn=_refusing_damage(cmd_run))
    o = with_config(dsub.add_parser("once", help="one full cycle (ingest, train if due, evaluate, promote, "
                                                 "export), then exit (status 1 if its job failed or a storage "
                                                 "condition held it back, 143 if SIGTERM stopped it first)"))
    o.add_argument("--json", action="store_true", help="print the cycle's report as JSON")
    o.set_defaults(fn=_refusing_damage(cmd_once))
    s = with_config(dsub.add_parser("status", help="samples, labels, the model in service, versions, jobs"))
    s.add_argument("--json", action="store_true", help="print JSON")
    s.add_argument("--events", type=int, default=10, help="recent events to include (default 10)")
    s.set_defaults(fn=_refusing_damage(cmd_status))
    lab = with_config(dsub.add_parser("label", help="the questions: the unlabelled images whose label would help "
                                                      "most; answer with --set SAMPLE=LABEL or --skip SAMPLE"))
    lab.add_argument("--set", action="append", default=[], metavar="SAMPLE=LABEL",
                     help="label a sample (its hash or first 6+ digits, as listed); repeatable")
    lab.add_argument("--skip", action="append", default=[], metavar="SAMPLE",
                     help="do not ask about this sample again; repeatable")
    lab.add_argument("--new-label", action="store_true",
                     help="allow a label the store does not know yet (without it, one is refused as a likely typo)")
    lab.add_argument("--wait", type=float, default=30.0,
                     help="seconds to wait for a running daemon to apply the answers (default 30; it takes them "
                          "between cycles, after a job under way)")
    lab.add_argument("--json", action="store_true", help="print JSON")
    lab.set_defaults(fn=_refusing_damage(cmd_label))
    b = with_config(dsub.add_parser("rollback", help="put an earlier version back in service (stop the daemon "
                                                     "first)"))
    b.add_argument("--to", help="version (default: the promoted version before the current one)")
    b.add_argument("--json", action="store_true", help="print JSON")
    b.set_defaults(fn=_refusing_damage(cmd_rollback))
    c = with_config(dsub.add_parser("check", help="consistency of the store, the journal, the blob files and the "
                                                  "version in service (exit 1 if not)"))
    c.add_argument("--json", action="store_true", help="print JSON")
    c.set_defaults(fn=_refusing_damage(cmd_check))
    e = with_config(dsub.add_parser("rebuild", help="recreate a lost or damaged store from the journal, the blobs "
                                                    "and the version directories (stop the daemon first)"))
    e.add_argument("--move-aside", action="store_true",
                   help="replace an existing store: it is renamed to store.sqlite.damaged-<time>, never deleted")
    e.add_argument("--json", action="store_true", help="print JSON")
    e.set_defaults(fn=cmd_rebuild)
    m = dsub.add_parser("demo", help="generate images into an inbox and run one cycle on embedded defaults")
    m.add_argument("--dir", default="runs/daemon-demo", help="data directory of the demo (default runs/daemon-demo)")
    m.add_argument("--images", type=int, default=600, help="generated images dropped into the inbox (default 600)")
    m.set_defaults(fn=cmd_demo)
