"""The explicit package list in pyproject.toml (needed to install ``daemon/`` as ``edgerev_daemon``)
names every package in the repository, so a wheel never silently lacks one."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_every_tracked_package_is_listed():
    tomllib = pytest.importorskip("tomllib")
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs the git checkout")
    tracked = subprocess.run(["git", "ls-files", "edgerev", "daemon"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    folders = {str(Path(f).parent) for f in tracked if f.endswith("/__init__.py")}
    # daemon/ installs as edgerev_daemon, its rooms (daemon/storage/...) as edgerev_daemon.storage...
    expected = {("edgerev_" + f if f.split("/")[0] == "daemon" else f).replace("/", ".") for f in folders}
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    listed = set(setuptools["packages"])
    assert expected <= listed, f"add {sorted(expected - listed)} to [tool.setuptools] packages in pyproject.toml"
    assert setuptools["package-dir"] == {"edgerev_daemon": "daemon"}


def test_the_daemon_imports_under_its_own_name():
    import edgerev_daemon

    assert Path(edgerev_daemon.__file__).parent.name == "daemon"
