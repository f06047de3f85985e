"""Every enumeration a message may interpolate reads as its value (``labelled '3' (train)``, never
``Split.TRAIN``): all of them take :class:`edgerev.enums.TextEnum`, and none is a bare ``(str, Enum)``."""

from __future__ import annotations

import ast
from enum import Enum
from pathlib import Path

import edgerev.doctor.judge  # noqa: F401
import edgerev.engine  # noqa: F401
import edgerev_daemon.storage.records  # noqa: F401  (defines the daemon's enumerations)
from edgerev.enums import TextEnum

ROOT = Path(__file__).resolve().parents[1]


def _subclasses(cls: type) -> list[type]:
    out = []
    for sub in cls.__subclasses__():
        out += [sub, *_subclasses(sub)]
    return out


def test_every_member_formats_as_its_value():
    enums = _subclasses(TextEnum)
    assert len(enums) >= 5
    for enum in enums:
        for member in enum:
            assert f"{member}" == str(member) == member.value
            assert f"({member})" == f"({member.value})"
            assert f"{member:>10}" == f"{member.value:>10}"
            assert member == member.value


def test_no_bare_string_enum_in_the_source():
    bare = []
    for path in [*ROOT.glob("edgerev/**/*.py"), *ROOT.glob("daemon/**/*.py")]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef) and node.name != "TextEnum":
                bases = {ast.unparse(b) for b in node.bases}
                if "str" in bases and bases & {"Enum", "enum.Enum"}:
                    bare.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name}")
    assert not bare, f"take edgerev.enums.TextEnum instead: {bare}"
    assert issubclass(TextEnum, Enum)
