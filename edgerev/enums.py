"""Enumerations whose members read as their value: ``f"{Split.TRAIN}"`` is ``train``, not ``Split.TRAIN``.

A ``(str, Enum)`` member formats as ``Class.NAME`` on Python 3.11 and later (as its ``str``); a message that
interpolates one shows the owner a Python name. :class:`TextEnum` is the base every such enumeration takes,
so no message has to remember ``.value``. (``enum.StrEnum`` does the same from 3.11; edgerev runs on 3.10.)
"""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A string enumeration that prints, formats and compares as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
