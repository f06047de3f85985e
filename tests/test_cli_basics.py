"""What every command shares: --version, the documented exit statuses, no torch for the light commands."""

from __future__ import annotations

import subprocess
import sys

import pytest

import edgerev
from edgerev.cli import EXIT_PARTIAL, EXIT_PIPE, EXIT_USAGE, main


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"edgerev {edgerev.__version__}"


def test_the_package_version_is_the_one_in_the_code():
    from importlib.metadata import version

    assert version("edgerev") == edgerev.__version__  # pyproject reads it from edgerev.__version__


def test_help_documents_the_exit_statuses(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    for status in (0, EXIT_PARTIAL, EXIT_USAGE, EXIT_PIPE):
        assert f"{status} " in out
    assert "exit status:" in out


def test_version_imports_no_torch():
    code = "import sys; from edgerev.cli import main\ntry:\n    main(['--version'])\nexcept SystemExit:\n    pass\n" \
           "assert 'torch' not in sys.modules"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
