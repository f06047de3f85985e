"""Log lines cannot be forged: one physical line per record, no raw control character, whatever the message."""

from __future__ import annotations

import io
import logging
import unicodedata

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev_daemon.service.logs import escape, setup_logging

# any code point, lone surrogates included (st.text leaves category Cs out by default)
ANY_TEXT = st.text(st.characters(exclude_categories=()), max_size=80)
# a file name as os.listdir returns it for bytes that are not UTF-8
FILE_NAMES = st.binary(max_size=40).map(lambda b: b.decode("utf-8", "surrogateescape"))


def _unsafe(c: str) -> bool:
    return unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp")


def _emit(journal: bool, message: str, args: tuple, exc: bool) -> str:
    """What one record writes to a strict UTF-8 stderr, decoded."""
    raw = io.BytesIO()
    stream = io.TextIOWrapper(raw, encoding="utf-8", errors="strict", write_through=True)
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr("sys.stderr", stream)
        if journal:
            mp.setenv("JOURNAL_STREAM", "8:12345")
        else:
            mp.delenv("JOURNAL_STREAM", raising=False)
        setup_logging("INFO")
        log = logging.getLogger("edgerev.daemon")
        if exc:
            try:
                raise OSError(message)
            except OSError:
                log.exception(message.replace("%", "%%") + " %s", *args)
        else:
            log.error(message.replace("%", "%%") + " %s", *args)
    finally:
        mp.undo()
        root.handlers[:] = saved[0]
        root.setLevel(saved[1])
    return raw.getvalue().decode("utf-8")


@settings(max_examples=200)
@given(journal=st.booleans(), message=ANY_TEXT, name=FILE_NAMES, exc=st.booleans())
def test_every_record_is_one_line_without_control_characters(journal, message, name, exc):
    out = _emit(journal, message, (name,), exc)
    assert out.endswith("\n") and out.count("\n") == 1, out
    line = out[:-1]
    assert line.splitlines() == [line]
    assert not any(_unsafe(c) for c in line), ascii(line)
    assert line.startswith("<3>edgerev.daemon: ") if journal else " ERROR edgerev.daemon: " in line
    assert escape(message) in line and escape(name) in line  # nothing dropped: escaped, not removed


@given(st.text(st.characters(exclude_categories=("Cc", "Cs", "Zl", "Zp")), max_size=80))
def test_printable_text_is_left_alone(text):
    assert escape(text) == text


def test_a_forged_journald_line_stays_inside_its_record():
    out = _emit(True, "quarantined", ("x\n<3>edgerev.daemon: fake\r\x1b[2K\udcff.png",), False)
    assert out == "<3>edgerev.daemon: quarantined x\\n<3>edgerev.daemon: fake\\r\\x1b[2K\\xff.png\n"
