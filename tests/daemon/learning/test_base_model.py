"""A daemon that starts from a base model: it becomes v0001, predicts at once, and each job fine-tunes it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from edgerev.models.directory import ModelInfo, save_model, save_tensors
from edgerev.models.resolve import resolve_model
from edgerev_daemon.config import config_from_dict
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.demo import write_images
from tests.daemon.conftest import Clock
from tests.resolve_factories import TinyNet

ARGS = {"width": 8, "blocks": [1, 1, 1, 1, 1]}


def config_for(tmp_path: Path, model: dict):
    return config_from_dict({
        "data_dir": str(tmp_path / "data"), "image_size": 16, "heldout_fraction": 0.2,
        "ingest": {"settle_seconds": 0.0}, "schedule": {"min_new_samples": 40, "max_interval_seconds": 3600.0},
        "training": {"model": model, "train": {"epochs": 1, "batch": 16}, "optim": {"lr": 0.05},
                     "continual": {"replay": 50, "distill": 1.0}},
        "promotion": {"keep_last": 1, "exporter": "legacy"},
    })


def base_directory(tmp_path: Path) -> Path:
    """An owner's pretrained model directory (two of the demo's classes, its own normalization)."""
    torch.manual_seed(0)
    model = resolve_model("revnext", args=ARGS, num_classes=2)
    info = ModelInfo("revnext", ("class0", "class1"), 16, (0.4, 0.4, 0.4), (0.2, 0.2, 0.2), ARGS)
    save_model(tmp_path / "base", model, info)
    return tmp_path / "base"


@pytest.mark.slow  # a job and two exports: ~15 s CPU
def test_a_base_model_with_classes_becomes_v0001_and_the_first_job_fine_tunes_it(tmp_path):
    base = base_directory(tmp_path)
    config = config_for(tmp_path, {"arch": f"{base}/"})
    with Daemon(config, clock=Clock()) as d:
        r = d.cycle()  # nothing in the inbox: the base model is installed before any data
        assert r.base == "v0001" and r.job is None
        current = Path(config.data_dir) / os.readlink(Path(config.data_dir) / "current")
        assert current.name == "v0001" and (current / "model.onnx").is_file()
        info = json.loads((current / "model.json").read_text())
        assert info["classes"] == ["class0", "class1"] and info["mean"] == [0.4, 0.4, 0.4]
        assert d.store.get_version("v0001").metrics["base"] == f"{base}/"
        assert d.cycle().base is None  # once

        write_images(config.inbox_path, 60, [0, 1, 2], num_classes=4, size=16)
        job = d.cycle().job
        assert job is not None and job["version"] == "v0002"
        if job["promoted"]:  # keep_last 1 prunes the old versions, never the base: the last resort
            assert (Path(config.data_dir) / "versions" / "v0001").is_dir()
        grown = json.loads((Path(config.data_dir) / "versions" / "v0002" / "model.json").read_text()) \
            if job["promoted"] else None
        if grown is not None:  # the base's classes first, its rows kept; the new label after them
            assert grown["classes"][:2] == ["class0", "class1"] and "class2" in grown["classes"]


def test_a_base_model_without_class_names_is_where_the_first_job_starts(tmp_path):
    torch.save(TinyNet(classes=10).state_dict(), tmp_path / "w.pt")
    config = config_for(tmp_path, {"arch": "tests.resolve_factories:tiny", "weights": str(tmp_path / "w.pt")})
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().base is None
        assert d.registry.current() is None and d.store.versions() == []


def test_a_registry_name_without_weights_is_no_base_model(tmp_path):
    config = config_for(tmp_path, {"arch": "revnext", "args": ARGS})
    with Daemon(config, clock=Clock()) as d:
        assert d.cycle().base is None and d.registry.current() is None


def test_a_state_dict_base_is_refused_at_start_when_it_does_not_fit(tmp_path):
    save_tensors(tmp_path / "w.safetensors", {"nope": torch.zeros(1)})
    config = config_for(tmp_path, {"arch": "tests.resolve_factories:tiny", "weights": str(tmp_path / "w.safetensors")})
    try:
        Daemon(config, clock=Clock())
    except ValueError as e:
        assert "unexpected nope" in str(e) and "\n" not in str(e)
    else:
        raise AssertionError("the daemon started with weights that do not fit")


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as a user's file was written
def test_the_image_size_defaults_to_the_one_the_base_carries(tmp_path):
    """image_size left out: a model directory's input size, an ONNX file's fixed height and width, else 32; a size
    the config names is kept."""
    from edgerev.models.designs import mobilenet_v2

    def image_size(model: dict, **extra) -> int:
        return config_from_dict({"data_dir": str(tmp_path / "data"), "training": {"model": model}, **extra}).image_size

    assert image_size({"arch": str(base_directory(tmp_path))}) == 16
    net = mobilenet_v2(num_classes=2, width=0.25).eval()
    torch.onnx.export(net, (torch.zeros(1, 3, 24, 24),), str(tmp_path / "base.onnx"), dynamo=False,
                      input_names=["image"], dynamic_axes={"image": {0: "n"}})
    assert image_size({"arch": str(tmp_path / "base.onnx")}) == 24
    assert image_size({"arch": str(tmp_path / "base.onnx")}, image_size=48) == 48
    assert image_size({"arch": "revnext"}) == 32
    assert image_size({"arch": str(tmp_path / "missing.onnx")}) == 32  # the model's own check refuses it later
