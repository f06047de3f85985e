"""The supported torch range: one range in pyproject.toml and edgerev.torch_range, a one-line warning outside it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import tomllib
import torch
from hypothesis import given
from hypothesis import strategies as st
from packaging.requirements import Requirement

from edgerev.torch_range import FIRST_UNSUPPORTED, OLDEST, TESTED, UnsupportedTorchWarning, problem, release

ROOT = Path(__file__).resolve().parents[1]
JETSON = "2.6.0a0+df5bbc09d1.nv24.12"  # NVIDIA's PyTorch in the NGC 24.12 iGPU image (deploy/Dockerfile.jetson)


def torch_requirement() -> Requirement:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    return next(r for r in map(Requirement, deps) if r.name == "torch")


@pytest.mark.parametrize("version", [JETSON, "2.6.0", "2.6.0+cu124", "2.13.0+cpu", "2.14.1", "2.14.1+cu126",
                                     "2.14.99", "2.15.0a0", "2.15.0rc1", "2.15.0", "2.5.1", "2.2.0", "3.0.0"])
def test_pyproject_and_the_import_check_accept_the_same_releases(version):
    """pip (PEP 440, pre-releases allowed as an installed NVIDIA build is one) and the warning agree."""
    assert torch_requirement().specifier.contains(version, prereleases=True) == (problem(version) is None)


def test_the_tested_releases_are_the_ends_of_the_range():
    assert [release(v) for v in TESTED] == [OLDEST, (FIRST_UNSUPPORTED[0], FIRST_UNSUPPORTED[1] - 1)]
    ci = (ROOT / ".ci" / "run").read_text()
    assert all(f"torch=={v}" in ci for v in TESTED), "CI must install both ends of the range"


@given(st.integers(0, 9), st.integers(0, 40), st.integers(0, 9),
       st.sampled_from(["", "a0", "rc1", "+cpu", "+cu126", "a0+df5bbc09d1.nv24.12"]))
def test_only_the_release_counts(major, minor, patch, tail):
    text = problem(f"{major}.{minor}.{patch}{tail}")
    assert (text is None) == (OLDEST <= (major, minor) < FIRST_UNSUPPORTED)
    if text is not None:
        assert len(text.splitlines()) == 1 and f"torch {major}.{minor}.{patch}{tail} is installed" in text


def test_a_version_without_a_release_is_outside():
    assert "torch unknown is installed" in problem("unknown")


def test_the_installed_torch_is_in_range_and_importing_warns_nothing():
    """CI runs this at both ends of the range: importing edgerev's model code there is silent."""
    assert problem(str(torch.__version__)) is None
    code = "import warnings; warnings.simplefilter('error'); import edgerev.models"
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


@pytest.mark.slow
def test_importing_under_another_torch_warns_once_in_one_line(version="2.5.1+cu124"):
    code = f"import torch; torch.__version__ = {version!r}; import edgerev.models, edgerev.engine, edgerev.layers"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr  # a warning, not a refusal
    lines = [ln for ln in r.stderr.splitlines() if UnsupportedTorchWarning.__name__ in ln]
    assert len(lines) == 1, r.stderr
    assert re.search(rf"supports torch 2\.6 to 2\.14 .* torch {re.escape(version)} is installed", lines[0])
    # and a user can silence it as the module's docstring says
    quiet = subprocess.run([sys.executable, "-W", "ignore:edgerev supports torch", "-c", code],
                           cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0 and UnsupportedTorchWarning.__name__ not in quiet.stderr
