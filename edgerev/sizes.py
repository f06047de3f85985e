"""Sizes in bytes as people write them (``400MiB``, ``1.5GB``, ``1000000``), read once into an int. Pure: no torch.

:class:`ByteSize` is the type a config field declares for such a size: :func:`edgerev.config.from_dict`
parses the YAML value (an int or a string) into it where the file is read, and a section's
``__post_init__`` a value given in code (both through :func:`edgerev.config.byte_size`, which names the
key), so every later use sees bytes as an int and nothing parses it again.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from edgerev.errors import EdgerevError

# a petabyte: more memory than any device edgerev trains on; a larger figure is a typo (or a unit mix-up)
MAX_BYTES = 2**50

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40, "k": 2**10, "m": 2**20, "g": 2**30}


class ByteSize(int):
    """A positive number of bytes, at most :data:`MAX_BYTES`; built with :func:`parse_bytes`."""


def parse_bytes(value: int | str) -> ByteSize:
    """``"400MiB"``, ``"1.5GB"``, ``"2 GiB"``, ``"1000000"`` or an int -> bytes (decimal SI, binary IEC units).

    Raises:
        EdgerevError: the value does not read as a size, or is zero, negative, fractional below one
            byte, or more than :data:`MAX_BYTES`.
    """
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise EdgerevError(f"expected a size in bytes (an int, or a string such as 400MiB), got {value!r}")
    if isinstance(value, int):
        return _checked(Decimal(value), value)
    if re.fullmatch(r"\s*-.*", value):
        raise EdgerevError(f"a size in bytes must be positive, got {value!r}")
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", value)
    if not m or m.group(2).lower() not in _UNITS:
        raise EdgerevError(f"cannot read {value!r} as a size in bytes; write e.g. 400MiB, 1.5GB or 1000000")
    try:
        amount = Decimal(m.group(1)) * _UNITS[m.group(2).lower()]
    except InvalidOperation:
        raise EdgerevError(f"cannot read {value!r} as a size in bytes") from None
    return _checked(amount, value)


def _checked(amount: Decimal, value: int | str) -> ByteSize:
    if amount < 1:
        raise EdgerevError(f"a size in bytes must be at least one byte, got {value!r}")
    if amount > MAX_BYTES:
        raise EdgerevError(f"{value!r} is more bytes than any device has (at most {MAX_BYTES:,})")
    return ByteSize(int(amount.to_integral_value()))


def format_bytes(n: int) -> str:
    """``16,044,536 bytes (15.3 MiB)``: exact for scripts and copy-paste, rounded for people."""
    return f"{n:,} bytes ({n / 2**20:.1f} MiB)"
