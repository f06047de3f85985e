"""How the daemon writes down a file name from the inbox: one escaped, reversible text form.

A POSIX file name is a string of bytes, not text. Media from other systems (FAT sticks, archives, old
cameras) carry names that are not UTF-8; Python hands them over as lone surrogates
(``surrogateescape``), which SQLite, JSON and a UTF-8 log cannot encode. A name may also hold newlines
and other control characters that would forge a log line. So every name the daemon records (a
sample's ``source``, events, reason files, log lines, ``status``) is :func:`shown` form:

- a backslash is written ``\\\\`` (two backslashes);
- a byte that is not part of valid UTF-8, and every byte of a control or formatting character
  (``\\n``, ``\\t``, DEL, the C1 range, bidirectional overrides, line and paragraph separators), is
  written ``\\xNN`` (two lower-case hex digits);
- every other character stands for itself.

:func:`name_bytes` turns the shown form back into the original bytes (``name_bytes(shown(b)) == b``
for every byte string), so a recorded name always identifies the file it came from. Names that are
printable UTF-8 without a backslash, the usual case, are unchanged.
"""

from __future__ import annotations

import os
import re
import unicodedata

_PLAIN = re.compile(r"[ -\[\]-~]*")  # printable ASCII except the backslash: shown as is
_ESCAPE = re.compile(r"\\(\\|x[0-9a-f]{2})")
_ESCAPED_CATEGORIES = frozenset({"Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp"})


def _raw(name: str | bytes) -> bytes:
    if isinstance(name, bytes):
        return name
    try:
        return os.fsencode(name)
    except UnicodeEncodeError:  # a surrogate no file name decodes to (text from a manifest): its code units
        return name.encode("utf-8", "surrogatepass")


def shown(name: str | bytes) -> str:
    """The recorded form of one file name (a ``str`` from ``os.listdir`` or the raw bytes)."""
    if isinstance(name, str) and _PLAIN.fullmatch(name):
        return name
    text = _raw(name).decode("utf-8", "surrogateescape")
    out = []
    for ch in text:
        code = ord(ch)
        if 0xDC80 <= code <= 0xDCFF:  # a byte that was not valid UTF-8
            out.append(f"\\x{code - 0xDC00:02x}")
        elif ch == "\\":
            out.append("\\\\")
        elif unicodedata.category(ch) in _ESCAPED_CATEGORIES:
            out.extend(f"\\x{b:02x}" for b in ch.encode("utf-8"))
        else:
            out.append(ch)
    return "".join(out)


def shown_path(parts: tuple[str, ...] | list[str]) -> str:
    """A path inside the inbox, from its components, as recorded: ``shown`` names joined by ``/``."""
    return "/".join(shown(p) for p in parts)


def name_bytes(text: str) -> bytes:
    """The original bytes of a name recorded by :func:`shown`.

    Raises:
        ValueError: ``text`` holds a lone backslash, so it is not a form :func:`shown` writes.
    """
    out = bytearray()
    pos = 0
    for m in _ESCAPE.finditer(text):
        chunk = text[pos:m.start()]
        if "\\" in chunk:
            raise ValueError(f"not an escaped name: lone backslash in {text!r}")
        out += chunk.encode("utf-8")
        out += b"\\" if m.group(1) == "\\" else bytes([int(m.group(1)[1:], 16)])
        pos = m.end()
    rest = text[pos:]
    if "\\" in rest:
        raise ValueError(f"not an escaped name: lone backslash in {text!r}")
    out += rest.encode("utf-8")
    return bytes(out)
