"""edgerev from Python: plan() and fit(), the calls the CLI's plan and train make (tiny models, 16x16, few steps)."""

from __future__ import annotations

import json

import pytest
import torch

import edgerev
from edgerev.cli import main
from edgerev.config import ConfigError
from edgerev.memory.solve.costs import BudgetTooSmall
from edgerev.models.directory import load_model, save_tensors
from edgerev.models.resolve import ModelSourceError, resolve_model
from edgerev.train.config import SourceConfig
from edgerev.train.labeled import load_source
from tests.resolve_factories import TinyNet

TINY = "tests.resolve_factories:tiny"


@pytest.fixture(scope="module")
def images():
    return load_source(SourceConfig(kind="synthetic", samples=48, num_classes=3, seed=1), 16)


def test_public_names():
    for name in ("plan", "fit", "resolve_model", "model_spec"):
        assert name in edgerev.__all__ and callable(getattr(edgerev, name))


@pytest.mark.slow  # the planner's profile: ~10 s CPU on a loaded 2-core machine
def test_plan_of_a_registry_model_stays_under_the_budget():
    p = edgerev.plan("resnet18", size=16, budget="64MiB", batch=8, args={"width": 8}, estimate=True)
    assert 1 <= p.batch <= 8 and p.predicted_peak_bytes <= 64 * 2**20
    assert p.summary["arch"] == "resnet18" and p.summary["budget_bytes"] == 64 * 2**20


@pytest.mark.slow  # 3-20 s on a loaded machine
def test_plan_without_a_batch_chooses_one_under_the_budget():
    """``edgerev plan`` without ``--batch``: the planner chooses (a step's shape must take batch None)."""
    p = edgerev.plan("resnet18", size=16, budget="64MiB", args={"width": 8}, estimate=True)
    assert p.batch >= 1 and p.predicted_peak_bytes <= 64 * 2**20


@pytest.mark.slow
def test_plan_refuses_a_budget_below_the_floor_naming_it():
    with pytest.raises(BudgetTooSmall, match="smallest"):
        edgerev.plan("resnet18", size=16, budget=1000, args={"width": 8})


def test_plan_bad_budget_is_one_line():
    with pytest.raises(ConfigError, match="^budget: "):
        edgerev.plan("resnet18", size=16, budget="lots")


def test_fit_trains_a_module_object_in_place_and_returns_its_model_directory(tmp_path, images):
    torch.manual_seed(0)
    net = TinyNet(classes=3)
    before = net.features[0].weight.detach().clone()
    out = edgerev.fit(net, images, out=tmp_path / "run", size=16, epochs=1, batch=8, lr=0.05)
    assert out == tmp_path / "run" and (out / "model.safetensors").is_file()
    assert not torch.equal(net.features[0].weight, before)  # trained in place
    back, info, _ = load_model(out, trust_factories=[TinyNet])  # rebuilt from the class it records, allowed
    assert info.arch == "tests.resolve_factories:TinyNet" and info.classes == images.classes
    assert all(torch.equal(back.state_dict()[k], v) for k, v in net.state_dict().items())


def test_fit_with_a_factory_and_pretrained_weights(tmp_path, images):
    torch.manual_seed(1)
    pretrained = TinyNet(classes=10)
    save_tensors(tmp_path / "w.safetensors", pretrained.state_dict())
    out = edgerev.fit(TINY, images, out=tmp_path / "run", weights=tmp_path / "w.safetensors", size=16, epochs=1,
                      batch=8, lr=1e-9)
    model, info, _ = load_model(out, trust_factories=[TINY])
    assert info.arch == TINY and model.classifier.out_features == 3  # the classifier re-made for the data
    # at lr ~0 the backbone is still the file's (batch norm's running statistics moved; its weights did not)
    assert torch.allclose(model.features[0].weight, pretrained.features[0].weight, atol=1e-6)
    saved = (out / "config.yaml").read_text()
    assert "tests.resolve_factories:tiny" in saved and "w.safetensors" in saved


def test_fit_from_a_folder_of_images(tmp_path):
    from PIL import Image

    for c, color in (("red", (200, 20, 20)), ("blue", (20, 20, 200))):
        (tmp_path / "data" / c).mkdir(parents=True)
        for i in range(6):
            Image.new("RGB", (16, 16), tuple(v + i for v in color)).save(tmp_path / "data" / c / f"{i}.png")
    out = edgerev.fit(TINY, tmp_path / "data", out=tmp_path / "run", size=16, epochs=1, batch=4)
    assert json.loads((out / "model.json").read_text())["classes"] == ["blue", "red"]


def test_fit_refuses_a_class_it_could_not_rebuild_before_writing(tmp_path, images):
    class Local(TinyNet):
        pass

    with pytest.raises(ModelSourceError, match="defined inside a function"):
        edgerev.fit(Local(), images, out=tmp_path / "run", size=16, epochs=1)
    assert not (tmp_path / "run").exists()


def test_fit_bad_factory_writes_nothing(tmp_path, images):
    with pytest.raises(Exception, match="returned a list, not a torch.nn.Module"):
        edgerev.fit("tests.resolve_factories:not_a_module", images, out=tmp_path / "run", size=16, epochs=1)
    assert not (tmp_path / "run").exists()


def test_cli_train_takes_arch_and_weights(tmp_path, capsys):
    torch.save(TinyNet(classes=10).state_dict(), tmp_path / "w.pt")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {size: 16, train: {kind: synthetic, samples: 32, num_classes: 2}}\n"
                      "train: {epochs: 1, batch: 8}\noptim: {lr: 0.01}\n")
    rc = main(["train", "--config", str(recipe), "--arch", TINY, "--weights", str(tmp_path / "w.pt"),
               "--out", str(tmp_path / "run"), "--quiet", "--json"])
    assert rc == 0
    report = json.loads(capsys.readouterr().out)
    assert report["status"] == "done" and report["arch"] == TINY


def test_cli_refuses_a_factory_that_raises_in_one_line(tmp_path, capsys):
    rc = main(["plan", "--arch", "tests.resolve_factories:raises", "--size", "16", "--budget", "64MiB"])
    err = capsys.readouterr().err
    assert rc != 0 and err.count("\n") == 1 and "raised RuntimeError: no weights on this machine" in err


@pytest.mark.slow
def test_plan_takes_a_module_object():
    net = resolve_model("resnet18", args={"width": 8}, num_classes=3)
    p = edgerev.plan(net, size=16, budget="64MiB", batch=4, estimate=True)
    assert p.batch >= 1 and p.summary["arch"] == "resnet18"


@pytest.mark.parametrize("source", ["module", "registry"])
def test_planning_leaves_the_model_as_it_was(source):
    """Planning, and verifying the plan with real steps on random images, moves no batch-norm statistic and leaves
    no gradient nor another mode: a network whose statistics moved would be taken for a pretrained one by the
    trainer."""
    torch.manual_seed(0)
    net = TinyNet() if source == "module" else resolve_model("revnet", args={"width": 4}, num_classes=3).module
    net.eval()
    buffers = {k: v.clone() for k, v in net.named_buffers()}
    weights = {k: v.clone() for k, v in net.named_parameters()}
    p = edgerev.plan(net, size=16, budget="64MiB", batch=4, estimate=True, verify=True)
    assert not any(m.training for m in net.modules())
    assert p.summary["measured_peak_bytes"] > 0
    assert all(torch.equal(v, buffers[k]) for k, v in net.named_buffers()), "a statistic moved"
    assert all(torch.equal(v, weights[k]) and v.grad is None for k, v in net.named_parameters())


def test_cli_memory_takes_a_factory(capsys):
    rc = main(["memory", "--arch", TINY, "--batch", "2", "--size", "16", "--fake", "--json"])
    row = json.loads(capsys.readouterr().out)
    assert rc == 0 and row["arch"] == TINY and row["modes"] == ["plain"] and row["model_bytes_per_pixel"] is None
    assert row["peak_bytes_2x"] > row["peak_bytes"] > 0


@pytest.mark.slow  # captures the graph and profiles its pieces: ~8 s on a loaded machine
def test_plan_of_a_factory_with_a_trainable_set():
    pytest.importorskip("edgerev.train.trainable")  # the planner's trainable sets (issue 21, part 4)
    every = edgerev.plan(TINY, size=16, budget="8MiB", batch=8, estimate=True)
    head = edgerev.plan(TINY, size=16, budget="8MiB", batch=8, estimate=True, trainable="head")
    assert head.predicted_peak_bytes < every.predicted_peak_bytes <= 8 * 2**20
    assert head.summary["trainable"] == "head"
    with pytest.raises(ConfigError, match="^trainable: "):
        edgerev.plan(TINY, size=16, budget="8MiB", trainable="some")
    # auto says what it chose: every parameter with momentum where that fits; below it, the momentum in bfloat16
    # (half its bytes), then without momentum
    auto = edgerev.plan(TINY, size=16, budget="8MiB", batch=8, estimate=True, trainable="auto")
    assert (auto.summary["trainable"], auto.summary["optimizer_state"]) == ("all", "kept")
    total, state = every.summary["account"]["total"], every.summary["account"]["optimizer"]
    half = edgerev.plan(TINY, size=16, budget=total - 1, batch=8, estimate=True, trainable="auto")
    assert (half.summary["trainable"], half.summary["optimizer_state"]) == ("all", "bfloat16")
    assert half.summary["account"]["optimizer"] == state // 2 and half.predicted_peak_bytes <= total - 1
    tight = total - state // 2 - 1
    dropped = edgerev.plan(TINY, size=16, budget=tight, batch=8, estimate=True, trainable="auto")
    assert (dropped.summary["trainable"], dropped.summary["optimizer_state"]) == ("all", "dropped")
    assert dropped.summary["account"]["optimizer"] == 0 and dropped.predicted_peak_bytes <= tight
    plain_sgd = edgerev.plan(TINY, size=16, budget=tight, batch=8, estimate=True, trainable="auto", momentum=False)
    assert plain_sgd.summary["optimizer_state"] == "none"
