"""Frozen dataclass configs built from plain dicts (YAML), with errors that name the key and the type.

:func:`from_dict` walks a dataclass's fields and their type hints: nested dataclasses, ``int``,
``float``, ``str``, ``bool``, ``X | None``, ``tuple[X, ...]``, ``dict``, ``Literal`` choices and sizes in
bytes (:class:`~edgerev.sizes.ByteSize`: an int or ``"400MiB"``, parsed here, once, into an int). An
unknown key, a wrong type or a bad choice raises :class:`ConfigError` with the key's dotted path,
e.g. ``train.epochs: expected int, got str 'ten'``. :func:`to_dict` gives the resolved config back
as plain data, so it can be written beside the result and read again to the same value.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Literal, TypeVar, Union

from edgerev.errors import EdgerevError
from edgerev.sizes import ByteSize, parse_bytes

T = TypeVar("T")


class ConfigError(EdgerevError):
    """A configuration file or value is invalid; the message names the key."""


def _type_name(tp) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return " or ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(tp))
    if origin is tuple:
        return f"list of {_type_name(typing.get_args(tp)[0])}"
    if tp is type(None):
        return "null"
    if dataclasses.is_dataclass(tp):
        return "mapping"
    if tp is ByteSize:
        return "size in bytes"
    return getattr(tp, "__name__", str(tp))


def _got(value) -> str:
    text = repr(value)
    if len(text) > 40:
        text = text[:37] + "..."
    return f"{type(value).__name__} {text}"


def _convert(tp, value, key: str):
    origin = typing.get_origin(tp)
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        if value is None and type(None) in args:
            return None
        specific = None  # an alternative that took the value's kind but not its content says why (a size's reason)
        for a in args:
            if a is type(None):
                continue
            try:
                return _convert(a, value, key)
            except ConfigError as e:
                if len([x for x in args if x is not type(None)]) == 1:
                    raise
                if not str(e).startswith(f"{key}: expected "):
                    specific = specific or e
        if specific is not None:
            raise specific
        raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_got(value)}")
    if origin is Literal:
        if value not in typing.get_args(tp):
            raise ConfigError(f"{key}: expected one of {_type_name(tp)}, got {_got(value)}")
        return value
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}: expected {_type_name(tp)}, got {_got(value)}")
        item = typing.get_args(tp)[0]
        return tuple(_convert(item, v, f"{key}[{i}]") for i, v in enumerate(value))
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, key)
    if tp is ByteSize:
        return byte_size(value, key)
    if tp is dict or origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected mapping, got {_got(value)}")
        return dict(value)
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key}: expected bool, got {_got(value)}")
        return value
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key}: expected int, got {_got(value)}")
        return value
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(f"{key}: expected float, got {_got(value)}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key}: expected str, got {_got(value)}")
        return value
    raise TypeError(f"config type {tp!r} of {key} is not supported")  # a programming error, not user input


def from_dict(cls: type[T], data: Any, key: str = "") -> T:
    """Build the frozen dataclass ``cls`` from ``data`` (a mapping), validating every key.

    Args:
        key: dotted path of ``data`` inside the whole config (for messages).
    """
    where = f"{key}: " if key else ""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{where}expected a mapping, got {_got(data)}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = [k for k in data if k not in fields]
    if unknown:
        k = unknown[0]
        name = f"{key}.{k}" if key else str(k)
        raise ConfigError(f"{name}: unknown key; expected one of {', '.join(fields)}")
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _convert(hints[name], value, f"{key}.{name}" if key else name)
    missing = [n for n, f in fields.items() if n not in kwargs and f.default is dataclasses.MISSING
               and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ConfigError(f"{where}missing required key {missing[0]!r}")
    try:
        return cls(**kwargs)
    except ConfigError as e:
        if key and not str(e).startswith(key):
            raise ConfigError(f"{key}.{e}") from None
        raise


class Pruned:
    """A config section some of whose fields mean nothing in some cases (a folder source has no noise):
    :func:`to_dict` writes only :meth:`saved_fields`, so a saved config says only what was used."""

    def saved_fields(self) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(self))


def to_dict(cfg) -> dict:
    """Plain data (lists for tuples) of a config dataclass (of a :class:`Pruned` one, its saved fields)."""
    def plain(v):
        if isinstance(v, Pruned):
            return {name: plain(getattr(v, name)) for name in v.saved_fields()}
        if dataclasses.is_dataclass(v):
            return {f.name: plain(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (tuple, list)):
            return [plain(x) for x in v]
        if isinstance(v, dict):
            return {k: plain(x) for k, x in v.items()}
        if isinstance(v, ByteSize):
            return int(v)  # YAML writers know int, not its subclasses
        return v

    return plain(cfg)


def merged(base: dict, over):
    """``over`` laid on ``base`` mapping by mapping (a key's mapping merged, anything else replaced); a non-mapping
    ``over`` comes back as it is, for the type check to refuse. Neither argument is changed."""
    if not isinstance(over, dict):
        return over
    out = dict(base)
    for k, v in over.items():
        out[k] = merged(out[k], v) if isinstance(out.get(k), dict) and isinstance(v, dict) else v
    return out


def load_yaml(path: str | Path) -> dict:
    """Read a YAML mapping with ``yaml.safe_load``; one clear error for a missing or malformed file."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {path} is not valid YAML: {str(e).splitlines()[0]}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping at the top level, got {type(data).__name__}")
    return data


def dump_yaml(path: str | Path, cfg) -> None:
    """Write the resolved config (atomically) as YAML."""
    import yaml

    from edgerev.atomic import atomic_write

    atomic_write(path, yaml.safe_dump(to_dict(cfg), sort_keys=False).encode())


def byte_size(value: int | str, key: str) -> ByteSize:
    """``value`` (an int, or a string such as ``"400MiB"``) read into a :class:`~edgerev.sizes.ByteSize`; one that
    already is one is returned as it is, so a size is parsed once, where its config is built.

    :func:`from_dict` calls it for every field typed ``ByteSize``; a section's ``__post_init__`` calls it for a
    value given in code (``replace(cfg, budget="400MiB")``), and so does a library call taking a size.

    Raises:
        ConfigError: ``value`` is not a size in bytes (see :func:`~edgerev.sizes.parse_bytes`); the message
            names ``key``.
    """
    if isinstance(value, ByteSize):
        return value
    try:
        return parse_bytes(value)
    except EdgerevError as e:
        raise ConfigError(f"{key}: {e}") from None


def check(condition: bool, key: str, message: str) -> None:
    """For ``__post_init__``: raise ``ConfigError('key: message')`` unless ``condition``."""
    if not condition:
        raise ConfigError(f"{key}: {message}")
