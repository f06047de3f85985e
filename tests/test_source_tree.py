"""``PYTHONPATH=. python -m edgerev`` from a checkout that was never installed (the lent GPU machine has no
network, so no ``pip install -e .``): the daemon's folder is found under its installed name."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_uninstalled(*args: str) -> subprocess.CompletedProcess:
    # -S: no site-packages, so neither the editable install's finder nor anything installed is seen; the
    # commands below import no third-party package
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-S", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)


def test_python_m_edgerev_runs_from_the_source_tree():
    r = run_uninstalled("-m", "edgerev", "daemon", "--help")
    assert r.returncode == 0, r.stderr
    assert "status" in r.stdout


def test_the_daemon_folder_is_imported_under_its_installed_name():
    r = run_uninstalled("-c", "import sys; from edgerev.source_tree import import_daemon; assert import_daemon(); "
                              "import edgerev_daemon.service.cli; print(edgerev_daemon.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == ROOT / "daemon" / "__init__.py"


def test_an_installed_daemon_package_wins():
    """Where edgerev_daemon is importable already, nothing is replaced."""
    import edgerev_daemon
    from edgerev.source_tree import import_daemon

    assert import_daemon()
    assert sys.modules["edgerev_daemon"] is edgerev_daemon
