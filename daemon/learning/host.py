"""What the learning room needs of the service that holds a data directory: the interface, declared here.

A job that another module drives (a fleet round, a fleet model's consideration, a request handed to a running
daemon: :mod:`edgerev_daemon.learning.fleet`, :mod:`edgerev_daemon.learning.handoff`) trains and decides as the
daemon's own jobs do, through the daemon's steps. The learning room comes before the service
(``daemon/README.md``), so it does not import the service's ``Daemon``: it names what it calls, and the service's
:class:`edgerev_daemon.service.daemon.Daemon` has it (``tests/daemon/test_rooms.py`` checks both).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # jobs imports torch; the protocol is read by type checkers and tests only
    from edgerev_daemon.config import DaemonConfig
    from edgerev_daemon.learning.jobs import JobOutcome
    from edgerev_daemon.storage.blobs import BlobStore
    from edgerev_daemon.storage.records import Job, Version
    from edgerev_daemon.storage.store import Store


class JobHost(Protocol):
    """A data directory held open, and the steps of a job in it.

    ``config``, ``store``, ``blobs``: the daemon's configuration, its SQLite store and image blobs.
    """

    config: DaemonConfig
    store: Store
    blobs: BlobStore

    def base(self) -> tuple[Path | None, int, str | None]:
        """(current version directory, the last ingest batch it was trained on, its name)."""
        ...

    def train(self, job: Job, start: Path | None, base_batch: int, stop: Callable[[], bool] | None = None,
              config: DaemonConfig | None = None) -> JobOutcome:
        """Train (or resume) ``job``'s candidate from the model directory ``start``, under the cap, checkpointed."""
        ...

    def decided(self, job: Job) -> Version | None:
        """The decision recorded on ``job``'s candidate before a crash, or None."""
        ...

    def record_decision(self, job: Job, out: Path, metrics: dict, reason: str) -> dict:
        """Record the gate's decision on the candidate in ``out`` as a version, then carry it out."""
        ...

    def carry_out(self, job: Job, version: Version, out: Path) -> dict:
        """Carry out a recorded decision (idempotent): promote the candidate in ``out`` if it was to be."""
        ...
