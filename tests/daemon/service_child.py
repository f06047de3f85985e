"""One daemon cycle in a process of its own, for the kill -9 tests (not collected by pytest).

    python service_child.py CONFIG [POINT:N]

Opens the daemon on CONFIG (lock, recovery), prints ``ready``, runs one cycle and prints its report
as JSON. With ``POINT:N`` the process sends itself SIGKILL the N-th time it reaches POINT:

- ``checkpoint``: the trainer wrote a checkpoint (training is under way);
- ``decided``: the promotion decision is recorded, nothing of the version written;
- ``written``: the version's files are written, its directory not yet renamed into place;
- ``complete``: the version directory is complete, ``current`` not yet switched;
- ``switched``: ``current`` switched, the store not yet told;
- ``recorded``: the promotion recorded, the job not yet marked done.
"""

from __future__ import annotations

import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from ingest_child import die_at  # noqa: E402


def main() -> None:
    import edgerev.train.trainer as trainer
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.storage import registry, store

    if len(sys.argv) > 2:
        point, n = sys.argv[2].split(":")
        target = {"checkpoint": (trainer, "save_checkpoint", True),
                  "decided": (store.Store, "add_version", True),
                  "written": (registry, "fsync_dir", True),
                  "complete": (registry.Registry, "switch", False),
                  "switched": (registry.Registry, "switch", True),
                  "recorded": (store.Store, "update_version", True)}[point]
        die_at(*target[:2], int(n), target[2])
    from edgerev_daemon.service.cli import setup_logging

    config = load_config(sys.argv[1])
    setup_logging("INFO")
    with Daemon(config) as daemon:
        print("ready", flush=True)
        report = daemon.cycle()
    print(json.dumps(report.to_json()), flush=True)


if __name__ == "__main__":
    main()
