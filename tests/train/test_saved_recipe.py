"""The recipe saved beside a run is what was trained: a format version, only the fields of each source's
kind, and the caller's images said as such (never the recipe's defaults they replaced)."""

import pytest
import yaml

from edgerev.config import ConfigError, from_dict, load_yaml, to_dict
from edgerev.train.config import FORMAT, RunConfig
from edgerev.train.data import DataError
from edgerev.train.labeled import load_source
from edgerev.train.trainer import train
from edgerev_daemon.service.demo import write_images

from .test_trainer import recipe


def test_a_folder_run_saves_only_what_a_folder_source_means_and_reads_back_the_same(tmp_path):
    write_images(tmp_path / "images", 64, range(4), num_classes=4, size=16)
    c = recipe(train__epochs=1)
    c["data"] = {"size": 16, "train": {"kind": "folder", "path": str(tmp_path / "images")}}
    cfg = from_dict(RunConfig, c)
    r = train(cfg, tmp_path / "run", progress=False)
    saved = yaml.safe_load((r.out / "config.yaml").read_text())
    assert saved["format"] == FORMAT and list(saved)[0] == "format"
    assert saved["data"]["train"] == {"kind": "folder", "path": str(tmp_path / "images")}
    assert from_dict(RunConfig, load_yaml(r.out / "config.yaml")) == cfg


def test_a_run_on_given_images_saves_them_as_provided_and_resumes(tmp_path):
    cfg = from_dict(RunConfig, recipe(train__epochs=2))
    given = (load_source(cfg.data.train, 16), load_source(cfg.data.val, 16))
    calls = {"n": 0}

    def stop_once():
        calls["n"] += 1
        return calls["n"] == 3

    r = train(cfg, tmp_path / "run", progress=False, data=given, stop=stop_once, source="a store, batches 1-4")
    saved = yaml.safe_load((r.out / "config.yaml").read_text())
    assert saved["data"]["train"] == {"kind": "provided", "samples": 256,
                                      "description": "training: a store, batches 1-4"}
    assert saved["data"]["val"] == {"kind": "provided", "samples": 128,
                                    "description": "validation: a store, batches 1-4"}
    assert r.status == "stopped"
    done = train(None, r.out, resume=True, progress=False, data=given)
    assert done.status == "done" and yaml.safe_load((r.out / "config.yaml").read_text()) == saved


def test_a_provided_source_is_not_read_from_a_recipe():
    cfg = from_dict(RunConfig, {"data": {"train": {"kind": "provided", "samples": 10, "description": "x"}}})
    with pytest.raises(DataError, match="a provided source .* is not read from a recipe"):
        load_source(cfg.data.train, 16)


def test_a_recipe_of_a_later_format_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=rf"^format: {FORMAT + 1} is newer than this edgerev reads"):
        from_dict(RunConfig, {"format": FORMAT + 1})
    with pytest.raises(ConfigError, match="^format: must be at least 1"):
        from_dict(RunConfig, {"format": 0})
    assert to_dict(RunConfig())["format"] == FORMAT
