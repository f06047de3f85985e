"""Running from a source tree without installing: ``PYTHONPATH=. python -m edgerev`` on a machine with no network.

An install does two things that a source tree on ``sys.path`` lacks: it maps folders to import names (pyproject's
``package-dir``: the ``daemon/`` folder is ``edgerev_daemon``, because the name ``daemon`` is python-daemon's),
and it records the entry points other packages register with edgerev (``edgerev.cli``: the service's commands).
Both are written in the source tree's pyproject.toml, and this module reads them from there, so that the machine
without network (a lent GPU machine) runs ``python -m edgerev`` and ``python -m pytest`` from the checkout as an
installed copy would. It names no package of its own: what the tree maps and registers is pyproject's to say, and
the library imports nothing of the service (``tests/test_imports.py``).

pyproject.toml is read with two small patterns rather than ``tomllib``, which Python 3.10 (a Jetson's) lacks;
``tests/test_source_tree.py`` holds them to ``tomllib``'s reading.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from importlib.metadata import EntryPoint
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def pyproject(root: Path = ROOT) -> str | None:
    """The text of the source tree's pyproject.toml, or None outside a source tree (an installed copy)."""
    path = root / "pyproject.toml"
    if not (path.is_file() and (root / "edgerev" / "__init__.py").is_file()):
        return None
    return path.read_text()


def package_dirs(text: str) -> dict[str, str]:
    """``[tool.setuptools] package-dir``: import name -> folder, relative to the tree."""
    m = re.search(r"^package-dir\s*=\s*\{([^}]*)\}", text, re.M)
    return dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]+)"', m.group(1))) if m else {}


def declared_entry_points(group: str, text: str | None = None) -> list[EntryPoint]:
    """The entry points pyproject.toml registers in ``group`` (``[project.entry-points."<group>"]``)."""
    text = pyproject() if text is None else text
    if text is None:
        return []
    m = re.search(r'^\[project\.entry-points\."' + re.escape(group) + r'"\][ \t]*\n(.*?)(?=^\[|\Z)', text, re.M | re.S)
    pairs = re.findall(r'^([\w.-]+)\s*=\s*"([^"]+)"', m.group(1), re.M) if m else []
    return [EntryPoint(name, value, group) for name, value in pairs]


def map_package_dirs() -> bool:
    """Make every package of the source tree's ``package-dir`` importable under its name; True when each is
    (installed, or the tree's folder), and outside a source tree.

    An installed package wins; a tree's folder is used only when nothing installed provides its name.
    """
    text = pyproject()
    if text is None:
        return True
    found = True
    for name, folder in package_dirs(text).items():
        found = _map(name, ROOT / folder) and found
    return found


def _map(name: str, folder: Path) -> bool:
    if name in sys.modules or importlib.util.find_spec(name) is not None:
        return True
    init = folder / "__init__.py"
    if not init.is_file():
        return False
    spec = importlib.util.spec_from_file_location(name, init, submodule_search_locations=[str(folder)])
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # before running it: its own imports name the package
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[name]
        raise
    return True
