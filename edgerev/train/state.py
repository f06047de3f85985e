"""Training checkpoints that a killed run resumes from at the step it reached.

``OUT/checkpoints/step-NNNNNNN.safetensors`` holds the model's and the optimizer's tensors;
``OUT/checkpoints/latest.json`` names that file, its SHA-256, the step and epoch, and the optimizer's
non-tensor state. Both are written atomically, the tensors first: ``latest.json`` is the commit
point, so a crash at any instant leaves either the previous checkpoint or the new one in force,
never a mix, and a file whose hash does not match is refused. Older step files are deleted only
after the new ``latest.json`` is in place.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor, nn

from edgerev.models.directory import CheckpointError, load_state, load_tensors, read_json, save_tensors, write_json

FOLDER = "checkpoints"
LATEST = "latest.json"


@dataclass(frozen=True)
class Resumed:
    step: int
    epoch: int
    extra: dict


def _split_optimizer(optimizer: torch.optim.Optimizer) -> tuple[dict[str, Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, rest = {}, {}
    for idx, entries in sd["state"].items():
        for name, value in entries.items():
            if isinstance(value, Tensor):
                tensors[f"optim.{idx}.{name}"] = value
            else:
                rest.setdefault(str(idx), {})[name] = value
    return tensors, {"param_groups": sd["param_groups"], "state": rest}


def save_checkpoint(out: str | Path, step: int, epoch: int, model: nn.Module, optimizer: torch.optim.Optimizer,
                    extra: dict | None = None) -> Path:
    """Write the checkpoint of ``step`` and make it the one a resume loads."""
    folder = Path(out) / FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    opt_tensors, opt_rest = _split_optimizer(optimizer)
    tensors = {f"model.{k}": v for k, v in model.state_dict().items()} | opt_tensors
    name = f"step-{step:07d}.safetensors"
    sha = save_tensors(folder / name, tensors)
    write_json(folder / LATEST, {"step": step, "epoch": epoch, "file": name, "sha256": sha,
                                 "optimizer": opt_rest, "extra": extra or {}})
    for old in folder.glob("step-*.safetensors"):
        if old.name != name:
            old.unlink()
    return folder / name


def has_checkpoint(out: str | Path) -> bool:
    return (Path(out) / FOLDER / LATEST).is_file()


def load_checkpoint(out: str | Path, model: nn.Module, optimizer: torch.optim.Optimizer) -> Resumed:
    """Load the latest checkpoint of the run in ``out`` into ``model`` and ``optimizer``."""
    folder = Path(out) / FOLDER
    meta = read_json(folder / LATEST, "checkpoint record")
    try:
        name, sha, step, epoch = meta["file"], meta["sha256"], int(meta["step"]), int(meta["epoch"])
        opt_rest = meta["optimizer"]
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"{folder / LATEST} lacks or mistypes {e}") from None
    if Path(name).name != name:
        raise CheckpointError(f"{folder / LATEST} names a file outside its folder: {name!r}")
    tensors = load_tensors(folder / name, sha)
    load_state(model, {k[6:]: v for k, v in tensors.items() if k.startswith("model.")}, str(folder / name))
    state: dict = {}
    for k, v in tensors.items():
        if k.startswith("optim."):
            _, idx, field = k.split(".", 2)
            state.setdefault(int(idx), {})[field] = v
    for idx, entries in opt_rest.get("state", {}).items():
        state.setdefault(int(idx), {}).update(entries)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": opt_rest["param_groups"]})
    except (KeyError, ValueError) as e:
        raise CheckpointError(f"optimizer state in {folder} does not fit this run: {e}") from None
    return Resumed(step, epoch, dict(meta.get("extra", {})))
