"""The commands the service adds to ``edgerev``: ``doctor``, ``daemon`` and ``fleet``.

Each needs the daemon (its config, its data directory, its jobs), and the library never imports the daemon: the
library's command line (:func:`edgerev.cli.build_parser`) calls every function registered in the ``edgerev.cli``
entry-point group, in its place between ``train`` and ``export``, and pyproject.toml registers
:func:`add_commands` there. From a source tree that was never installed, :mod:`edgerev.source_tree` reads the same
registration from pyproject.toml.
"""

from __future__ import annotations

from edgerev_daemon.service.cli import add_parser as add_daemon_parser
from edgerev_daemon.service.doctor_cli import add_parser as add_doctor_parser
from edgerev_daemon.service.fleet_cli import add_parser as add_fleet_parser


def add_commands(sub) -> None:
    """Add ``doctor``, ``daemon`` and ``fleet`` to ``edgerev``'s subcommands ``sub``, in the order ``--help``
    lists them."""
    add_doctor_parser(sub)
    add_daemon_parser(sub)
    add_fleet_parser(sub)
