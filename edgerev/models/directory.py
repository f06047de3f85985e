"""The model directory, the one module that names it: its description ``model.json`` (:class:`ModelInfo`), its
tensors, and the rebuild of the model it holds (:func:`load_model`, :func:`load_handle`, :func:`build_model`, the
resolver's: :mod:`edgerev.models.resolve`). Safetensors for tensors, JSON for everything else, written so a crash
never leaves a half-written file where a reader would load it.

A *model directory* (a training run's output folder, or a daemon's version directory) holds:

- ``model.safetensors``: the weights and buffers (``state_dict``), no pickle;
- ``model.json``: :class:`ModelInfo` (architecture, its arguments, class names, input size,
  normalization) and the SHA-256 of ``model.safetensors``;
- for an imported ONNX model, ``source.onnx``: a copy of its file (its graph lives there).

A model directory is data (:mod:`edgerev.models.trust`): its ``arch`` names a registry model, ``onnx`` or a
factory its owner allows, and each of its files is read only inside it.

Every file is written to a temporary name in the same folder, flushed and fsynced, then renamed over
its final name (an atomic switch on POSIX), and the folder is fsynced. ``model.json`` is written last
and names the hash of the weights it belongs to, so a reader that finds the two out of step (a crash
between the two renames) refuses them instead of loading a mix.

Importing this module imports no torch: whatever needs only a model's description (its classes, its input) reads
it here, so the daemon's registry, its status and its schedule run without loading torch; the functions that
read or write tensors import it when called.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from edgerev.atomic import atomic_write
from edgerev.errors import EdgerevError
from edgerev.lazy import lazy_attributes
from edgerev.models.trust import confined

if TYPE_CHECKING:  # annotations only: importing this module imports no torch (the handle module does)
    from edgerev.models.handle import ModelHandle, Tensor, nn

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


WEIGHTS = "model.safetensors"
ONNX_SOURCE = "source.onnx"  # the copy of an imported model's ONNX file (its graph lives there)


def sha256_file(path: str | Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def save_tensors(path: str | Path, tensors: dict[str, Tensor]) -> str:
    """Write ``tensors`` as safetensors atomically; returns the file's SHA-256."""
    from safetensors.torch import save

    data = save({k: v.detach().contiguous().cpu() for k, v in tensors.items()})
    atomic_write(path, data)
    return hashlib.sha256(data).hexdigest()


def load_tensors(path: str | Path, sha256: str | None = None) -> dict[str, Tensor]:
    """Read a safetensors file, refusing it if its hash is not ``sha256`` (when given).

    The file is read only inside its folder (:func:`edgerev.models.trust.confined`): a link out of it is
    refused before it is opened.

    Raises:
        CheckpointError: the file is missing, unreadable, not safetensors, or not the one ``sha256`` names.
        edgerev.errors.TrustError: the file leads outside its folder.
    """
    from safetensors import SafetensorError
    from safetensors.torch import load

    path = Path(path)
    confined(path.parent, path.name, f"weights file {path}")
    if not path.is_file():
        raise CheckpointError(f"weights file {path} does not exist")
    try:
        data = path.read_bytes()
    except OSError as e:
        raise CheckpointError(f"weights file {path} cannot be read ({e.strerror or type(e).__name__})") from None
    if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
        raise CheckpointError(f"{path} does not match the hash recorded beside it: incomplete or changed, not loaded")
    try:
        return load(data)
    except (SafetensorError, ValueError) as e:
        raise CheckpointError(f"{path} is not a valid safetensors file: {e}") from None


def normalize(pixels: Tensor, info: ModelInfo) -> Tensor:
    """``uint8 [B, C, H, W]`` pixels to the model's float input."""
    x = pixels.float()
    mean = x.new_tensor(info.mean).view(1, -1, 1, 1)
    std = x.new_tensor(info.std).view(1, -1, 1, 1)
    return (x / 255 - mean) / std


def save_model(folder: str | Path, model: nn.Module | ModelHandle, info: ModelInfo, extra: dict | None = None) -> str:
    """Write ``model.safetensors`` then ``model.json`` into ``folder``; returns the weights' SHA-256."""
    from edgerev.models.handle import ModelHandle

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _keep_onnx_source(folder, model, info)
    module = model.module if isinstance(model, ModelHandle) else model
    sha = save_tensors(folder / WEIGHTS, module.state_dict())
    write_json(folder / INFO, {**info.to_json(), "weights_sha256": sha, **(extra or {})})
    return sha


def _keep_onnx_source(folder: Path, model: nn.Module | ModelHandle, info: ModelInfo) -> None:
    """An imported ONNX model's graph lives in its file: the model directory keeps a copy (``source.onnx``),
    written before the weights, so the directory rebuilds it alone (a daemon's versions outlive the file)."""
    if info.arch != "onnx":
        return
    from edgerev.models.handle import describe

    source = describe(model).onnx_source  # the original file's bytes (edgerev.models.onnx_import)
    if not isinstance(source, bytes):
        raise CheckpointError("an imported ONNX model must carry onnx_source (the bytes of the file it came from)")
    target = folder / ONNX_SOURCE
    if target.is_file() and target.stat().st_size == len(source) and target.read_bytes() == source:
        return
    atomic_write(target, source)


def load_state(model: nn.Module, state: dict[str, Tensor], where: str) -> None:
    """``load_state_dict`` with one clear error when names or shapes do not match."""
    own = model.state_dict()
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    shapes = [f"{k} ({_shape(state[k])} in the file, {_shape(own[k])} in the model)"
              for k in own if k in state and own[k].shape != state[k].shape]
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing {', '.join(missing[:3])}")
        if unexpected:
            parts.append(f"unexpected {', '.join(unexpected[:3])}")
        if shapes:
            parts.append(f"shape of {', '.join(shapes[:3])}")
        raise CheckpointError(f"weights in {where} do not fit the model ({'; '.join(parts)})")
    model.load_state_dict(state)


def _shape(t: Tensor) -> str:
    return "x".join(map(str, t.shape)) or "scalar"


#: the rebuild of the model a directory holds is the resolver's; it is named here too
__getattr__, __dir__ = lazy_attributes(__name__, dict.fromkeys(("build_model", "load_handle", "load_model"),
                                                               "edgerev.models.resolve"), globals())
