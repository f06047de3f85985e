"""A device adopts a fleet model through its real gate: one that knows more classes and keeps the device's
own is promoted, one that forgets the device's classes is refused with the evidence (a real daemon, real
training, real held-out samples, :func:`edgerev_daemon.learning.fleet.consider`)."""

import pytest
import torch
import yaml

pytest.importorskip("flwr")

from edgerev.fleet.model import FleetModel  # noqa: E402
from edgerev_daemon.learning.fleet import consider  # noqa: E402

ARGS = {"width": 8, "blocks": [1, 1, 1, 1, 1]}
FLEET = ("class0", "class1", "class2")


@pytest.fixture(scope="module")
def device(tmp_path_factory):
    """A device with classes 0 and 1 and a local model in service (its first job)."""
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.demo import write_images

    tmp = tmp_path_factory.mktemp("adopt")
    path = tmp / "daemon.yaml"
    path.write_text(yaml.safe_dump({
        "data_dir": str(tmp / "dev"), "image_size": 16, "heldout_fraction": 0.25,
        "ingest": {"settle_seconds": 0}, "schedule": {"min_new_samples": 1}, "storage": {"min_free_space": 0},
        # the evidence decides here, not the class-at-zero rule (which would refuse the forgetting model first)
        "promotion": {"min_heldout_per_class": 1, "refuse_class_at_zero": False, "exporter": "legacy"},
        "training": {"model": {"arch": "revnext", "args": ARGS}, "train": {"batch": 16, "epochs": 4}}}))
    config = load_config(path)
    write_images(config.inbox_path, 64, [0, 1], size=16)
    with Daemon(config, config_path=path) as daemon:
        daemon.cycle()
        assert daemon.registry.current() == "v0001"
        yield daemon


def _fleet_model(daemon, round_: str, rows) -> FleetModel:
    """The model in service as a fleet model of three classes (its batch-norm statistics travel with it, so
    the device's copy is exactly these weights): ``rows(head)`` gives the head's three rows from its own."""
    from edgerev.models.directory import load_model

    model, info, _ = load_model(daemon.registry.current_path())
    state = model.state_dict()
    head = state["head.weight"][[info.classes.index(c) for c in FLEET[:2]]]
    shared = {k: v.clone() for k, v in state.items() if v.is_floating_point()}
    shared["head.weight"] = rows(head)
    return FleetModel(round_, "revnext", ARGS, 16, FLEET, shared, "all", True, 0, 1)


@pytest.mark.slow
def test_a_fleet_model_that_keeps_the_devices_classes_is_adopted_and_one_that_forgets_them_is_refused(device):
    # knows a third class whose logit is the mean of the device's two: never above both, so every held-out
    # sample of the device is classified as before
    teaches = _fleet_model(device, "1/1", lambda h: torch.cat([h, h.mean(0, keepdim=True)]))
    adopted = consider(device, teaches)
    assert adopted.promoted, adopted.reason
    assert "0 lost" in adopted.reason and "no evidence of a loss" in adopted.reason, adopted.reason
    assert device.registry.current() == adopted.version != "v0001"

    # the device's two rows swapped: every sample it got right is now wrong
    forgets = _fleet_model(device, "1/2", lambda h: torch.cat([h.flip(0), h.mean(0, keepdim=True)]))
    refused = consider(device, forgets)
    assert not refused.promoted
    assert refused.reason.startswith("fleet model worse on this device's recent held-out samples by"), refused.reason
    assert "0 gained" in refused.reason and "the model in service stays" in refused.reason
    assert device.registry.current() == adopted.version


def _statistics(state) -> dict:
    return {n: t for n, t in state.items() if n.endswith(("running_mean", "running_var"))}


@pytest.mark.slow
def test_a_round_at_the_fleets_statistics_trains_at_them_and_sends_what_the_device_measures(device):
    from dataclasses import replace

    from edgerev_daemon.learning.fleet import local_state, measure_norms, train_round

    fm = replace(_fleet_model(device, "2/2", lambda h: torch.cat([h, h.mean(0, keepdim=True)])),
                 norms_measured=True, lr=0.01)
    result = train_round(device, fm)
    root = device.config.layout.root
    kept, _ = local_state(root)
    sent = _statistics(fm.shared)
    assert sent and all(torch.equal(kept[n], t) for n, t in sent.items()), "trained with batch norms frozen"
    assert any(not torch.equal(kept[n], fm.shared[n]) for n in kept if n.endswith("weight")), "and it trained"
    measured = measure_norms(device, root / "fleet" / "local")
    assert set(measured) == set(sent)
    for n, t in measured.items():
        torch.testing.assert_close(result.shared[n], t)
    assert any(not torch.allclose(result.shared[n], sent[n]) for n in sent), "the device's own moments go back"


@pytest.mark.slow
def test_a_fleet_model_fine_tuned_before_the_gate_is_judged_as_a_job(device):
    from dataclasses import replace

    fm = replace(_fleet_model(device, "3/1", lambda h: torch.cat([h, h.mean(0, keepdim=True)])),
                 norms_measured=True, adopt_epochs=1, adopt_distill=1.0, lr=0.01)
    c = consider(device, fm)
    assert c.metrics["fine_tuned_epochs"] == 1 and c.reason.startswith("fleet model"), c.reason
    jobs = [j for j in device.store.jobs() if j.reason == "fleet model 3/1"]
    assert len(jobs) == 1 and device.store.active_job() is None
    assert not any(p.name.endswith(".base") for p in (device.config.layout.root / "jobs").iterdir())
