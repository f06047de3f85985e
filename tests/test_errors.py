"""edgerev.errors: what a command line, a log line or an HTTP body prints of an error."""

import sqlite3

from hypothesis import given
from hypothesis import strategies as st

from edgerev.errors import described, one_line


@given(st.text())
def test_an_errors_line_holds_its_words_and_no_line_break(text):
    line = one_line(sqlite3.DatabaseError(text))
    assert line.split() == (text.split() or ["DatabaseError"])
    assert "\n" not in line and "\r" not in line and "  " not in line and line == line.strip()


def test_a_quoted_schema_is_one_line():
    e = sqlite3.DatabaseError("malformed database schema (runs) - near \"CREATE\":\nCREATE TABLE runs (\n  id)")
    assert one_line(e) == 'malformed database schema (runs) - near "CREATE": CREATE TABLE runs ( id)'


@given(st.text())
def test_a_described_error_is_its_type_and_its_first_line_never_the_type_twice(text):
    line = described(RuntimeError(text))
    first = next((t.strip() for t in text.strip().splitlines()), "")
    assert line == (f"RuntimeError: {first}" if first else "RuntimeError")
    assert "\n" not in line and "\r" not in line
