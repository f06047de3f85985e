"""The model directory on disk: safetensors for tensors, JSON for everything else, written so a crash never
leaves a half-written file where a reader would load it. (Rebuilding the model a directory holds is the
resolver's: :func:`edgerev.models.resolve.load_model`; :mod:`edgerev.train.checkpoint` names both.)

A *model directory* (a training run's output folder, or a daemon's version directory) holds:

- ``model.safetensors``: the weights and buffers (``state_dict``), no pickle;
- ``model.json``: :class:`ModelInfo` (architecture, its arguments, class names, input size,
  normalization) and the SHA-256 of ``model.safetensors``.

A model directory is data (:mod:`edgerev.models.trust`): its ``arch`` names a registry model, ``onnx`` or a
factory its owner allows, and each of its files is read only inside it.

Every file is written to a temporary name in the same folder, flushed and fsynced, then renamed over
its final name (an atomic switch on POSIX), and the folder is fsynced. ``model.json`` is written last
and names the hash of the weights it belongs to, so a reader that finds the two out of step (a crash
between the two renames) refuses them instead of loading a mix.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from torch import Tensor, nn

from edgerev.atomic import atomic_write
from edgerev.models.info import INFO, CheckpointError, ModelInfo, read_info, read_json, write_json  # noqa: F401 (named here too)
from edgerev.models.trust import confined

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
    mean = torch.tensor(info.mean, device=pixels.device).view(1, -1, 1, 1)
    std = torch.tensor(info.std, device=pixels.device).view(1, -1, 1, 1)
    return (pixels.float() / 255 - mean) / std


def save_model(folder: str | Path, model: nn.Module, info: ModelInfo, extra: dict | None = None) -> str:
    """Write ``model.safetensors`` then ``model.json`` into ``folder``; returns the weights' SHA-256."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _keep_onnx_source(folder, model, info)
    sha = save_tensors(folder / WEIGHTS, model.state_dict())
    write_json(folder / INFO, {**info.to_json(), "weights_sha256": sha, **(extra or {})})
    return sha


def _keep_onnx_source(folder: Path, model: nn.Module, info: ModelInfo) -> None:
    """An imported ONNX model's graph lives in its file: the model directory keeps a copy (``source.onnx``),
    written before the weights, so the directory rebuilds it alone (a daemon's versions outlive the file)."""
    if info.arch != "onnx":
        return
    source = getattr(model, "onnx_source", None)  # the original file's bytes (edgerev.models.onnx_import)
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
