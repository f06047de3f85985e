"""A model directory's description, ``model.json`` (:class:`ModelInfo`), read and written without torch.

What a model directory holds is said in :mod:`edgerev.models.directory`, which names everything here too.
Whatever needs only a model's description (its classes, its input) reads it here: the daemon's registry,
its status and its schedule run without loading torch, and a job reads the same classes the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from edgerev.atomic import atomic_write
from edgerev.errors import EdgerevError

INFO = "model.json"


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
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{what} {path} is not valid JSON: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{what} {path} does not hold a JSON object")
    return obj


@dataclass(frozen=True)
class ModelInfo:
    """What it takes to rebuild a model and feed it: architecture, arguments, classes, input.

    ``mean`` and ``std`` are per channel, on pixels scaled to 0..1: the model's input is
    ``(pixels / 255 - mean) / std``.
    """

    arch: str
    classes: tuple[str, ...]
    input_size: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.25, 0.25, 0.25)
    model_args: dict = field(default_factory=dict)  # create_model overrides, num_classes excluded

    def __post_init__(self) -> None:
        if len(self.classes) < 1 or len(set(self.classes)) != len(self.classes):
            raise CheckpointError(f"class names must be non-empty and distinct, got {list(self.classes)}")
        if len(self.mean) != len(self.std) or any(s <= 0 for s in self.std):
            raise CheckpointError("normalization needs one mean and one positive std per channel")

    def to_json(self) -> dict:
        d = asdict(self)
        d["classes"], d["mean"], d["std"] = list(self.classes), list(self.mean), list(self.std)
        return d

    @staticmethod
    def from_json(d: dict) -> ModelInfo:
        try:
            return ModelInfo(arch=d["arch"], classes=tuple(d["classes"]), input_size=int(d["input_size"]),
                             mean=tuple(float(v) for v in d["mean"]), std=tuple(float(v) for v in d["std"]),
                             model_args=dict(d.get("model_args", {})))
        except (KeyError, TypeError, ValueError) as e:
            raise CheckpointError(f"model description lacks or mistypes {e}") from None


def read_info(folder: str | Path) -> tuple[ModelInfo, dict]:
    """The :class:`ModelInfo` of a model directory, and the raw JSON (hash and extras)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise CheckpointError(f"model directory {folder} does not exist")
    raw = read_json(folder / INFO, "model description")
    return ModelInfo.from_json(raw), raw


def model_classes(folder: str | Path) -> tuple[str, ...]:
    """The classes of the model in ``folder``, in its output order (its ``model.json``).

    Raises:
        CheckpointError: no description there, or not a valid one.
    """
    return read_info(folder)[0].classes
