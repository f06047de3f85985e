"""Files in: the inbox's label folders and manifests, confined file access, decoding and checks, quarantine,
and the crash-safe ingest into :mod:`edgerev_daemon.storage`."""
