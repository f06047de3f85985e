"""edgerev's on-device service (installed as ``edgerev_daemon``; the folder is ``daemon/``).

The configuration, the single-instance lock, the SQLite store with its content-addressed image blobs,
ingest of the inbox with quarantine, the consistency check, and on top of them the service
(:class:`edgerev_daemon.service.daemon.Daemon`): fine-tuning jobs, evaluation, promotion, rollback, status.
"""

from edgerev_daemon.config import DaemonConfig, config_from_dict, load_config, validate_paths
from edgerev_daemon.errors import DaemonError, LockError, StoreError
from edgerev_daemon.intake.ingest import IngestReport, ingest_inbox
from edgerev_daemon.layout import Layout, prepare
from edgerev_daemon.service.lock import DataDirLock
from edgerev_daemon.storage.blobs import BlobStore
from edgerev_daemon.storage.check import CheckReport, check_consistency, remove_garbage
from edgerev_daemon.storage.records import Event, EventKind, Job, JobState, Sample, Split, Version
from edgerev_daemon.storage.store import Store, split_of

__all__ = [
    "BlobStore",
    "CheckReport",
    "DaemonConfig",
    "DaemonError",
    "DataDirLock",
    "Event",
    "EventKind",
    "IngestReport",
    "Job",
    "JobState",
    "Layout",
    "LockError",
    "Sample",
    "Split",
    "Store",
    "StoreError",
    "Version",
    "check_consistency",
    "config_from_dict",
    "ingest_inbox",
    "load_config",
    "prepare",
    "remove_garbage",
    "split_of",
    "validate_paths",
]
