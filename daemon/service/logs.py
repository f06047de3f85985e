"""Log lines of the service: one physical line per record, whatever a message carries.

Messages quote file names, manifest lines and error texts, which come from outside: a file named
``"x\\n<3>edgerev.daemon: fake"`` would otherwise write a second line that journald reads as an error of
its own, and a name that is not UTF-8 (decoded with ``surrogateescape``) holds lone surrogates that a
UTF-8 stream refuses to encode. So every record is escaped in one place, the formatter, after it is
formatted (message, arguments and traceback alike): control characters (C0, DEL, C1), the Unicode line
and paragraph separators and lone surrogates become visible escapes (``\\n``, ``\\x1b``, ``\\u2028``;
a surrogate that stands for an undecodable byte shows that byte, ``\\xff``).
"""

from __future__ import annotations

import logging
import os
import re
import sys

# syslog priorities: journald reads a "<N>" prefix on each line of a service's stderr
_PRIORITY = {logging.DEBUG: 7, logging.INFO: 6, logging.WARNING: 4, logging.ERROR: 3, logging.CRITICAL: 2}

# everything str.splitlines breaks on is in here (\n \r \v \f \x1c-\x1e \x85 \u2028 \u2029)
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\ud800-\udfff]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}


def _escape_one(match: re.Match) -> str:
    c = match.group()
    if c in _SHORT:
        return _SHORT[c]
    code = ord(c)
    if 0xDC80 <= code <= 0xDCFF:  # surrogateescape's stand-in for the undecodable byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def escape(text: str) -> str:
    """``text`` on one line of printable characters: controls, separators and lone surrogates escaped."""
    return _UNSAFE.sub(_escape_one, text)


class TerminalFormatter(logging.Formatter):
    """``time LEVEL logger: message`` on one escaped line (tracebacks included)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        return escape(super().format(record))


class JournalFormatter(logging.Formatter):
    """``<priority>logger: message`` on one escaped line, for journald (which adds the time)."""

    def format(self, record: logging.LogRecord) -> str:
        return f"<{_PRIORITY.get(record.levelno, 6)}>" + escape(f"{record.name}: {super().format(record)}")


def setup_logging(level: str = "INFO") -> None:
    """Log lines to stderr: with syslog priority prefixes under systemd (journald adds the time), with
    a time stamp on a terminal; one escaped line per record either way."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JournalFormatter() if os.environ.get("JOURNAL_STREAM") else TerminalFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    for noisy in ("onnx_ir", "onnxscript", "torch.onnx"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
