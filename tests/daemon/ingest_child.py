"""A daemon's ingest in a process of its own, for the kill -9 tests (not collected by pytest).

    python ingest_child.py DATA_DIR BATCH_FILES [POINT:N]

Starts the way the daemon does (config, path checks, lock, folders, store), prints ``ready``, then
ingests the inbox and prints the report as JSON. With ``POINT:N`` it sends itself SIGKILL at the
N-th time ingest reaches POINT:

- ``blob``: a blob was written, its batch not committed;
- ``commit``: a batch was committed, none of its files removed from the inbox;
- ``remove``: just before removing a stored file (earlier ones of the batch are gone);
- ``move``: a quarantine's reason file was written, the file not yet linked into place;
- ``moved``: a file was moved to quarantine, its event not yet committed;
- ``journal``: a batch's journal lines were fsynced, the batch not yet committed.

- ``line``: the N-th line of the daemon's own code that runs (a tracer counts them): the test draws N
  at random, which reaches any instant between two lines of Python without asking the clock.
"""

from __future__ import annotations

import json
import os
import signal
import sys


def die_at(module, name: str, n: int, after: bool) -> None:
    """Wrap ``module.name`` so its ``n``-th call kills the process (before or after it runs)."""
    real = getattr(module, name)
    calls = [0]

    def wrapper(*args, **kwargs):
        calls[0] += 1
        if calls[0] == n and not after:
            os.kill(os.getpid(), signal.SIGKILL)
        out = real(*args, **kwargs)
        if calls[0] == n and after:
            os.kill(os.getpid(), signal.SIGKILL)
        return out

    setattr(module, name, wrapper)


def die_at_line(n: int) -> None:
    """SIGKILL when the ``n``-th line of code under ``daemon/`` is about to run (in any thread)."""
    import threading

    folder = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "daemon")
    lines = [0]

    def local(frame, event, arg):
        if event == "line":
            lines[0] += 1
            if lines[0] == n:
                os.kill(os.getpid(), signal.SIGKILL)
        return local

    def tracer(frame, event, arg):
        return local if frame.f_code.co_filename.startswith(folder) else None

    sys.settrace(tracer)
    threading.settrace(tracer)


def main() -> None:
    from edgerev_daemon import DataDirLock, Store, config_from_dict, ingest_inbox, prepare, validate_paths
    from edgerev_daemon.intake import confined
    from edgerev_daemon.intake import ingest as ingest_mod
    from edgerev_daemon.storage import blobs, journal, store
    data_dir, batch_files = sys.argv[1], int(sys.argv[2])
    if len(sys.argv) > 3:
        point, n = sys.argv[3].split(":")
        if point == "line":
            die_at_line(int(n))
        else:
            target = {"blob": (blobs.BlobStore, "write", True), "commit": (store.Store, "record_batch", True),
                      "remove": (confined, "remove_if_same", False), "move": (confined, "link", False),
                      "moved": (ingest_mod, "quarantine", True), "journal": (journal.Journal, "append", True)}[point]
            die_at(*target[:2], int(n), target[2])
    config = config_from_dict({"data_dir": data_dir, "ingest": {"settle_seconds": 0, "batch_files": batch_files}})
    validate_paths(config)
    with DataDirLock(config.layout.root):
        prepare(config.layout, config.inbox_path)
        with Store(config.layout.database) as s:
            print("ready", flush=True)
            report = ingest_inbox(config, s)
    print(json.dumps(report.to_json()), flush=True)


if __name__ == "__main__":
    main()
