"""The daemon's config: every key and type checked with an error that names it; paths checked at start
before anything is created."""

from __future__ import annotations

import os
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.config import ConfigError, byte_size, to_dict
from edgerev.sizes import ByteSize
from edgerev_daemon import config_from_dict, load_config, validate_paths


@pytest.mark.parametrize("data, message", [
    ({"data_dir": "d", "trainig": {}}, "trainig: unknown key; expected one of data_dir, inbox"),
    ({"data_dir": "d", "training": {"train": {"epochs": "ten"}}}, "training.train.epochs: expected int, got str 'ten'"),
    ({"data_dir": "d", "training": {"epoch": 3}}, "training.epoch: unknown key"),
    ({"data_dir": "d", "training": {"optim": {"lr": "fast"}}}, "training.optim.lr: expected float, got str 'fast'"),
    ({"data_dir": "d", "training": {"model": {"arch": "vgg"}}}, "training.model.arch: unknown architecture 'vgg'"),
    ({"data_dir": "d", "training": {"memory": {"budget": "lots"}}}, "training.memory.budget: cannot read 'lots'"),
    ({"data_dir": "d", "training": {"memory": {"budget": -1}}}, "training.memory.budget: a size in bytes must be"),
    ({"data_dir": "d", "training": {"memory": {"budget": 0}}}, "training.memory.budget: a size in bytes must be"),
    ({"data_dir": "d", "training": {"memory": {"budget": "9EiB"}}}, "training.memory.budget: cannot read '9EiB'"),
    ({"data_dir": "d", "training": {"memory": {"budget": "1e18"}}}, "training.memory.budget: '1e18' is more bytes"),
    ({"data_dir": "d", "training": {"model": {"init": "x"}}}, "training.model.init: is the daemon's"),
    ({"data_dir": "d", "training": {"memory": {"budget": [1]}}},
     "training.memory.budget: expected a size in bytes (an int, or a string such as 400MiB), got [1]"),
    ({"data_dir": "d", "training": {"model": {"args": {"num_classes": 3}}}}, "training.model.args.num_classes"),
    ({"data_dir": "d", "limits": {"max_pixels": "many"}}, "limits.max_pixels: expected int, got str 'many'"),
    ({"data_dir": "d", "limits": {"extensions": [".gif"]}}, "limits.extensions: '.gif' is not supported"),
    ({"data_dir": "d", "limits": {"max_file_size": "0MiB"}}, "limits.max_file_size:"),
    ({"data_dir": "d", "http": {"host": "0.0.0.0"}}, "http.host: must be a loopback address"),
    ({"data_dir": "d", "http": {"port": 70000}}, "http.port: must lie in 1..65535"),
    ({"data_dir": "d", "http": {"enabled": "yes"}}, "http.enabled: expected bool, got str 'yes'"),
    ({"data_dir": "d", "heldout_fraction": 1.0}, "heldout_fraction: must lie strictly between 0 and 1"),
    ({"data_dir": "d", "image_size": 2}, "image_size: must lie in 4..1024"),
    ({"data_dir": "d", "schedule": {"min_new_samples": 0}}, "schedule.min_new_samples: must be at least 1"),
    ({"data_dir": "d", "promotion": {"tolerance": 0.02}}, "promotion.tolerance: removed: the gate decides on paired "
                                                          "evidence now"),
    ({"data_dir": "d", "promotion": {"alpha": 0.0}}, "promotion.alpha: is a p-value threshold in (0, 0.5]"),
    ({"data_dir": "d", "promotion": {"forgetting_margin": 1.5}}, "promotion.forgetting_margin: is a fraction"),
    ({"data_dir": "d", "promotion": {"recent_window_days": 0}}, "promotion.recent_window_days: must be positive"),
    ({"data_dir": "d", "promotion": {"keep_last": 0}}, "promotion.keep_last: must be at least 1"),
    ({"data_dir": "d", "promotion": {"exporter": "onnx"}},
     "promotion.exporter: expected one of 'auto' or 'dynamo' or 'legacy', got str 'onnx'"),
    ({"data_dir": "d", "log_level": "LOUD"}, "log_level: expected one of 'DEBUG'"),
    ({"data_dir": 5}, "data_dir: expected str, got int 5"),
    ({"inbox": "x"}, "missing required key 'data_dir'"),
    ({"data_dir": "d", "ingest": []}, "ingest: expected a mapping, got list []"),
])
def test_bad_keys_and_types_are_named(data, message):
    with pytest.raises(ConfigError) as e:
        config_from_dict(data)
    assert message in str(e.value), str(e.value)


def test_defaults_and_derived_values(tmp_path):
    cfg = config_from_dict({"data_dir": "d", "limits": {"max_file_size": "2MiB", "extensions": ["PNG"]},
                            "training": {"memory": {"budget": "400MiB"}}}, base=tmp_path)
    assert cfg.data_dir == str(tmp_path / "d") and cfg.inbox_path == tmp_path / "d" / "inbox"
    assert cfg.limits.max_file_size == 2 * 2**20 and cfg.limits.extensions == (".png",)
    assert cfg.training.memory.budget == 400 * 2**20 and type(cfg.training.memory.budget) is not str
    assert not cfg.http.enabled and cfg.http.host == "127.0.0.1"
    assert config_from_dict({"data_dir": "d"}).training.memory.budget is None
    # a section given in part keeps the daemon's defaults for the rest
    partial = config_from_dict({"data_dir": "d", "training": {"train": {"epochs": 7}}}).training
    assert (partial.train.epochs, partial.train.batch, partial.optim.lr) == (7, 64, 0.05)


def test_the_exporters_a_daemon_takes_are_the_exports():
    """``promotion.exporter`` is written out in the config (which imports no torch): the names export takes."""
    import typing

    from edgerev.export.onnx import EXPORTERS
    from edgerev_daemon.config import PromotionConfig

    assert typing.get_args(typing.get_type_hints(PromotionConfig)["exporter"]) == EXPORTERS
    assert config_from_dict({"data_dir": "d"}).promotion.exporter == "auto"


# every size in bytes of the daemon's config: (section, key)
SIZE_KEYS = (("limits", "max_file_size"), ("storage", "min_free_space"), ("storage", "max_bytes"),
             ("storage", "max_quarantine_bytes"))
UNITS = {"": 1, "B": 1, "KiB": 2**10, "MiB": 2**20, "kB": 10**3, "MB": 10**6}


def sized(section: str, key: str, value) -> dict:
    """A daemon config whose ``section.key`` is ``value`` (a budget keeps quarantine's bound below it)."""
    given = {key: value} | ({"max_quarantine_bytes": 1} if key == "max_bytes" else {})
    return {"data_dir": "d", section: given}


@settings(max_examples=40, deadline=None)
@given(where=st.sampled_from(SIZE_KEYS), n=st.integers(2, 4096), unit=st.sampled_from(sorted(UNITS)))
def test_a_size_as_a_string_and_as_its_int_give_the_same_config(where, n, unit):
    """Read once where the config is built: every reader gets the bytes as a ByteSize, whichever way they were
    written, from a file or in code, and the resolved config reads back to the same value."""
    section, key = where
    as_text = config_from_dict(sized(section, key, f"{n}{unit}"))
    as_int = config_from_dict(sized(section, key, n * UNITS[unit]))
    assert as_text == as_int
    value = getattr(getattr(as_text, section), key)
    assert type(value) is ByteSize and value == n * UNITS[unit]
    in_code = replace(getattr(as_int, section), **{key: f"{n}{unit}"})
    assert in_code == getattr(as_int, section) and type(getattr(in_code, key)) is ByteSize
    assert config_from_dict(yaml.safe_load(yaml.safe_dump(to_dict(as_text)))) == as_text


@pytest.mark.parametrize("where", SIZE_KEYS)
@pytest.mark.parametrize("bad", ["lots", "-1MiB", "0MiB", "9EiB", "1e18", [1], True])
def test_a_bad_size_names_its_key_path(where, bad):
    section, key = where
    with pytest.raises(ConfigError, match=rf"^{section}\.{key}: "):
        config_from_dict(sized(section, key, bad))
    with pytest.raises(ConfigError, match=rf"^{key}: "):  # given in code, the section's own key
        replace(getattr(config_from_dict({"data_dir": "d"}), section), **{key: bad})


@pytest.mark.parametrize("where", SIZE_KEYS)
@pytest.mark.parametrize("bad", ["lots", "-1MiB", "0MiB", "9EiB", "1e18"])
def test_a_bad_size_string_says_why_whatever_else_its_key_takes(where, bad):
    """A size key that also takes 0 or null (``min_free_space``, ``max_bytes``) reports the size's own reason
    for a string that is no size, as a key that takes only sizes does, not the union's list of types."""
    section, key = where
    with pytest.raises(ConfigError) as e:
        config_from_dict(sized(section, key, bad))
    with pytest.raises(ConfigError) as only_sizes:
        byte_size(bad, f"{section}.{key}")
    assert str(e.value) == str(only_sizes.value)


@pytest.mark.parametrize("zero", [0, "0"])
def test_min_free_space_zero_is_no_floor(zero):
    cfg = config_from_dict({"data_dir": "d", "storage": {"min_free_space": zero}})
    assert cfg.storage.min_free_space == 0 and type(cfg.storage.min_free_space) is int
    assert config_from_dict(to_dict(cfg)) == cfg
    assert config_from_dict({"data_dir": "d"}).storage.min_free_space == 100 * 2**20


def test_file_paths_are_relative_to_the_config_file(tmp_path):
    folder = tmp_path / "etc"
    folder.mkdir()
    (folder / "daemon.yaml").write_text(yaml.safe_dump({"data_dir": "../var", "inbox": "/srv/inbox",
                                                        "training": {"train": {"epochs": 2}}}))
    cfg = load_config(folder / "daemon.yaml")
    assert Path(cfg.data_dir) == (folder / "../var").absolute() and cfg.inbox == "/srv/inbox"
    assert cfg.training.train.epochs == 2
    # the resolved config reads back to the same value
    assert config_from_dict(to_dict(cfg)) == cfg


def test_unreadable_yaml_is_one_error(tmp_path):
    (tmp_path / "bad.yaml").write_text("data_dir: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.yaml")


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_validate_paths_touches_nothing(tmp_path):
    cfg = config_from_dict({"data_dir": str(tmp_path / "a" / "data")})
    validate_paths(cfg)
    assert _tree(tmp_path) == []  # neither the data directory nor the inbox was created


def test_inbox_that_is_a_file_is_refused_before_anything_is_created(tmp_path):
    (tmp_path / "inbox").write_text("not a folder")
    cfg = config_from_dict({"data_dir": str(tmp_path / "data"), "inbox": str(tmp_path / "inbox")})
    with pytest.raises(ConfigError, match=r"^inbox: .*inbox exists and is not a directory"):
        validate_paths(cfg)
    assert _tree(tmp_path) == ["inbox"]


def test_data_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "data").write_text("x")
    with pytest.raises(ConfigError, match="data_dir: .* exists and is not a directory"):
        validate_paths(config_from_dict({"data_dir": str(tmp_path / "data")}))


@pytest.mark.parametrize("inbox, message", [
    ("data", "must not be the data directory itself"),
    (".", "contains the data directory"),
    ("data/blobs/x", "lies inside the daemon's own"),
])
def test_inbox_overlapping_the_data_dir_is_refused(tmp_path, inbox, message):
    cfg = config_from_dict({"data_dir": "data", "inbox": inbox}, base=tmp_path)
    with pytest.raises(ConfigError, match=message):
        validate_paths(cfg)


def _writes_despite_mode(folder: Path) -> bool:
    """Whether this process can write in ``folder`` although its mode forbids it (root can)."""
    try:
        fd, name = tempfile.mkstemp(dir=folder)
    except PermissionError:
        return False
    os.close(fd)
    os.unlink(name)
    return True


@pytest.mark.parametrize("where", ["data_dir", "parent"])
def test_unwritable_data_dir_is_refused(tmp_path, where):
    parent = tmp_path / "ro"
    parent.mkdir()
    target = parent / "data"
    if where == "data_dir":
        target.mkdir()
    locked = target if where == "data_dir" else parent
    locked.chmod(0o555)
    try:
        if _writes_despite_mode(locked):
            pytest.skip("running as root: a read-only mode does not stop writes here")
        with pytest.raises(ConfigError, match="data_dir: cannot write in"):
            validate_paths(config_from_dict({"data_dir": str(target), "inbox": str(tmp_path / "inbox")}))
    finally:
        locked.chmod(0o755)


def test_write_probe_is_real(tmp_path, monkeypatch):
    """The check writes a file rather than trusting mode bits (which say nothing about read-only
    mounts, ACLs or a sandbox): a refused write is refused whoever runs it, root included."""
    def refuse(*args, **kwargs):
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "mkstemp", refuse)
    with pytest.raises(ConfigError, match=r"data_dir: cannot write in directory .* \(Read-only file system\)"):
        validate_paths(config_from_dict({"data_dir": str(tmp_path)}))


def test_a_config_written_before_the_training_section_embedded_the_recipe_says_where_each_key_went():
    with pytest.raises(ConfigError) as e:
        config_from_dict({"data_dir": "d", "training": {"arch": "revnext", "epochs": 3, "memory_budget": "6MiB"}})
    assert str(e.value) == ("training.arch is now training.model.arch; training.epochs is now training.train.epochs; "
                            "training.memory_budget is now training.memory.budget (the training section takes the "
                            "trainer's recipe sections; see configs/daemon/)")
