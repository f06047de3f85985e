"""The gate on a stream whose appearance drifts and whose classes come and go, end to end through the
daemon (real training, store, clock injected): a model that follows the drift is promoted; the model from
before the drift, put to the gate against it, is not."""

from __future__ import annotations

import pytest
import torch

from edgerev_daemon.learning.promote import decide, held_out
from edgerev_daemon.service.daemon import Daemon
from tests.daemon.conftest import Clock
from tests.daemon.drift import drifted, write_drifted
from tests.daemon.service.test_service import epochs, make_config

DAY = 86400.0


def test_drift_moves_every_pixel_statistic():
    from edgerev.train.data import SyntheticImages

    img, _ = SyntheticImages(1, num_classes=4, size=16)[0]
    assert torch.equal(drifted(img, 0.0), img)
    far = drifted(img, 1.0).float()
    assert far.mean() < 0.6 * img.float().mean()  # darker
    assert (far[:, 1:] - far[:, :-1]).abs().mean() < (img.float()[:, 1:] - img.float()[:, :-1]).abs().mean()  # blurred
    assert torch.allclose(far.mean((1, 2)), img.float().roll(1, dims=0).mean((1, 2)) * 0.5, atol=2.0)  # recoloured


@pytest.mark.slow
def test_a_model_that_follows_the_drift_is_promoted_and_the_one_before_it_is_not(tmp_path):
    # the gate's defaults
    config, _ = make_config(tmp_path, training=epochs(6), promotion={"keep_last": 5, "exporter": "legacy"})
    assert config.promotion.recent_window_days == 30
    clock = Clock()
    with Daemon(config, clock=clock) as d:
        write_drifted(config.inbox_path, 240, [0, 1, 2], amount=0.0)
        first = d.cycle().job
        assert first["promoted"] and first["version"] == "v0001", first
        # two months on: classes 0 and 1 look different, class 2 stopped arriving, class 3 appeared
        clock.advance(60 * DAY)
        write_drifted(config.inbox_path, 240, [0, 1, 3], amount=0.6, start=10_000)
        job = d.cycle().job
        v2 = d.store.get_version(job["version"])
        ev = v2.metrics["evaluation"]
        assert job["promoted"] and v2.reason.startswith("better on the recent held-out samples by"), v2.reason
        # judged on each class's last month: the drifted samples of 0 and 1, class 2 as it last looked, 3
        held = held_out(d.store, d.blobs, d.store.get_job(job["job"]), config.promotion.recent_window_days)
        old_look = [c for c, fresh in zip(held.labels, held.recent) if not fresh]
        assert set(old_look) == {"class0", "class1"} and "class2" in [c for c, f in zip(held.labels, held.recent) if f]
        assert ev["heldout_samples"] == {"all": len(held.labels), "recent": sum(held.recent)}
        assert ev["candidate"]["recent"] > ev["current"]["recent"]
        # the model from before the drift, as a candidate against the one that follows it: refused
        back = decide(d.registry.path("v0001"), d.registry.path("v0002"), held, config.promotion)
        assert not back.promote and back.reason.startswith(("not better", "worse on the old classes")), back.reason
        assert back.metrics["test"]["recent"]["lost"] > back.metrics["test"]["recent"]["gained"]
