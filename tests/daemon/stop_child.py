"""``edgerev daemon run`` parked in one phase until a SIGTERM lands (not collected by pytest).

    python stop_child.py CONFIG PHASE

Runs the daemon as the CLI does (signal handlers, lock, the loop), with one hook: the first time the
daemon reaches PHASE it logs ``parked in PHASE`` and holds there until the stop flag is set by the test's
SIGTERM, then goes on as if the signal had landed at that instant. A test waits for the line, sends the
signal from its own process, and checks that the daemon left the phase at once and what it left behind.

- ``ingest``: the third file of a batch is being examined (decoded, checked, stored);
- ``plan``: the child process measuring the model's stage profile runs (a job's first, for a model with a
  memory budget and no profile cached);
- ``training``: inside the third training step;
- ``epoch``: the trainer's evaluation at the end of the first epoch (a fine-tuning job's second evaluation:
  the first is the starting model's);
- ``final``: the trainer's final evaluation, before the model directory is written;
- ``evaluation``: the candidate being scored on the held-out samples (the model in service next);
- ``export``: the ONNX export's child process runs;
- ``export-forever``: an export's child process that never ends by itself (it waits on its standard input,
  and writes ``parked in export-forever <pid>`` to the daemon's standard error): only a kill ends it;
- ``promotion``: the version's files are written and fsynced, the directory not yet renamed into place.

Should the interpreter's teardown run after the stop (the daemon ends without it), an ``atexit`` handler
writes ``interpreter teardown`` to standard error.
"""

from __future__ import annotations

import atexit
import os
import sys

PARK_EXPORT = """
import os, sys
with open(f"/proc/{os.getppid()}/fd/2", "w") as daemon_stderr:
    print(f"parked in export-forever {os.getpid()}", file=daemon_stderr, flush=True)
sys.stdin.read()
"""


def in_child(children, what: str, park) -> None:
    """Park while the child process of ``what`` runs (the wait's second look at the stop flag)."""
    real = children.run

    def run(command, log, stop, phase, **options):
        if phase != what:
            return real(command, log, stop, phase, **options)
        asked = [0]

        def parked_stop() -> bool:
            asked[0] += 1
            if asked[0] == 2:  # the first is before the child starts
                park()
            return stop()

        return real(command, log, parked_stop, phase, **options)

    children.run = run


def main() -> None:
    import edgerev.train.trainer as trainer
    from edgerev.cli import main as cli
    from edgerev_daemon.intake import ingest
    from edgerev_daemon.learning import children, exporting, promote
    from edgerev_daemon.service import signals
    from edgerev_daemon.storage import registry

    config, phase = sys.argv[1], sys.argv[2]
    made = []
    real_requests = signals.Requests.__init__

    def remember(self) -> None:
        real_requests(self)
        made.append(self)

    signals.Requests.__init__ = remember  # the CLI's own, which its SIGTERM handler sets

    def park() -> None:
        print(f"parked in {phase}", file=sys.stderr, flush=True)
        while not made[0].stop:
            made[0].wakeup.wait(600)

    def at(module, name: str, nth: int = 1) -> None:
        real, calls = getattr(module, name), [0]

        def parked(*args, **kwargs):
            calls[0] += 1
            if calls[0] == nth:
                park()
            return real(*args, **kwargs)

        setattr(module, name, parked)

    from edgerev_daemon.learning.promote import Decision

    real_judge = promote.judge
    # the gate is told to promote (these tests are about stopping, not judging): every phase is reached
    promote.judge = lambda *a, **k: Decision(True, "promoted by the test", real_judge(*a, **k).metrics)
    if phase == "ingest":
        at(ingest._Ingest, "examine", 3)
    elif phase in ("plan", "export"):
        in_child(children, "the stage profile's measurement" if phase == "plan" else "the ONNX export", park)
    elif phase == "training":
        at(trainer, "train_step", 3)
    elif phase == "epoch":
        at(trainer, "evaluate", 2)
    elif phase == "final":
        at(trainer, "_finish")
    elif phase == "evaluation":
        at(promote, "score")
    elif phase == "export-forever":
        exporting.command = lambda *args: [sys.executable, "-c", PARK_EXPORT]
    elif phase == "promotion":
        at(registry, "fsync_dir")  # its first call in a promotion: the partial directory's files are synced
    else:
        raise SystemExit(f"unknown phase {phase!r}")
    atexit.register(print, "interpreter teardown", file=sys.stderr, flush=True)
    sys.exit(cli(["daemon", "run", "--config", config, "--poll", "0.2"]))


if __name__ == "__main__":
    sys.path.insert(0, os.path.dirname(__file__))
    main()
