"""The running service around the rooms: the :class:`~edgerev_daemon.service.daemon.Daemon` and its cycle,
signals, systemd notification, the data directory's lock, logs, ``status`` and the HTTP page, the CLI and
the demo."""
