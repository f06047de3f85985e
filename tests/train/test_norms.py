"""Batch-norm statistics set from outside (edgerev.train.norms): calibrated layer after layer over images however
they are batched, the model computes in eval mode what one training batch of all of them computes; a run with
``train.bn_stats: frozen`` trains at them and leaves them as they are, one without it moves them."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from edgerev.config import from_dict
from edgerev.models import create_model
from edgerev.models.directory import load_model
from edgerev.train.config import RunConfig
from edgerev.train.norms import calibrate, norms
from edgerev.train.trainer import train

from .test_trainer import recipe


def _model():
    torch.manual_seed(0)
    return create_model("revnext", width=8, blocks=[1, 1, 1, 1, 1], num_classes=3)


@settings(max_examples=3, deadline=None)
@given(batch=st.integers(3, 24))
def test_calibrated_layer_after_layer_the_model_computes_in_eval_mode_what_one_training_batch_computes(batch):
    import copy

    from edgerev.engine import plain

    model = _model()
    x = torch.randn(24, 3, 16, 16) * 1.5 - 0.3
    calibrate(model, lambda: (x[k:k + batch] for k in range(0, len(x), batch)))
    assert len(list(norms(model))) >= 4
    trained = copy.deepcopy(model).train()  # every layer normalized with the statistics of all 24 images
    with torch.no_grad(), plain(trained):
        want = trained(x)
    model.eval()
    with torch.no_grad():
        got = model(x)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def _statistics(folder):
    model, _, _ = load_model(folder)
    return {n: (m.running_mean.clone(), m.running_var.clone()) for n, m in norms(model)}


@pytest.mark.slow
def test_a_frozen_run_trains_at_the_statistics_it_started_with(tmp_path):
    first = train(from_dict(RunConfig, recipe(train__epochs=1)), tmp_path / "first", progress=False)
    before = _statistics(first.out)
    frozen = train(from_dict(RunConfig, recipe(train__epochs=1, train__bn_stats="frozen",
                                               model__init=str(first.out))), tmp_path / "frozen", progress=False)
    moving = train(from_dict(RunConfig, recipe(train__epochs=1, model__init=str(first.out))), tmp_path / "moving",
                   progress=False)
    assert frozen.step == moving.step > 0
    after, moved = _statistics(frozen.out), _statistics(moving.out)
    for name, (mean, var) in before.items():
        assert torch.equal(after[name][0], mean) and torch.equal(after[name][1], var)
    assert any(not torch.equal(moved[n][0], before[n][0]) for n in before)
    # and it learned: the weights moved
    w0, w1 = load_model(first.out)[0].state_dict(), load_model(frozen.out)[0].state_dict()
    assert any(not torch.equal(w0[k], w1[k]) for k in w0 if k.endswith("weight"))


def test_measured_running_statistics_are_the_batches_own_and_leave_frozen_norms_alone():
    from edgerev.engine import plain
    from edgerev.train.norms import freeze_norms, measure_running_statistics

    model = _model().train()
    torch.manual_seed(1)
    x = torch.randn(12, 3, 16, 16) * 3 + 1
    with torch.no_grad(), plain(model):
        want = model(x)  # training mode: each batch norm normalizes by this batch's statistics
    assert measure_running_statistics(model, [x]) == 1
    model.eval()
    with torch.no_grad():
        got = model(x)  # eval mode: by the running statistics just measured on the same batch
    # equal but for the running variance being the unbiased one (n/(n-1): 48 values a channel at the last stage)
    assert torch.allclose(got, want, rtol=2e-2, atol=1e-2), (got - want).abs().max()
    assert not torch.allclose(got, _model().eval()(x), rtol=2e-2, atol=1e-2)  # the fresh statistics are not
    assert all(m.momentum == 0.1 and not m.training for _, m in norms(model))
    # two batches: each statistic is the mean of the two batches' own
    model.train()
    measure_running_statistics(model, [x[:6], x[6:]])
    first = {n: m.running_mean.clone() for n, m in norms(model)}
    measure_running_statistics(model, [x[6:], x[:6]])
    assert all(torch.allclose(first[n], m.running_mean, atol=1e-5) for n, m in norms(model))
    # frozen norms (eval mode while the rest trains) keep their statistics
    freeze_norms(model)
    before = [m.running_mean.clone() for _, m in norms(model)]
    assert measure_running_statistics(model, [x * 10]) == 0
    assert all(torch.equal(b, m.running_mean) for b, (_, m) in zip(before, norms(model)))


def test_a_run_measures_its_statistics_before_it_evaluates_and_trains_the_same_weights(tmp_path):
    """``train.bn_measure``: the statistics evaluated (and saved) are measured anew; nothing that trains moves."""
    runs = {n: train(from_dict(RunConfig, recipe(train__epochs=1, train__bn_measure=n)), tmp_path / str(n),
                     progress=False) for n in (0, 64)}
    kept, measured = (load_model(runs[n].out)[0].state_dict() for n in (0, 64))
    stats = ("running_mean", "running_var", "num_batches_tracked")
    assert all(torch.equal(kept[k], measured[k]) for k in kept if not k.endswith(stats))
    assert any(not torch.allclose(kept[k], measured[k]) for k in kept if k.endswith("running_var"))
    with pytest.raises(Exception, match="bn_measure: must be at least 0 images"):
        from_dict(RunConfig, recipe(train__bn_measure=-1))
