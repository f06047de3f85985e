"""A model directory's description, ``model.json`` (:class:`ModelInfo`), read and written without torch.

What a model directory holds is said in :mod:`edgerev.models.directory`, which names everything here too.
Whatever needs only a model's description (its classes, its input) reads it here: the daemon's registry,
its status and its schedule run without loading torch, and a job reads the same classes the same way.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgerev.atomic import atomic_write
from edgerev.errors import EdgerevError

INFO = "model.json"
_SHA256 = re.compile(r"[0-9a-f]{64}")


class CheckpointError(EdgerevError):
    """A checkpoint is missing, incomplete, corrupt, or does not fit the model asked for."""


def write_json(path: str | Path, obj) -> None:
    atomic_write(path, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(path: str | Path, what: str) -> dict:
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{what} {path} does not exist")
    try:
        obj = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {str(e) or 'nested too deeply'}") from None
    except OSError as e:
        raise CheckpointError(f"{what} {path} cannot be read ({e.strerror or type(e).__name__})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what} {path} does not hold a JSON object")
    return obj


@dataclass(frozen=True)
class ModelInfo:
    """What it takes to rebuild a model and feed it: architecture, arguments, classes, input.

    ``mean`` and ``std`` are per channel, on pixels scaled to 0..1: the model's input is
    ``(pixels / 255 - mean) / std``. Read from a file (:meth:`from_json`), every field is checked for its type
    and range, and ``arch`` is data: what it may name is :func:`edgerev.models.trust.check_file_arch`'s to say.
    """

    arch: str
    classes: tuple[str, ...]
    input_size: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.25, 0.25, 0.25)
    model_args: dict = field(default_factory=dict)  # create_model overrides, num_classes excluded

    def __post_init__(self) -> None:
        if len(self.classes) < 1 or len(set(self.classes)) != len(self.classes):
            raise CheckpointError(f"classes: class names must be non-empty and distinct, got {list(self.classes)}")
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise CheckpointError("mean, std: normalization needs one mean and one positive std per channel")

    def to_json(self) -> dict:
        d = asdict(self)
        d["classes"], d["mean"], d["std"] = list(self.classes), list(self.mean), list(self.std)
        return d

    @staticmethod
    def from_json(d: dict, where: str = INFO) -> ModelInfo:
        """The description ``d`` holds, each field checked (``where``: the file, as messages name it).

        Raises:
            CheckpointError: a field missing or of the wrong type or range: ``where: field: what is wrong``.
        """
        def bad(key: str, expected: str):
            value = d.get(key)
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise CheckpointError(f"{where}: {key}: {expected} expected, got {shown}" if key in d
                                  else f"{where}: {key}: missing ({expected} expected)")

        if not isinstance(d, dict):
            raise CheckpointError(f"{where}: a JSON object expected")
        arch = d.get("arch")
        if not isinstance(arch, str) or not arch or "\0" in arch:
            bad("arch", "a model's name")
        classes = d.get("classes")
        if (not isinstance(classes, list) or not classes or not all(isinstance(c, str) and c for c in classes)
                or len(set(classes)) != len(classes)):
            bad("classes", "a list of distinct, non-empty class names")
        size = d.get("input_size")
        if not _is_int(size) or size < 1:
            bad("input_size", "a positive integer")
        for key in ("mean", "std"):
            v = d.get(key)
            if not isinstance(v, list) or not v or not all(_is_number(x) for x in v):
                bad(key, "a list of finite numbers, one per channel")
        if len(d["mean"]) != len(d["std"]):
            bad("std", f"as many values as mean ({len(d['mean'])})")
        if any(x <= 0 for x in d["std"]):
            bad("std", "positive values")
        args = d.get("model_args", {})
        if not isinstance(args, dict):
            bad("model_args", "a mapping of argument names to values")
        return ModelInfo(arch=arch, classes=tuple(classes), input_size=size, mean=tuple(float(v) for v in d["mean"]),
                         std=tuple(float(v) for v in d["std"]), model_args=dict(args))


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int beyond float's range
        return False


def _check_hashes(raw: dict, where: str) -> None:
    """The SHA-256 a description records (``weights_sha256``, ``replay_sha256``...): 64 hex digits each."""
    for key, value in raw.items():
        if key.endswith("_sha256") and not (isinstance(value, str) and _SHA256.fullmatch(value)):
            shown = repr(value) if len(repr(value)) <= 60 else repr(value)[:57] + "..."
            raise CheckpointError(f"{where}: {key}: a SHA-256 of 64 hex digits expected, got {shown}")


def read_info(folder: str | Path) -> tuple[ModelInfo, dict]:
    """The :class:`ModelInfo` of a model directory, and the raw JSON (hash and extras).

    ``model.json`` is read only inside ``folder`` (:func:`edgerev.models.trust.confined`), and every field
    is checked (:meth:`ModelInfo.from_json`).

    Raises:
        CheckpointError: no description there, or a field missing or mistyped (naming the file and field).
        edgerev.errors.TrustError: ``model.json`` is a link out of ``folder``.
    """
    from edgerev.models.trust import confined

    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model directory {folder} does not exist")
    where = str(folder / INFO)
    confined(folder, INFO, where)  # a link out of the folder is refused before it is read
    raw = read_json(folder / INFO, "model description")
    _check_hashes(raw, where)
    return ModelInfo.from_json(raw, where), raw


def model_classes(folder: str | Path) -> tuple[str, ...]:
    """The classes of the model in ``folder``, in its output order (its ``model.json``).

    Raises:
        CheckpointError: no description there, or not a valid one.
        edgerev.errors.TrustError: ``model.json`` is a link out of ``folder``.
    """
    return read_info(folder)[0].classes
