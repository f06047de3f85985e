"""Continual learning: head growth keeps the old model's outputs, distillation and replay keep old classes."""

import pytest
import torch

from edgerev.config import from_dict
from edgerev.models import create_model
from edgerev.models.directory import CheckpointError, load_model
from edgerev.models.head import ScaledLinear
from edgerev.train.config import RunConfig
from edgerev.train.continual import ContinualLoss, distillation_loss, fit_new_rows, grow_head, head_inputs, load_replay
from edgerev.train.data import DataError
from edgerev.train.labeled import LabeledImages
from edgerev.train.trainer import train
from tests.train.test_trainer import recipe


def test_grown_head_keeps_old_logits():
    torch.manual_seed(0)
    # float64: revnext's max-pooled features are large enough that a wider float32 matmul rounds 3e-6 apart
    model = create_model("revnext", width=8, blocks=(1, 1, 1, 1, 1), num_classes=3).double().eval()
    x = torch.randn(4, 3, 16, 16, dtype=torch.float64)
    with torch.no_grad():
        before = model(x)
    grow_head(model, ("a", "b", "c"), ("a", "b", "c", "d", "e"))
    with torch.no_grad():
        after = model(x)
    assert after.shape == (4, 5) and model.num_classes == 5
    torch.testing.assert_close(after[:, :3], before, rtol=1e-6, atol=1e-6)  # a wider matmul may round differently
    with pytest.raises(CheckpointError, match="must start with the old ones"):
        grow_head(model, ("a", "b", "c", "d", "e"), ("b", "a", "c", "d", "e", "f"))


@pytest.mark.parametrize("head", [torch.nn.Linear(6, 2), torch.nn.Linear(6, 2, bias=False), ScaledLinear(6, 2)])
def test_new_rows_are_fitted_to_the_features_and_the_old_ones_stay(head):
    """Two trained rows and three grown ones: the fit moves only the grown rows, to where they separate their
    classes' features (read at the head's input), whatever the head's kind."""
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(6, 6, 1, bias=False)  # the identity: the features are the images
    torch.nn.init.eye_(conv.weight[:, :, 0, 0])
    model = torch.nn.Sequential(conv, torch.nn.Flatten(), head)
    grow_head(model, ("a", "b"), ("a", "b", "c", "d", "e"))
    grown = model[2]
    before = {n: p.detach().clone() for n, p in grown.named_parameters()}
    centres = torch.eye(6)[:5] * 4
    labels = torch.arange(5).repeat_interleave(12)
    images = (centres[labels] + 0.3 * torch.randn(60, 6))[:, :, None, None]
    features = head_inputs(model, images.split(16))
    assert torch.allclose(features, images.flatten(1))
    fit = fit_new_rows(model, features, labels, first=2)
    assert fit["rows"] == 3 and fit["images"] == 60 and "kept" not in fit
    for n, p in grown.named_parameters():
        assert torch.equal(p[:2], before[n][:2]) and not torch.equal(p[2:], before[n][2:])
    with torch.no_grad():
        assert float((model(images)[labels >= 2].argmax(1) == labels[labels >= 2]).float().mean()) == 1.0


def test_a_fit_that_ends_not_finite_keeps_the_rows_and_nothing_to_fit_changes_nothing():
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 4, 1), torch.nn.Flatten(), torch.nn.Linear(4, 3))
    rows = model[2].weight.detach().clone()
    features = torch.full((6, 4), float("inf"))
    fit = fit_new_rows(model, features, torch.tensor([0, 1, 2, 0, 1, 2]), first=1)
    assert fit["kept"] == "the features are not finite" and torch.equal(model[2].weight, rows)
    assert fit_new_rows(model, torch.ones(6, 4), torch.zeros(6, dtype=torch.long), first=3)["rows"] == 0
    assert fit_new_rows(model, torch.ones(0, 4), torch.zeros(0, dtype=torch.long), first=1)["rows"] == 0
    assert torch.equal(model[2].weight, rows)


def test_distillation_loss():
    teacher = torch.randn(6, 3)
    student = torch.cat([teacher, torch.randn(6, 2)], dim=1)
    assert float(distillation_loss(student, teacher, 2.0)) == pytest.approx(0.0, abs=1e-6)
    assert float(distillation_loss(torch.randn(6, 5), teacher, 2.0)) > 0
    labels = torch.randint(0, 5, (6,))
    plain = ContinualLoss()(student, labels)
    assert float(ContinualLoss(distill=1.0)(student, labels, teacher)) == pytest.approx(float(plain), abs=1e-5)


def _data(labels, classes=("a", "b", "c")):
    labels = torch.tensor(labels)
    images = torch.arange(len(labels) * 3 * 4 * 4, dtype=torch.int64).reshape(-1, 3, 4, 4).remainder(251)
    return LabeledImages(images.to(torch.uint8), labels, classes)


def test_labeled_images_operations():
    d = _data([0, 0, 0, 0, 0, 0, 1, 1, 2, 2])
    s = d.balanced_sample(6, seed=1)
    assert sorted(torch.bincount(s.labels, minlength=3).tolist()) == [2, 2, 2]
    s = d.balanced_sample(8, seed=1)  # classes b and c have two each: a gets the rest
    assert torch.bincount(s.labels, minlength=3).tolist() == [4, 2, 2]
    assert d.balanced_sample(100) is d
    r = d.relabel(("c", "b", "a", "z"))
    assert r.labels.tolist()[:1] == [2] and r.classes[3] == "z"
    with pytest.raises(DataError, match="are not among"):
        d.relabel(("a", "b"))
    only = d.restrict(("b",))
    assert len(only) == 2 and only.labels.tolist() == [0, 0]
    both = LabeledImages.concat([d, _data([0, 1], ("c", "d"))])
    assert both.classes == ("a", "b", "c", "d") and both.labels.tolist()[-2:] == [2, 3]
    train, held = d.held_out(0.5)
    assert len(train) + len(held) == len(d)
    # the split is a function of each sample: reordering the set does not move any sample
    rev = d.subset(torch.arange(len(d) - 1, -1, -1))
    train2, held2 = rev.held_out(0.5)
    key = lambda x: sorted(bytes(t.flatten().tolist()) for t in x.images)  # noqa: E731
    assert key(train) == key(train2) and key(held) == key(held2)
    with pytest.raises(DataError, match="labels must lie"):
        LabeledImages(d.images, d.labels + 5, d.classes)


def _continual(tmp_path, name, base, **continual):
    cfg = recipe(train__epochs=3, optim__lr=0.03, continual__replay=continual.get("replay", 0),
                 continual__distill=continual.get("distill", 0.0), model__init=str(base))
    cfg["data"]["train"]["classes"] = [2, 3]
    cfg["model"]["args"] = {"width": 8, "blocks": [1, 1, 1, 1, 1]}
    return train(from_dict(RunConfig, cfg), tmp_path / name, progress=False)


@pytest.mark.slow
def test_replay_and_distillation_keep_old_classes(tmp_path):
    """Classes 0-1, then 2-3: plain fine-tuning forgets 0-1; replay + distillation keeps markedly more."""
    cfg = recipe(continual__replay=96)
    cfg["data"]["train"]["classes"] = [0, 1]
    base = train(from_dict(RunConfig, cfg), tmp_path / "base", progress=False)
    assert base.summary["classes"] == ["class0", "class1"]
    assert load_replay(base.out, ("class0", "class1"), None).labels.bincount().tolist() == [48, 48]
    naive = _continual(tmp_path, "naive", base.out)
    kept = _continual(tmp_path, "kept", base.out, replay=96, distill=1.0)
    for r in (naive, kept):
        assert r.summary["classes"] == ["class0", "class1", "class2", "class3"]
        assert r.summary["old_classes"] == ["class0", "class1"]
        assert r.summary["final"]["new_acc"] > 0.6
        assert r.summary["forgetting"] == pytest.approx(r.summary["start_old_acc"] - r.summary["final"]["old_acc"])
    assert kept.summary["final"]["old_acc"] >= naive.summary["final"]["old_acc"] + 0.25, (
        naive.summary["final"], kept.summary["final"])
    model, info, _ = load_model(kept.out)
    assert info.classes == ("class0", "class1", "class2", "class3") and model.head.out_features == 4
    # the grown model keeps a replay sample over all four classes for the next round
    assert load_replay(kept.out, info.classes, None).labels.bincount().tolist() == [24, 24, 24, 24]
