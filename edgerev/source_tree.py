"""Running from a source tree without installing: ``PYTHONPATH=. python -m edgerev`` on a machine with no network.

An install maps the ``daemon/`` folder to the import name ``edgerev_daemon`` (pyproject's package-dir: the
name ``daemon`` is python-daemon's). A source tree on ``sys.path`` has no such name, so the CLI (which adds
the daemon's commands) and the daemon's tests would fail to import it. :func:`import_daemon` gives the
folder that name when nothing installed provides it: the machine without network (a lent GPU machine) then
runs ``python -m edgerev`` and ``python -m pytest`` from the checkout as an installed copy would.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

DAEMON = "edgerev_daemon"


def import_daemon() -> bool:
    """Make ``edgerev_daemon`` importable; True when it is (installed, or the source tree's ``daemon/``).

    An installed ``edgerev_daemon`` wins; the source tree's folder is used only when none is found.
    """
    if DAEMON in sys.modules or importlib.util.find_spec(DAEMON) is not None:
        return True
    folder = Path(__file__).resolve().parent.parent / "daemon"
    init = folder / "__init__.py"
    if not init.is_file():
        return False
    spec = importlib.util.spec_from_file_location(DAEMON, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[DAEMON] = module  # before running it: its own imports name edgerev_daemon
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[DAEMON]
        raise
    return True
