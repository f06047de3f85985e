"""A model directory's description read without torch (edgerev.models.directory), and what reads it so: the classes
a daemon's schedule knows, the input size a daemon's image_size defaults to."""

from __future__ import annotations

import json

import pytest

from edgerev.models.carried import carried_image_size
from edgerev.models.directory import CheckpointError, ModelInfo, model_classes, read_info

INFO = {"arch": "revnext", "classes": ["cat", "dog"], "input_size": 48, "mean": [0.5] * 3, "std": [0.25] * 3}


def _dir(tmp_path, described):
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.json").write_text(described if isinstance(described, str) else json.dumps(described))
    return folder


def test_a_valid_description_gives_its_classes_and_input_size(tmp_path):
    folder = _dir(tmp_path, INFO)
    info, raw = read_info(folder)
    assert info == ModelInfo.from_json(INFO) and raw == INFO
    assert model_classes(folder) == ("cat", "dog") and carried_image_size(str(folder)) == 48


@pytest.mark.parametrize("described", [
    "{not json", "[1, 2]", {**INFO, "classes": []}, {**INFO, "classes": ["cat", "cat"]},
    {k: v for k, v in INFO.items() if k != "arch"}, {**INFO, "input_size": "big"}, {**INFO, "std": [0.0] * 3},
])
def test_a_description_the_loader_refuses_gives_no_classes_and_no_size(tmp_path, described):
    folder = _dir(tmp_path, described)
    with pytest.raises(CheckpointError):
        model_classes(folder)
    assert carried_image_size(str(folder)) is None


def test_no_description_at_all(tmp_path):
    (tmp_path / "model").mkdir()
    with pytest.raises(CheckpointError, match="does not exist"):
        model_classes(tmp_path / "model")
    assert carried_image_size(str(tmp_path / "model")) is None
