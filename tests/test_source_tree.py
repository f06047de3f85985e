"""``PYTHONPATH=. python -m edgerev`` from a checkout that was never installed (the lent GPU machine has no
network, so no ``pip install -e .``): the daemon's folder is found under its installed name, and the service's
commands are registered as pyproject.toml says (edgerev/source_tree.py)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

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
    r = run_uninstalled("-c", "import sys; from edgerev.source_tree import map_package_dirs; "
                              "assert map_package_dirs(); "
                              "import edgerev_daemon.service.cli; print(edgerev_daemon.__file__)")
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == ROOT / "daemon" / "__init__.py"


def test_an_installed_daemon_package_wins():
    """Where edgerev_daemon is importable already, nothing is replaced."""
    import edgerev_daemon
    from edgerev.source_tree import map_package_dirs

    assert map_package_dirs()
    assert sys.modules["edgerev_daemon"] is edgerev_daemon


def test_pyproject_is_read_as_tomllib_reads_it():
    """The two patterns that stand in for tomllib (Python 3.10 has none) find what it finds."""
    tomllib = pytest.importorskip("tomllib")
    from edgerev.source_tree import declared_entry_points, package_dirs, pyproject

    text = pyproject()
    data = tomllib.loads(text)
    assert package_dirs(text) == data["tool"]["setuptools"]["package-dir"] == {"edgerev_daemon": "daemon"}
    for group, table in data["project"]["entry-points"].items():
        assert {ep.name: ep.value for ep in declared_entry_points(group, text)} == table
    assert declared_entry_points("no.such.group", text) == []


def test_without_installed_entry_points_the_source_tree_registers_the_commands(monkeypatch, capsys):
    """An uninstalled checkout has no entry points (none installed, or another copy's without the group): the
    service's commands come from the tree's pyproject.toml, in their place in --help."""
    import importlib.metadata

    from edgerev.cli import COMMANDS, build_parser, registered_commands
    from edgerev.source_tree import pyproject as pyproject_text

    monkeypatch.setattr(importlib.metadata, "entry_points", lambda **kw: [])
    assert [f.__name__ for f in registered_commands()] == ["add_commands"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--help"])
    listed = re.findall(r"^    (\S+)", capsys.readouterr().out, re.M)
    assert listed == ["memory", "plan", "diagnose", "train", "doctor", "daemon", "fleet", "export", "predict",
                      "finetune-head"]
    assert COMMANDS in pyproject_text()
