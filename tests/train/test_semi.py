"""FixMatch in the trainer (:mod:`edgerev.train.semi`): the loss on constructed logits, the strong view, the
step's memory accounting with the extra views (fake tensors against the trainer's real capped steps), and
runs with unlabelled images (under a budget, with none, resumed)."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgerev.memory.measure.account import StepShape, account_step
from edgerev.memory.measure.microbatch import accumulate, split_batch
from edgerev.models import create_model
from edgerev.train.augment import STRONG_OPS, StrongAugment
from edgerev.train.cap import CpuCap, train_step
from edgerev.train.config import (
    ContinualConfig,
    DataConfig,
    MemoryConfig,
    ModelConfig,
    OptimConfig,
    RunConfig,
    SemiConfig,
    TrainConfig,
)
from edgerev.train.continual import ContinualLoss
from edgerev.train.labeled import LabeledImages
from edgerev.train.memory import loss_of, step_shape
from edgerev.train.semi import SemiLoss, UnlabeledOrder, pseudo_label, quotas, step_targets, weak_probs
from edgerev.train.trainer import train

TINY = {"width": 4, "blocks": (1, 1, 1, 1, 1)}


# -- the loss on constructed logits ------------------------------------------------------------------------

def logits_for(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_the_threshold_masks_what_is_not_confident():
    weak = logits_for([[0.96, 0.02, 0.02], [0.94, 0.03, 0.03], [0.01, 0.98, 0.01], [0.95, 0.04, 0.01]])
    labels, mask = pseudo_label(F.softmax(weak, dim=1), 0.95)
    assert labels.tolist()[:3] == [0, 0, 1]
    assert mask.tolist() == [True, False, True, True]  # a probability of exactly the threshold counts
    _, none = pseudo_label(F.softmax(weak, dim=1), 0.99)
    assert not none.any()


def test_the_class_cap_keeps_a_class_s_most_confident_up_to_its_share():
    labelled = torch.tensor([0] * 5 + [1] * 5)  # two classes, half each
    quota = quotas(labelled, 2, 8, class_cap=1.0)
    assert quota.tolist() == [4, 4]  # at most its share (a half) of the step's 8 unlabelled images
    conf = [0.97, 0.99, 0.96, 0.991, 0.98, 0.995, 0.985, 0.99]  # 8 images, all confident, all class 0
    probs = torch.tensor([[c, 1 - c] for c in conf])
    labels, mask = pseudo_label(probs, 0.95, quota)
    assert labels.tolist() == [0] * 8
    kept = sorted(i for i in range(8) if mask[i])
    assert kept == sorted(sorted(range(8), key=lambda i: -conf[i])[:4])  # the 4 most confident
    assert pseudo_label(probs, 0.95, None)[1].all()  # no cap: all 8
    assert quotas(labelled, 2, 8, None) is None
    # a class the labelled data lacks still gets one (new to the model, seen only unlabelled)
    assert quotas(torch.tensor([0, 0, 0]), 3, 10, 2.0).tolist() == [20, 1, 1]


def test_the_strong_view_gets_the_gradient_and_the_weak_none():
    torch.manual_seed(0)
    weak = torch.randn(6, 3).mul(4).requires_grad_()
    strong = torch.randn(6, 3).requires_grad_()
    labelled = torch.randn(4, 3).requires_grad_()
    y = torch.tensor([0, 1, 2, 0])
    pseudo, mask = pseudo_label(F.softmax(weak, dim=1), 0.9)
    assert 0 < int(mask.sum()) < 6, "the seed gives both confident and unconfident weak views"
    target, weights = step_targets(y, pseudo, mask, weight=0.5)
    loss = SemiLoss(ContinualLoss())(torch.cat([labelled, strong]), target, weights)
    loss.backward()
    assert weak.grad is None  # the weak view is a target: no gradient reaches it
    assert (strong.grad[mask].abs().sum(dim=1) > 0).all()
    assert (strong.grad[~mask] == 0).all()  # an unconfident image teaches nothing
    expected = (F.cross_entropy(labelled, y)
                + 0.5 * (mask.float() * F.cross_entropy(strong, pseudo, reduction="none")).sum() / 6)
    assert torch.allclose(loss, expected)


@pytest.mark.parametrize("parts", [1, 2, 3, 10])
def test_micro_batches_give_the_same_loss(parts):
    """The trainer's micro-batch loop weighs each part by its share: FixMatch's loss is exact under it."""
    torch.manual_seed(1)
    logits = torch.randn(10, 3)
    pseudo, mask = pseudo_label(F.softmax(torch.randn(6, 3) * 5, dim=1), 0.8)
    target, weights = step_targets(torch.tensor([0, 1, 2, 1]), pseudo, mask, 1.0)
    loss_fn = SemiLoss(ContinualLoss(distill=1.0))
    teacher = torch.randn(10, 2)
    full = float(loss_fn(logits, target, weights, teacher))
    split = accumulate(lambda x: x.clone().requires_grad_(), logits, (target, weights, teacher),
                       split_batch(10, parts), loss_fn).read()
    assert math.isclose(split, full, rel_tol=1e-5)


def test_the_strong_view_is_seeded_and_strong():
    x = torch.randint(0, 256, (16, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    a = StrongAugment()
    once, again = a(x, torch.Generator().manual_seed(5)), a(x, torch.Generator().manual_seed(5))
    assert once.dtype == torch.uint8 and once.shape == x.shape
    assert torch.equal(once, again)
    assert not torch.equal(once, a(x, torch.Generator().manual_seed(6)))
    # cutout zeroes a square of half the side per image (6x6, less where it meets the border: at least 3x3)
    assert all(((once[i] == 0).all(0)).sum() >= 9 for i in range(16))
    assert len(STRONG_OPS) == 8


def test_the_unlabelled_order_covers_the_pool_and_repeats():
    order = UnlabeledOrder(10, 4, seed=3)
    first = torch.cat([order.at(s) for s in range(5)])  # 20 draws: the pool twice, each round a permutation
    assert sorted(first[:10].tolist()) == list(range(10)) and sorted(first[10:].tolist()) == list(range(10))
    assert torch.equal(order.at(3), UnlabeledOrder(10, 4, seed=3).at(3))


# -- the step's one accounting with the extra views ------------------------------------------------------------

def tiny(classes: int = 3) -> torch.nn.Module:
    torch.manual_seed(0)
    return create_model("revnext", **TINY, num_classes=classes)


def test_the_account_counts_the_strong_views_and_their_weights():
    model = tiny()
    labelled = account_step(model, StepShape(16, 4, momentum=True), 2, lambda m: None)
    semi = account_step(model, StepShape(16, 12, momentum=True, unlabeled=8), 2, lambda m: None,
                        SemiLoss(ContinualLoss()))
    assert semi.batch_input == 3 * labelled.batch_input and semi.labels == 3 * labelled.labels
    assert labelled.sample_weights == 0 and semi.sample_weights == 12 * 4
    with pytest.raises(ValueError, match="labelled sample"):
        StepShape(16, 8, unlabeled=8)


@pytest.mark.slow
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batch=st.integers(1, 6), ratio=st.integers(1, 3), micro=st.integers(1, 8), distill=st.booleans())
def test_the_trainer_s_step_with_fixmatch_stays_under_its_account(batch, ratio, micro, distill):
    """For any labelled batch, ratio and micro-batch: the accounting on fake tensors equals the real step's
    measurement, and the trainer's own pieces (the weak views' capped forward, then the capped step of the
    labelled samples and strong views) run under a cap of exactly the account's total, without a retry."""
    size, u = 16, ratio * batch
    model = tiny()
    teacher = copy.deepcopy(model).eval() if distill else None
    cfg = RunConfig(model=ModelConfig("revnext", args=dict(TINY)), data=DataConfig(size=size),
                    continual=ContinualConfig(distill=1.0 if distill else 0.0), semi=SemiConfig(enabled=True))
    shape = step_shape(cfg, model, teacher, batch, u)
    assert shape.batch == batch + u and shape.unlabeled == u
    loss_fn = loss_of(cfg, u)
    predicted = account_step(model, shape, micro, lambda m: None, loss_fn)
    measured = account_step(model, shape, micro, lambda m: None, loss_fn, real=True)
    assert predicted.total == measured.total
    parts = math.ceil((batch + u) / predicted.micro_batch)
    cap = CpuCap(predicted.total, predicted.baseline)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    g = torch.Generator().manual_seed(batch * 100 + u)
    for _ in range(2):
        probs = weak_probs(model, torch.randn(u, 3, size, size, generator=g), parts, cap)
        pseudo, mask = pseudo_label(probs, 0.0)
        target = step_targets(torch.randint(0, 3, (batch,), generator=g), pseudo, mask, 1.0)
        x = torch.randn(batch + u, 3, size, size, generator=g)
        if teacher is not None:
            with torch.no_grad():
                target = (*target, teacher(x))
        result = train_step(model, optimizer, x, target, micro_batches=parts, loss_fn=loss_fn, cap=cap)
        assert result.retries == 0 and result.micro_batches == parts
    assert cap.verified_steps == 1 and cap.baseline < cap.peak <= cap.budget


def test_the_weak_forward_leaves_batch_norm_statistics_as_they_were():
    model = tiny()
    model.train()
    before = {k: v.clone() for k, v in model.named_buffers()}
    weak_probs(model, torch.randn(5, 3, 16, 16) * 3 + 1, 2)
    assert all(torch.equal(before[k], v) for k, v in model.named_buffers())


# -- runs ------------------------------------------------------------------------------------------------------

def digits_like(n: int, seed: int, size: int = 16) -> LabeledImages:
    """Three classes a tiny model learns in a few steps: a bright channel per class, noise elsewhere."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(n) % 3
    images = torch.randint(0, 80, (n, 3, size, size), dtype=torch.uint8, generator=g)
    for c in range(3):
        images[labels == c, c] += 160
    return LabeledImages(images, labels, ("a", "b", "c"))


def recipe(semi: bool, budget=None, epochs: int = 2, threshold: float = 0.5) -> RunConfig:
    return RunConfig(model=ModelConfig("revnext", args=dict(TINY)), data=DataConfig(size=16, val_fraction=0.2),
                     train=TrainConfig(epochs=epochs, batch=6, threads=1, checkpoint_every=1, eval_batch=64),
                     optim=OptimConfig(lr=0.05),
                     memory=MemoryConfig(budget=budget, profile="estimate") if budget else MemoryConfig(),
                     semi=SemiConfig(enabled=semi, threshold=threshold, ratio=2))


@pytest.mark.slow
def test_a_run_under_a_budget_with_fixmatch_stays_under_it(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))
    budget = 24 * 2**20
    data = digits_like(30, 0)
    unlabeled = digits_like(40, 1).images
    r = train(recipe(True, budget), tmp_path / "run", data=(data, None), progress=False, unlabeled=unlabeled)
    plan = r.summary["plan"]
    assert plan["account"]["sample_weights"] == (6 + 12) * 4
    assert plan["account"]["batch"] == 6 + 12  # the labelled batch and twice as many strong views
    assert 0 < plan["measured_peak_bytes"] <= budget
    semi = r.summary["semi"]
    assert semi["unlabeled_pool"] == 40 and semi["unlabeled_per_step"] == 12
    steps_per_epoch = max(r.summary["train_samples"] // 6, math.ceil(40 / 12))  # the longer pass makes the epoch
    assert [e["unlabeled"] for e in semi["epochs"]] == [12 * steps_per_epoch] * 2
    assert all(0 <= e["pseudo_labeled"] <= e["unlabeled"] for e in semi["epochs"])
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if e["kind"] == "eval"]
    assert [(e["unlabeled"], e["pseudo_labeled"]) for e in evals] == [(e["unlabeled"], e["pseudo_labeled"])
                                                                     for e in semi["epochs"]]
    # the held-out evaluation is labelled samples only
    held = r.summary["val_samples"]
    assert 0 < held == r.summary["final"]["samples"] == 30 - r.summary["train_samples"]
    progress = json.loads((tmp_path / "run" / "progress.json").read_text())
    assert progress["unlabeled"] == semi["epochs"][-1]["unlabeled"]


def test_fixmatch_without_unlabelled_images_is_the_labelled_run(tmp_path):
    data = digits_like(30, 0)
    off = train(recipe(False), tmp_path / "off", data=(data, None), progress=False)
    on = train(recipe(True), tmp_path / "on", data=(data, None), progress=False, unlabeled=torch.zeros(0, 3, 16, 16,
                                                                                                        dtype=torch.uint8))
    assert on.summary["semi"] is None and on.summary["weights_sha256"] == off.summary["weights_sha256"]
    ignored = train(recipe(False), tmp_path / "ignored", data=(data, None), progress=False,
                    unlabeled=digits_like(20, 1).images)
    assert ignored.summary["weights_sha256"] == off.summary["weights_sha256"]


def test_a_resumed_fixmatch_run_takes_the_same_steps(tmp_path):
    data, unlabeled = digits_like(30, 0), digits_like(40, 1).images
    whole = train(recipe(True), tmp_path / "whole", data=(data, None), progress=False, unlabeled=unlabeled)
    calls = iter(range(1000))
    first = train(recipe(True), tmp_path / "cut", data=(data, None), progress=False, unlabeled=unlabeled,
                  stop=lambda: next(calls) == 3)  # after step 4, within the second epoch
    assert first.status == "stopped"
    rest = train(None, tmp_path / "cut", resume=True, data=(data, None), progress=False, unlabeled=unlabeled)
    assert rest.summary["weights_sha256"] == whole.summary["weights_sha256"]
    assert rest.summary["semi"] == whole.summary["semi"]


def test_unlabelled_images_of_the_wrong_kind_are_refused(tmp_path):
    from edgerev.train.trainer import RunError

    with pytest.raises(RunError, match="uint8"):
        train(recipe(True), tmp_path / "x", data=(digits_like(30, 0), None), progress=False,
              unlabeled=torch.zeros(4, 3, 16, 16))


def test_an_epoch_with_fixmatch_passes_over_the_unlabelled_pool(tmp_path):
    """Few labelled samples and many unlabelled ones: an epoch is one pass over the pool, the labelled samples
    cycling meanwhile (each labelled pass a fresh permutation)."""
    data, unlabeled = digits_like(10, 0), digits_like(60, 1).images
    r = train(recipe(True, epochs=1), tmp_path / "run", data=(data, None), progress=False, unlabeled=unlabeled)
    assert r.summary["train_samples"] // 6 <= 1 and r.step == math.ceil(60 / 12)
    assert r.summary["semi"]["epochs"] == [{"epoch": 1, "unlabeled": 60, "pseudo_labeled":
                                            r.summary["semi"]["pseudo_labeled"]}]
