"""The trust boundary (edgerev.models.trust): a model file never names code to run, every file a model names is
read inside its folder, and a bad file is one line from the API, the CLI (exit 2) and the daemon's start."""

from __future__ import annotations

import importlib
import json
import os
import sys
from importlib.metadata import EntryPoint

import pytest

import edgerev
from edgerev.cli import main
from edgerev.errors import EdgerevError, TrustError, UnsupportedModel
from edgerev.exits import USAGE
from edgerev.models.directory import CheckpointError, ModelInfo, load_model, save_model
from edgerev.models.resolve import resolve_model
from edgerev.train.config import ModelConfig
from tests.models.model_files import VALID_INFO, classifier, model_directory, save_onnx, with_external_data
from tests.resolve_factories import TinyNet, tiny

TINY = "tests.resolve_factories:tiny"
EVIL_MODULE = "edgerev_trust_test_evil"


@pytest.fixture
def no_imports(monkeypatch):
    """Every ``importlib.import_module`` call, recorded (the lazy names of edgerev's own packages still load)."""
    calls: list[str] = []
    real = importlib.import_module

    def recording(name, package=None):
        calls.append(name)
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", recording)
    return calls


@pytest.fixture
def evil(tmp_path, monkeypatch):
    """A module on the path that leaves a marker when imported, and a marker for ``os.system``."""
    (tmp_path / "lib").mkdir()
    marker = tmp_path / "MARKER"
    (tmp_path / "lib" / f"{EVIL_MODULE}.py").write_text(
        f"open({str(tmp_path / 'IMPORTED')!r}, 'w').close()\n\ndef build(**kwargs):\n    raise SystemExit\n")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    return marker


def one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


def _run_cli(argv, capsys) -> str:
    """The command's one error line; the planner's progress lines, which it writes once planning has taken a few
    seconds (on a loaded machine, sometimes), are not the error."""
    rc = main(argv)
    err = "".join(line for line in capsys.readouterr().err.splitlines(keepends=True)
                  if not line.startswith("planning: "))
    assert rc == USAGE and err.count("\n") == 1, err
    return err


@pytest.mark.parametrize("arch, args", [("os:system", {"command": "touch {marker}"}),
                                        (f"{EVIL_MODULE}:build", {})])
def test_a_model_directory_naming_code_runs_nothing(tmp_path, evil, no_imports, capsys, arch, args):
    """The issue's model.json: refused from the string alone, before any import, through every way in."""
    args = {k: v.format(marker=evil) for k, v in args.items()}
    folder = model_directory(tmp_path / "m", {**VALID_INFO, "arch": arch, "model_args": args})
    for call in (lambda: resolve_model(str(folder)), lambda: load_model(folder),
                 lambda: edgerev.plan(str(folder), size=8, budget="64MiB")):
        with pytest.raises(TrustError) as e:
            call()
        assert one_line(e.value).startswith(f"{folder / 'model.json'}: arch: {arch!r} is a factory")
    err = _run_cli(["plan", "--arch", str(folder), "--size", "8", "--budget", "64MiB"], capsys)
    assert err.startswith(f"edgerev plan: error: {folder / 'model.json'}: arch: ")
    module = arch.partition(":")[0]
    assert not any(n == module or n.startswith(module + ".") for n in no_imports), no_imports
    assert not evil.exists() and not (tmp_path / "IMPORTED").exists() and EVIL_MODULE not in sys.modules


@pytest.mark.parametrize("arch", ["./elsewhere", "../up/m.onnx", "/abs/path", "m.onnx", "vgg", "", "os.system"])
def test_a_model_directory_names_a_registry_model_onnx_or_an_allowed_factory_only(tmp_path, arch):
    folder = model_directory(tmp_path / "m", {**VALID_INFO, "arch": arch})
    with pytest.raises((TrustError, CheckpointError)) as e:
        load_model(folder)
    assert one_line(e.value).startswith(f"{folder / 'model.json'}: arch: ")


def _tiny_run(tmp_path):
    model = resolve_model(TINY, args={"width": 3}, num_classes=2)
    save_model(tmp_path / "run", model, ModelInfo(TINY, ("a", "b"), 8, model_args={"width": 3}))
    return tmp_path / "run", model


def test_the_owner_allows_a_factory_by_name_by_callable_or_through_the_config(tmp_path):
    folder, model = _tiny_run(tmp_path)
    with pytest.raises(TrustError, match="--trust-factory"):
        load_model(folder)
    for trust in ([TINY], [tiny], (TINY, "other.mod:fn")):
        back, info, _ = load_model(folder, trust_factories=trust)
        assert info.arch == TINY and back.classifier.weight.equal(model.module.classifier.weight)
    with pytest.raises(TrustError):
        load_model(folder, trust_factories=[TinyNet])  # the class is another factory than the function
    cfg = ModelConfig(arch=str(folder), trust_factories=(TINY,))
    assert cfg.factories == (TINY,) and ModelConfig(arch=TINY).factories == (TINY,)
    assert resolve_model(cfg.arch, trust_factories=cfg.factories).module.classifier.out_features == 2


def test_an_installed_packages_entry_point_allows_its_factory(tmp_path, monkeypatch):
    folder, _ = _tiny_run(tmp_path)
    registered = [EntryPoint(name="tiny", value=TINY, group="edgerev.models")]
    monkeypatch.setattr("importlib.metadata.entry_points",
                        lambda group=None: [e for e in registered if e.group == group])
    assert load_model(folder)[1].arch == TINY


def test_a_factory_allowed_on_the_command_line(tmp_path, capsys):
    folder, _ = _tiny_run(tmp_path)
    err = _run_cli(["plan", "--arch", str(folder), "--size", "8", "--budget", "1KiB"], capsys)
    assert "is a factory" in err
    err = _run_cli(["plan", "--arch", str(folder), "--size", "8", "--budget", "1KiB", "--trust-factory", TINY], capsys)
    assert "is a factory" not in err and "budget" in err  # built: refused for its budget only
    err = _run_cli(["memory", "--arch", str(folder), "--size", "8", "--batch", "2", "--fake"], capsys)
    assert "is a factory" in err  # every command that builds a model takes the owner's word the same way
    assert main(["memory", "--arch", str(folder), "--size", "8", "--batch", "2", "--fake", "--json",
                 "--trust-factory", TINY]) == 0
    assert json.loads(capsys.readouterr().out)["peak_bytes"] > 0


def test_a_recipe_refuses_a_trust_entry_that_is_no_factory():
    with pytest.raises(EdgerevError, match=r"^trust_factories\[0\]: 'runs/one' is not a factory"):
        ModelConfig(trust_factories=("runs/one",))


def _outside(tmp_path):
    secret = tmp_path / "secret"
    secret.mkdir()
    return secret


@pytest.mark.parametrize("name", ["model.safetensors", "model.json", "source.onnx"])
def test_a_file_linked_out_of_the_model_directory_is_refused_before_it_is_read(tmp_path, monkeypatch, name):
    folder, model = _tiny_run(tmp_path)
    if name == "source.onnx":
        info = json.loads((folder / "model.json").read_text())
        (folder / "model.json").write_text(json.dumps({**info, "arch": "onnx", "model_args": {}}))
    target = _outside(tmp_path) / name
    target.write_bytes((folder / name).read_bytes() if (folder / name).exists() else b"onnx")
    (folder / name).unlink(missing_ok=True)
    (folder / name).symlink_to(target)
    read: list[str] = []

    def recorded(real):
        def reading(self, *args, **kwargs):
            read.append(os.path.realpath(self))
            return real(self, *args, **kwargs)
        return reading

    for attr in ("read_bytes", "read_text"):
        monkeypatch.setattr(type(target), attr, recorded(getattr(type(target), attr)))
    with pytest.raises(TrustError) as e:
        load_model(folder, trust_factories=[TINY])
    assert f"{name!r} leads outside" in one_line(e.value)
    assert str(target.resolve()) not in read and (read or name == "model.json")  # model.json read, that file never


def test_a_link_inside_the_folder_is_followed(tmp_path):
    folder, _ = _tiny_run(tmp_path)
    (folder / "model.safetensors").rename(folder / "weights-v1.safetensors")
    (folder / "model.safetensors").symlink_to("weights-v1.safetensors")
    assert load_model(folder, trust_factories=[TINY])[1].arch == TINY


def test_an_onnx_sidecar_and_external_data_stay_in_the_files_folder(tmp_path):
    path = save_onnx(classifier(), tmp_path / "m" / "m.onnx")
    secret = _outside(tmp_path)
    (secret / "m.onnx.json").write_text(json.dumps({"classes": ["a", "b", "c"]}))
    path.with_name("m.onnx.json").symlink_to(secret / "m.onnx.json")
    with pytest.raises(TrustError, match="m.onnx.json: 'm.onnx.json' leads outside"):
        resolve_model(str(path))
    path.with_name("m.onnx.json").unlink()
    with_external_data(path, location="../secret/w.data")
    with pytest.raises(TrustError, match=r"m.onnx: external data of 'W': location: '../secret/w.data' leads outside"):
        resolve_model(str(path))


def _bad_sidecar(tmp_path):
    return save_onnx(classifier(), tmp_path / "m.onnx", sidecar={"classes": 5}), "m.onnx.json: classes: "


def _bad_offset(tmp_path):
    return with_external_data(save_onnx(classifier(), tmp_path / "m.onnx"), offset="abc"), \
        "m.onnx: external data of 'W': offset: "


def _nul_location(tmp_path):
    return with_external_data(save_onnx(classifier(), tmp_path / "m.onnx"), location="m\0.data"), \
        "m.onnx: external data of 'W': location: "


def _bad_metadata(tmp_path):
    return save_onnx(classifier(), tmp_path / "m.onnx", metadata={"mean": json.dumps(["x"])}), "m.onnx: metadata mean: "


def _not_a_classifier(tmp_path):
    return save_onnx(classifier(out_rank=4), tmp_path / "m.onnx"), "m.onnx: output 'Y' of node 'conv' (Conv) has 4 "


def _bad_model_json(tmp_path):
    folder = model_directory(tmp_path / "m", {**VALID_INFO, "mean": ["x"] * 3})
    return folder, f"{folder / 'model.json'}: mean: "


BAD = [_bad_sidecar, _bad_offset, _nul_location, _bad_metadata, _not_a_classifier, _bad_model_json]


@pytest.mark.parametrize("make", BAD, ids=[f.__name__[1:] for f in BAD])
def test_a_bad_model_file_is_one_line_from_the_api_and_the_cli(tmp_path, capsys, make):
    source, expected = make(tmp_path)
    with pytest.raises(EdgerevError) as e:
        edgerev.plan(str(source), size=8, budget="64MiB")
    assert isinstance(e.value, (UnsupportedModel, TrustError, CheckpointError))
    assert one_line(e.value).startswith(expected)
    err = _run_cli(["plan", "--arch", str(source), "--size", "8", "--budget", "64MiB"], capsys)
    assert err.startswith(f"edgerev plan: error: {expected}")


def test_the_daemon_refuses_a_bad_base_model_at_start_in_one_line(tmp_path, capsys):
    source, expected = _bad_sidecar(tmp_path)
    config = tmp_path / "daemon.yaml"
    config.write_text(json.dumps({"data_dir": str(tmp_path / "data"), "image_size": 8,
                                  "training": {"model": {"arch": str(source)}}}))
    err = _run_cli(["daemon", "once", "--config", str(config)], capsys)
    assert err.startswith(f"edgerev daemon once: error: training: {expected}")


def test_a_fleets_factory_runs_on_a_device_only_if_its_owner_allows_it(tmp_path):
    """The fleet's server sends its model's arch: data to a device, whose own config says what code it runs."""
    from types import SimpleNamespace

    from edgerev.fleet.model import FleetError, FleetModel
    from edgerev_daemon.config import config_from_dict
    from edgerev_daemon.learning.fleet import check_source

    def device(model: dict):
        events: list = []
        config = config_from_dict({"data_dir": str(tmp_path / "data"), "image_size": 8, "training": {"model": model}})
        return SimpleNamespace(config=config, store=SimpleNamespace(add_event=lambda *a: events.append(a))), events

    fm = FleetModel("1/1", "os:system", {"command": "true"}, 8, ("a", "b"), {})
    d, events = device({"arch": "revnext"})
    with pytest.raises(FleetError) as e:
        check_source(d, fm, "round")
    assert "'os:system' is a factory" in one_line(e.value) and "trust_factories" in str(e.value) and len(events) == 1
    check_source(device({"arch": "revnext", "trust_factories": [TINY]})[0], replace_arch(fm, TINY), "round")
    check_source(device({"arch": TINY})[0], replace_arch(fm, TINY), "model")
    check_source(d, replace_arch(fm, "revnext"), "round")


def replace_arch(fm, arch):
    from dataclasses import replace

    return replace(fm, arch=arch)
