"""The two-phase scenario of ``benchmarks/digits_daemon.py`` in little: a device first sees three classes, then
three new ones, one daemon cycle each (as ``edgerev daemon once`` runs it), with early stopping, its anneal,
replay and distillation as the presets train. Phase 2's candidate must be promoted (the gate's defaults) and
must know the new classes without losing the old, on generated images no job ever saw."""

from __future__ import annotations

import pytest
import torch

from edgerev.models.directory import load_model
from edgerev.train.data import SyntheticImages
from edgerev.train.evaluate import predict_logits
from edgerev.train.labeled import LabeledImages
from edgerev_daemon.config import config_from_dict
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.demo import write_images
from tests.daemon.conftest import Clock

CLASSES, SIZE = 6, 16
OLD, NEW = [0, 1, 2], [3, 4, 5]


def config(tmp_path):
    return config_from_dict({
        "data_dir": str(tmp_path / "data"), "image_size": SIZE, "heldout_fraction": 0.2,
        "ingest": {"settle_seconds": 0.0}, "schedule": {"min_new_samples": 100, "max_interval_seconds": 86400.0},
        "training": {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}},
                     "train": {"epochs": 8, "patience": 2, "anneal_epochs": 2, "batch": 32},
                     "optim": {"lr": 0.05}, "continual": {"replay": 200, "distill": 1.0}},
        "promotion": {"exporter": "legacy"},  # the fast exporter: test_service.py's SMALL says why
    })


def accuracy(model_dir, classes) -> float:
    """On 40 generated images of each of ``classes`` that no job was given (another range of indices)."""
    test = SyntheticImages(40 * len(classes), num_classes=CLASSES, size=SIZE, classes=classes, start=500_000)
    model, info, _ = load_model(model_dir)
    images = [test[i] for i in range(len(test))]
    data = LabeledImages(torch.stack([x for x, _ in images]), torch.tensor([y for _, y in images]), test.classes)
    predicted = [info.classes[k] for k in predict_logits(model, data, info).argmax(1).tolist()]
    return sum(p == test.classes[y] for p, (_, y) in zip(predicted, images, strict=True)) / len(images)


@pytest.mark.slow
def test_a_device_learns_new_classes_in_a_second_phase_and_keeps_the_old(tmp_path):
    cfg, clock = config(tmp_path), Clock()
    write_images(cfg.inbox_path, 180, OLD, num_classes=CLASSES, size=SIZE)
    with Daemon(cfg, clock=clock) as d:
        first = d.cycle().job
    assert first["promoted"] and first["version"] == "v0001", first
    old_before = accuracy(cfg.layout.root / "current", OLD)
    assert old_before >= 0.9

    write_images(cfg.inbox_path, 180, NEW, num_classes=CLASSES, size=SIZE, start=10_000)
    clock.advance(3600)
    with Daemon(cfg, clock=clock) as d:  # a second `once`
        second = d.cycle().job
        v2 = d.store.get_version("v0002")
    assert second["promoted"] and second["version"] == "v0002", second
    assert d.registry.current() == "v0002"
    assert v2.metrics["classes"] == [f"class{c}" for c in range(CLASSES)]
    assert accuracy(cfg.layout.root / "current", NEW) >= 0.9  # it learnt the new classes
    assert accuracy(cfg.layout.root / "current", OLD) >= 0.9  # and kept the old ones
