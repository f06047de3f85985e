"""One manifest line to an entry (path components and label), or the one-line reason it is refused.

A manifest is UTF-8 JSON lines, ``{"path": ..., "label": ...}`` per line. Lines end with ``\\n``
(a ``\\r`` before it is dropped, so CRLF files work); a byte-order mark at the start is ignored. The
line is what a person or a script wrote, so it is parsed defensively:

- at most :data:`MAX_LINE` characters and :data:`MAX_DEPTH` levels of nesting, checked before the
  JSON parser runs (deep nesting would exhaust its recursion, a huge line its memory);
- strict JSON: ``NaN`` and ``Infinity`` are refused, and so is an object with a key twice (which of
  two ``path`` values counts would be a guess), and a number too long to convert;
- ``path``: a non-empty string of valid text, relative to the inbox, without ``..`` and without a
  NUL; ``label``: a string (its validity as a label is checked with the file, like a folder's name),
  or absent or ``null`` for an image without a label (stored unlabelled).

Other keys are allowed and ignored.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from edgerev_daemon.intake.names import shown

MAX_LINE = 4096
MAX_DEPTH = 16


@dataclass(frozen=True)
class Entry:
    """A manifest line's file (path components from the inbox) and its label (``None``: none given)."""

    parts: tuple[str, ...]
    label: str | None


class LineRefused(ValueError):
    """The line names nothing the daemon may touch; ``path`` is what it said, when it said one."""

    def __init__(self, reason: str, path: str | None = None) -> None:
        super().__init__(reason)
        self.reason, self.path = reason, path


def lines(text: str) -> list[tuple[int, str]]:
    """The numbered non-blank lines of a manifest's text."""
    text = text.removeprefix("\ufeff")
    out = []
    for number, line in enumerate(text.split("\n"), 1):
        line = line.removesuffix("\r")
        if line.strip():
            out.append((number, line))
    return out


def _depth(line: str) -> int:
    """The deepest nesting of arrays and objects, strings skipped (cheap: one pass, no recursion)."""
    depth = deepest = 0
    in_string = escaped = False
    for ch in line:
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
        elif ch == '"':
            in_string = True
        elif ch in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif ch in "]}":
            depth -= 1
    return deepest


def _no_constant(name: str) -> None:
    raise ValueError(f"{name} is not a number JSON allows")


def _unique(pairs: list[tuple[str, object]]) -> dict:
    obj: dict = {}
    for key, value in pairs:
        if key in obj:
            raise ValueError(f"key {key!r} appears twice")
        obj[key] = value
    return obj


def _valid_text(s: str) -> bool:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate, written as a \\udXXX escape
        return False
    return True


def _parts(raw: object) -> tuple[str, ...]:
    if not isinstance(raw, str) or not raw.strip():
        raise LineRefused('"path" must be a non-empty string')
    if not _valid_text(raw) or "\x00" in raw:
        raise LineRefused('"path" holds a NUL or a lone surrogate', raw)
    if raw.startswith("/"):
        raise LineRefused(f"absolute path '{shown(raw)}': paths are relative to the inbox", raw)
    parts = tuple(p for p in raw.split("/") if p not in ("", "."))
    if ".." in parts:
        raise LineRefused(f"path traversal '{shown(raw)}': '..' is not allowed", raw)
    if not parts:
        raise LineRefused(f"'{shown(raw)}' names the inbox itself", raw)
    return parts


def parse_line(line: str) -> Entry:
    """The entry one manifest line names.

    Raises:
        LineRefused: the line is not a valid entry (the reason names what is wrong).
    """
    if len(line) > MAX_LINE:
        raise LineRefused(f"line longer than {MAX_LINE} characters")
    if _depth(line) > MAX_DEPTH:
        raise LineRefused(f"nested deeper than {MAX_DEPTH} levels")
    try:
        obj = json.loads(line, object_pairs_hook=_unique, parse_constant=_no_constant)
    except json.JSONDecodeError as e:
        raise LineRefused(f"not JSON: {e.msg}") from None
    except (ValueError, RecursionError) as e:
        raise LineRefused(f"not valid JSON: {e}") from None
    if not isinstance(obj, dict) or "path" not in obj:
        raise LineRefused('expected an object with "path" and "label" (or "path" alone: an image without a label)')
    parts = _parts(obj["path"])
    label = obj.get("label")
    if label is not None and not isinstance(label, str):
        raise LineRefused(f'"label" must be a string or null, got {type(label).__name__}', obj["path"])
    return Entry(parts, label)
