"""A pretrained model stays itself (issue 34): its normalization is the source's or the recipe's, and one computed
from the device's images is said in one warning line; the rate is a fine-tuning one, lower without batch norm, and
a model from random weights keeps the paper's when it is edgerev's, one scaled to its batch when it is not."""

from __future__ import annotations

import json
import logging

import pytest
import torch

import edgerev
from edgerev.models.directory import read_info
from tests.resolve_factories import TinyNet

SIZE = 16
DATA = {"train": {"kind": "synthetic", "samples": 24, "num_classes": 2, "seed": 0}, "val_fraction": 0.25}
RECIPE = {"data": DATA, "train": {"epochs": 1, "batch": 8, "log_every": 1, "patience": None},
          "optim": {"schedule": "constant"}, "device": "cpu"}
NOTE = "carries no normalization"


def trained_net() -> TinyNet:
    """A TinyNet whose batch norm holds statistics of its own (a model trained elsewhere)."""
    torch.manual_seed(0)
    net = TinyNet(classes=2)
    with torch.no_grad():
        net.train()(torch.rand(16, 3, SIZE, SIZE))
    return net.eval()


def onnx_file(path, *, keep_batch_norm: bool):
    """The net as an owner's file: with its batch norm (TorchScript exporter, no constant folding, training mode
    kept) or folded into the convolution (the exporter's default in eval mode)."""
    mode = torch.onnx.TrainingMode.PRESERVE if keep_batch_norm else torch.onnx.TrainingMode.EVAL
    torch.onnx.export(trained_net(), (torch.zeros(1, 3, SIZE, SIZE),), str(path), dynamo=False,
                      do_constant_folding=not keep_batch_norm, training=mode, input_names=["image"],
                      output_names=["scores"], dynamic_axes={"image": {0: "n"}, "scores": {0: "n"}})
    return path


def rates(out) -> set[float]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {r["lr"] for r in rows if r["kind"] == "train"}


def notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and NOTE in r.getMessage()]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # the TorchScript exporter, as an owner's file was written
@pytest.mark.parametrize("keep_batch_norm, rate", [(True, 0.01), (False, 0.01)])
def test_a_file_trains_at_a_fine_tuning_rate_and_says_its_normalization_was_computed(tmp_path, caplog,
                                                                                      keep_batch_norm, rate):
    source = onnx_file(tmp_path / "owner.onnx", keep_batch_norm=keep_batch_norm)
    with caplog.at_level(logging.WARNING):
        out = edgerev.fit(source, out=tmp_path / "run", size=SIZE, config=RECIPE)
    assert rates(out) == {rate}
    (line,) = notes(caplog)  # one line, which says how to set it
    assert "owner.onnx" in line and "model.mean and model.std" in line and "\n" not in line
    info, _ = read_info(out)
    assert all(0 < s for s in info.std)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_recipe_s_normalization_is_kept_and_nothing_is_said(tmp_path, caplog):
    source = onnx_file(tmp_path / "owner.onnx", keep_batch_norm=True)
    recipe = {**RECIPE, "model": {"mean": [0.5, 0.4, 0.3], "std": [0.2, 0.2, 0.25]}}
    with caplog.at_level(logging.WARNING):
        out = edgerev.fit(source, out=tmp_path / "run", size=SIZE, config=recipe)
    info, _ = read_info(out)
    assert (info.mean, info.std) == ((0.5, 0.4, 0.3), (0.2, 0.2, 0.25)) and notes(caplog) == []


def test_a_recipe_s_normalization_must_match_the_model_s_channels(tmp_path):
    recipe = {**RECIPE, "model": {"mean": [0.5], "std": [0.2]}}
    with pytest.raises(edgerev.EdgerevError, match="model.mean: 1 values for a model of 3 input channels"):
        edgerev.fit("tests.resolve_factories:tiny", out=tmp_path / "run", size=SIZE, config=recipe)
    assert not (tmp_path / "run").exists()


def test_a_module_with_trained_statistics_fine_tunes_and_a_new_one_learns_from_scratch(tmp_path, caplog):
    with caplog.at_level(logging.WARNING):
        pretrained = edgerev.fit(trained_net(), out=tmp_path / "old", size=SIZE, config=RECIPE)
    assert rates(pretrained) == {0.01} and len(notes(caplog)) == 1
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        new = edgerev.fit(TinyNet(classes=2), out=tmp_path / "new", size=SIZE, config=RECIPE)
        factory = edgerev.fit("tests.resolve_factories:tiny", out=tmp_path / "factory", size=SIZE, config=RECIPE)
    # from random weights: nothing to keep, and a model from elsewhere at the rate scaled to its batch of 8
    assert rates(new) == rates(factory) == {0.1 * 8 / 256} and notes(caplog) == []
    own = edgerev.fit("layerwise", out=tmp_path / "own", size=SIZE, config=RECIPE)
    assert rates(own) == {0.4}  # edgerev's own: the paper's peak


def test_a_recipe_s_rate_stays_whatever_the_model(tmp_path):
    out = edgerev.fit(trained_net(), out=tmp_path / "run", size=SIZE, config={**RECIPE, "optim": {
        "schedule": "constant", "lr": 0.05}})
    assert rates(out) == {0.05}


def classifier(out) -> torch.Tensor:
    """The trained classifier's rows, read back from the run's model directory."""
    handle = edgerev.resolve_model(out)
    return handle.module.get_submodule(handle.head).weight.detach()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_a_file_that_names_its_classes_keeps_each_row_and_grows_one_for_a_class_it_does_not_name(tmp_path):
    import onnx

    path = onnx_file(tmp_path / "owner.onnx", keep_batch_norm=True)  # two rows
    file = onnx.load(str(path))
    onnx.helper.set_model_props(file, {"classes": '["class1", "class0"]'})
    onnx.save(file, str(path))
    rows = classifier(edgerev.fit(path, out=tmp_path / "kept", size=SIZE, config={**RECIPE, "optim": {
        "schedule": "constant", "lr": 1e-9}}))  # the data names class0 and class1: nothing grows, nothing moves
    start = edgerev.resolve_model(path)
    assert torch.allclose(rows, start.module.get_submodule(start.head).weight, atol=1e-6)
    assert read_info(tmp_path / "kept")[0].classes == ("class1", "class0")  # the file's order, not the data's
    three = {**RECIPE, "data": {**DATA, "train": {**DATA["train"], "num_classes": 3}},
             "optim": {"schedule": "constant", "lr": 1e-9}}
    grown = edgerev.fit(path, out=tmp_path / "grown", size=SIZE, config=three)
    assert read_info(grown)[0].classes == ("class1", "class0", "class2")
    assert torch.allclose(classifier(grown)[:2], rows, atol=1e-6)
    summary = lambda out: json.loads((out / "summary.json").read_text())  # noqa: E731
    # the grown row was fitted to the file's features before training (continual.probe); nothing grew in "kept"
    assert summary(grown)["head_probe"]["rows"] == 1 and summary(tmp_path / "kept")["head_probe"] is None


def test_a_module_whose_head_numbers_the_data_s_classes_keeps_it(tmp_path):
    """A module with a row per class the data declares keeps its head, a class without a training sample too;
    one with another count gets a head of a row per class with samples."""
    from edgerev.train.config import SourceConfig
    from edgerev.train.labeled import load_source

    images = load_source(SourceConfig(kind="synthetic", samples=24, num_classes=4, classes=[0, 1, 2], seed=0), SIZE)
    assert images.classes == ("class0", "class1", "class2", "class3") and len(images.present()) == 3
    net = TinyNet(classes=4)
    before = net.classifier.weight.detach().clone()
    out = edgerev.fit(net, images, out=tmp_path / "four", size=SIZE, config={**RECIPE, "optim": {
        "schedule": "constant", "lr": 1e-9}})
    assert read_info(out)[0].classes == images.classes and torch.allclose(net.classifier.weight, before, atol=1e-6)
    five = TinyNet(classes=5)
    out = edgerev.fit(five, images, out=tmp_path / "five", size=SIZE, config=RECIPE)
    assert read_info(out)[0].classes == ("class0", "class1", "class2") and five.classifier.out_features == 3
    assert json.loads((out / "summary.json").read_text())["head_probe"] is None  # random weights: nothing to fit to


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("keep_batch_norm, recipe, clips", [
    (True, {}, (None, None)),  # batch norm kept: nothing clipped
    (False, {}, (0.2, None)),  # folded: each unit's gradient against its weight
    (False, {"adaptive_clip": float("inf")}, (None, None)),  # the recipe says never
    (False, {"adaptive_clip": 0.2, "clip_grad_norm": 5.0}, (0.2, 5.0)),  # the recipe's own
])
def test_a_folded_file_clips_its_gradient_unit_by_unit_unless_the_recipe_says(tmp_path, monkeypatch, keep_batch_norm,
                                                                              recipe, clips):
    from edgerev.train import trainer

    seen, step = [], trainer.train_step

    def spy(*args, **kwargs):
        seen.append((kwargs.get("adaptive_clip"), kwargs.get("clip_grad_norm")))
        return step(*args, **kwargs)

    monkeypatch.setattr(trainer, "train_step", spy)
    edgerev.fit(onnx_file(tmp_path / "owner.onnx", keep_batch_norm=keep_batch_norm), out=tmp_path / "run",
                size=SIZE, config={**RECIPE, "optim": {"schedule": "constant", **recipe}})
    assert seen and set(seen) == {clips}


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("keep_batch_norm, clips", [(True, (None, None)), (False, (0.2, None))])
def test_the_doctor_verifies_a_file_s_plan_with_the_trainer_s_clipping(tmp_path, monkeypatch, keep_batch_norm, clips):
    """``edgerev doctor``'s real steps are the step the trainer runs for the file: a folded one clipped unit by unit."""
    from edgerev.config import from_dict, merged
    from edgerev.doctor.plan import verified_plan
    from edgerev.train import cap
    from edgerev.train.config import RunConfig

    seen, step = [], cap.train_step

    def spy(*args, **kwargs):
        seen.append((kwargs.get("adaptive_clip"), kwargs.get("clip_grad_norm")))
        return step(*args, **kwargs)

    monkeypatch.setattr(cap, "train_step", spy)
    source = onnx_file(tmp_path / "owner.onnx", keep_batch_norm=keep_batch_norm)
    cfg = from_dict(RunConfig, merged(RECIPE, {"model": {"arch": str(source)}, "data": {"size": SIZE}}))
    facts = verified_plan(cfg, "cpu", classes=2, steps=1)
    assert facts.error is None and facts.steps == 1, facts
    assert seen == [clips]


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_the_doctor_verifies_a_file_s_step_under_a_cap_as_the_trainer_runs_it(tmp_path):
    """A model from outside runs as its chain under a cap, with the recipe's trainable set: the doctor's plan and
    its real step are those (the doctor once probed the file's module for edgerev's layout and raised torch's
    AttributeError)."""
    from edgerev.config import from_dict, merged
    from edgerev.doctor.plan import verified_plan
    from edgerev.train.config import RunConfig

    source = onnx_file(tmp_path / "owner.onnx", keep_batch_norm=True)
    peaks = {}
    for trainable in ("all", "head", "auto"):
        cfg = from_dict(RunConfig, merged(RECIPE, {"model": {"arch": str(source)}, "data": {"size": SIZE},
                                                   "memory": {"budget": "4MiB"}, "train": {"trainable": trainable}}))
        facts = verified_plan(cfg, "cpu", classes=2, steps=1)
        assert facts.error is None and facts.steps == 1, facts
        assert facts.measured_peak_bytes == facts.predicted_peak_bytes <= facts.budget_bytes  # exact on the CPU
        assert ("(trains all, optimizer state kept)" in facts.planner) == (trainable == "auto")
        peaks[trainable] = facts.measured_peak_bytes
    assert peaks["head"] < peaks["all"] == peaks["auto"]  # auto trains all where all fits


def test_folded_means_no_batch_norm_after_most_convolutions():
    from torch import nn

    from edgerev.models import create_model, list_models
    from edgerev.train.trainer import _folded

    assert not any(_folded(create_model(name)) for name in list_models())  # edgerev's invertible layers counted
    assert not _folded(TinyNet()) and not _folded(nn.Sequential(nn.Linear(3, 2)))

    def convs(n: int, norms: int) -> nn.Module:
        return nn.Sequential(*[nn.Conv2d(3, 3, 1) for _ in range(n)], *[nn.BatchNorm2d(3) for _ in range(norms)])

    assert _folded(convs(4, 0)) and _folded(convs(5, 2)) and not _folded(convs(4, 2))
