"""edgerev's on-device service (installed as ``edgerev_daemon``; the folder is ``daemon/``).

Built so far: the configuration, the single-instance lock, and the SQLite store with its
content-addressed image blobs. Ingest, the service loop, fine-tuning jobs, promotion and the CLI
build on them.
"""

from edgerev_daemon.blobs import BlobStore
from edgerev_daemon.config import DaemonConfig, config_from_dict, load_config, validate_paths
from edgerev_daemon.errors import DaemonError, LockError, StoreError
from edgerev_daemon.layout import Layout, prepare
from edgerev_daemon.lock import DataDirLock
from edgerev_daemon.records import Event, EventKind, Job, JobState, Sample, Split, Version
from edgerev_daemon.store import Store, split_of

__all__ = [
    "BlobStore",
    "DaemonConfig",
    "DaemonError",
    "DataDirLock",
    "Event",
    "EventKind",
    "Job",
    "JobState",
    "Layout",
    "LockError",
    "Sample",
    "Split",
    "Store",
    "StoreError",
    "Version",
    "config_from_dict",
    "load_config",
    "prepare",
    "split_of",
    "validate_paths",
]
