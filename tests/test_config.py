"""The recipe: every key validated with an error that names it; the resolved config reads back the same."""

import pytest

from edgerev.config import ConfigError, dump_yaml, from_dict, load_yaml, to_dict
from edgerev.train.config import RunConfig, load_config


@pytest.mark.parametrize("data, message", [
    ({"trian": {}}, "trian: unknown key; expected one of format, model, data"),
    ({"train": {"epochs": "ten"}}, "train.epochs: expected int, got str 'ten'"),
    ({"train": {"epochs": 2.5}}, "train.epochs: expected int, got float 2.5"),
    ({"train": {"epochs": True}}, "train.epochs: expected int, got bool True"),
    ({"train": {"epochs": 0}}, "train.epochs: must be at least 1, got 0"),
    ({"optim": {"nesterov": "yes"}}, "optim.nesterov: expected bool, got str 'yes'"),
    ({"optim": {"schedule": "cosine"}}, "optim.schedule: expected one of 'onecycle' or 'linear' or 'constant'"),
    ({"optim": {"lr": -1}}, "optim.lr: must be positive"),
    ({"data": {"train": {"kind": "folder"}}}, "data.train.path: a folder source needs a local path"),
    ({"data": {"train": {"classes": [0, "x"]}}}, "data.train.classes[1]: expected int, got str 'x'"),
    ({"data": {"train": {"colour": 1}}}, "data.train.colour: unknown key"),
    ({"data": {"val": 3}}, "data.val: expected a mapping, got int 3"),
    ({"data": []}, "data: expected a mapping, got list []"),
    ({"model": {"arch": "vgg"}}, "model.arch: unknown architecture 'vgg'"),
    ({"model": {"args": {"num_classes": 3}}}, "model.args.num_classes: set by the data's classes"),
    ({"model": {"args": [1]}}, "model.args: expected mapping, got list [1]"),
    ({"memory": {"budget": "lots"}}, "memory.budget: cannot read 'lots' as a size in bytes"),
    ({"model": {"mean": [0.5, 0.5, 0.5]}}, "model.std: the normalization needs both mean and std"),
    ({"model": {"mean": [0.5], "std": [0.2, 0.2]}}, "model.std: has 2 values, mean 1"),
    ({"model": {"mean": [0.5], "std": [0.0]}}, "model.std[0]: must be positive, got 0.0"),
    ({"model": {"mean": "grey", "std": [0.2]}}, "model.mean: expected list of float, got str 'grey'"),
    ({"memory": {"budget": "100MiB", "mode": "plain"}}, "memory.mode: a budget needs mode auto"),
    ({"device": "tpu"}, "device: expected one of 'cpu' or 'cuda' or 'auto', got str 'tpu'"),
    ({"continual": {"replay": -5}}, "continual.replay: must be >= 0, got -5"),
])
def test_bad_keys_and_types_are_named(data, message):
    with pytest.raises(ConfigError) as e:
        from_dict(RunConfig, data)
    assert message in str(e.value), str(e.value)


def test_defaults_are_the_paper_recipe():
    cfg = from_dict(RunConfig, {})
    assert (cfg.optim.peak("scratch"), cfg.optim.momentum, cfg.optim.nesterov, cfg.optim.weight_decay) == (
        0.4, 0.9, True, 5e-4)
    # the rate is the model's to choose (null): a fine-tuning one for a pretrained model, lower without batch norm
    assert cfg.optim.lr is None and (cfg.optim.peak("pretrained"), cfg.optim.peak("folded")) == (0.01, 0.01)
    assert from_dict(RunConfig, {"optim": {"lr": 0.2}}).optim.peak("pretrained") == 0.2  # a recipe's rate stays
    assert cfg.optim.schedule == "onecycle" and cfg.model.arch == "revnext"


def test_resolved_config_reads_back_the_same(tmp_path):
    cfg = from_dict(RunConfig, {"data": {"train": {"classes": [1, 2]}, "val": {"start": 10}},
                                "memory": {"budget": "64MiB"}, "optim": {"lr": 1}})
    assert cfg.optim.lr == 1.0 and isinstance(cfg.optim.lr, float)
    dump_yaml(tmp_path / "c.yaml", cfg)
    again = load_config(tmp_path / "c.yaml")
    assert again == cfg and to_dict(again) == to_dict(cfg)


@pytest.mark.parametrize("text, message", [
    ("train: [1, 2", "is not valid YAML"),
    ("- 1\n- 2\n", "must hold a mapping at the top level, got list"),
])
def test_bad_files(tmp_path, text, message):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_yaml(path)


def test_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")


def test_presets_are_valid():
    from pathlib import Path

    root = Path(__file__).parent.parent / "configs"
    presets = sorted(p for p in root.glob("*.yaml"))
    assert presets, "configs/ holds no training preset"
    for p in presets:
        load_config(p)
