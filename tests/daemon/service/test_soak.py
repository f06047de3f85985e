"""A soak run: many cycles with data arriving between them, new classes among it.

Accuracy of the model in service on a fixed evaluation set of every class must rise or hold, and the
store and the blob files must stay consistent after every cycle.
"""

from __future__ import annotations

import pytest

from edgerev.models.directory import load_model
from edgerev.train.config import SourceConfig
from edgerev.train.evaluate import predict_logits
from edgerev.train.labeled import LabeledImages, load_source
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.storage.check import check_consistency
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import drop, make_config

ARRIVALS = [range(2), range(2), range(3), range(4), range(4), range(4), range(4)]


def _accuracy(version_dir, evaluation: LabeledImages) -> float:
    model, info, _ = load_model(version_dir)
    predicted = [info.classes[k] for k in predict_logits(model, evaluation, info).argmax(1).tolist()]
    truth = [evaluation.classes[k] for k in evaluation.labels.tolist()]
    return sum(p == t for p, t in zip(predicted, truth)) / len(truth)


@pytest.mark.slow
def test_soak(tmp_path):
    config, _ = make_config(tmp_path, schedule={"min_new_samples": 60, "max_interval_seconds": 3600.0})
    evaluation = load_source(SourceConfig(samples=400, num_classes=4, start=5_000_000), 16)
    history, dropped = [], 0
    clock = Clock()
    with Daemon(config, clock=clock) as d:
        for k, classes in enumerate(ARRIVALS):
            dropped += len(drop(config, 120, classes, start=k * 10_000))
            report = d.cycle()
            clock.advance(60)
            assert report.job is not None and report.job.get("status") != "failed", report.job
            current = d.registry.current_path()
            history.append((report.job.get("version"), report.job.get("promoted"), _accuracy(current, evaluation)))
            consistency = check_consistency(d.store, d.blobs)
            assert consistency.clean, consistency.to_json()
            assert d.store.count_samples() == dropped
        accuracies = [a for _, _, a in history]
        print("soak:", history)
        for before, after in zip(accuracies, accuracies[1:]):
            assert after >= before - 0.05, history  # holds (within the promotion tolerance's noise) or rises
        assert accuracies[-1] > accuracies[0] + 0.3, history  # from two known classes of four to all four
        assert accuracies[-1] >= 0.8, history
        assert sum(1 for _, promoted, _ in history if promoted) >= 3
