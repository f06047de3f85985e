"""edgerev's on-device service (installed as ``edgerev_daemon``; the folder is ``daemon/``).

The configuration, the single-instance lock, the SQLite store with its content-addressed image blobs,
ingest of the inbox with quarantine, the consistency check, and on top of them the service
(:class:`edgerev_daemon.service.Daemon`): fine-tuning jobs, evaluation, promotion, rollback, status.
"""

from edgerev_daemon.blobs import BlobStore
from edgerev_daemon.check import CheckReport, check_consistency, remove_garbage
from edgerev_daemon.config import DaemonConfig, config_from_dict, load_config, validate_paths
from edgerev_daemon.errors import DaemonError, LockError, StoreError
from edgerev_daemon.ingest import IngestReport, ingest_inbox
from edgerev_daemon.layout import Layout, prepare
from edgerev_daemon.lock import DataDirLock
from edgerev_daemon.records import Event, EventKind, Job, JobState, Sample, Split, Version
from edgerev_daemon.store import Store, split_of

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
