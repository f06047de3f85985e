"""The repository's own text: no file keeps a merge's conflict markers (a page with them ran as a broken command,
a module with them does not import, a YAML preset with them does not load)."""

from __future__ import annotations

import os
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TEXT = {".py", ".md", ".yaml", ".yml", ".toml", ".txt", ".cfg", ".ini", ".json", ".service", ".sh", ""}
SKIP = {".git", ".venv", ".venv-run", "site", "results", "__pycache__", ".pytest_cache", ".ruff_cache",
        ".hypothesis"}
MARKER = re.compile(r"^(<{7} |>{7} |={7}$)", re.MULTILINE)


def text_files():
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if d not in SKIP and not d.endswith(".egg-info")]  # pruned: never walked
        for name in files:
            path = Path(folder) / name
            if path.suffix in TEXT or path.parent.name in (".ci", "deploy"):
                yield path


def conflicted(path: Path) -> bool:
    try:
        return bool(MARKER.search(path.read_text(encoding="utf-8")))
    except (UnicodeDecodeError, OSError):
        return False


def test_no_file_keeps_conflict_markers():
    files = list(text_files())
    assert len(files) > 100  # the walk reads the repository, not an empty folder
    assert [str(p.relative_to(ROOT)) for p in files if conflicted(p)] == []


def test_the_check_sees_a_marker(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("text\n<<<<<<< HEAD\nours\n=======\ntheirs\n>>>>>>> branch\n")
    assert conflicted(page)
    page.write_text("a table rule\n=======\n")  # a setext underline of seven is a marker too: none is kept here
    assert conflicted(page)
    page.write_text("a heading\n========\n")
    assert not conflicted(page)
