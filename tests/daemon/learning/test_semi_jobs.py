"""A daemon job learns from the store's unlabelled images (FixMatch, ``training.semi``): the real loop with
unlabelled images in the inbox, the bound on how many a job reads, and a job unchanged while none exists."""

from __future__ import annotations

import html
import json

import pytest
import yaml

from edgerev.config import ConfigError
from edgerev_daemon import ingest_inbox
from edgerev_daemon.config import config_from_dict
from edgerev_daemon.learning.jobs import check_training, load_unlabeled, run_job
from edgerev_daemon.service.http import format_metrics
from edgerev_daemon.service.page import format_html
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage.records import JobState, Split

from ..conftest import Clock, image_bytes, open_data_dir, write
from ..service.test_service import SMALL, drop
from ..service.test_service import make_config as service_config


@pytest.mark.slow
def test_a_daemon_job_learns_from_unlabelled_images_in_the_inbox(tmp_path):
    """The real loop: 160 labelled images and 60 unlabelled ones; the job takes the unlabelled ones as its
    trainer's unlabelled set, reports them, and is judged on the labelled held-out samples alone."""
    from edgerev_daemon.service.daemon import Daemon

    config, _ = service_config(tmp_path)
    assert config.training.semi.enabled  # the daemon's default
    drop(config, 160, range(2))
    for i in range(60):
        write(config.inbox_path / "unlabeled" / f"{i:03d}.png", image_bytes(900 + i, (16, 16)))
    with Daemon(config, clock=Clock()) as daemon:
        r = daemon.cycle()
        assert r.job is not None and r.job.get("version") == "v0001", r.job
        store = daemon.store
        run = daemon.registry.path("v0001")  # the job's folder is gone; the version keeps its summary and recipe
        summary = json.loads((run / "summary.json").read_text())
        semi = summary["semi"]
        assert semi["unlabeled_pool"] == 60 and semi["unlabeled_per_step"] == 60  # ratio 2 x 32, at most the pool
        assert semi["unlabeled_used"] == 60 * summary["steps"]
        assert 0 <= semi["pseudo_labeled"] <= semi["unlabeled_used"]
        assert len(semi["epochs"]) == 2
        saved = yaml.safe_load((run / "config.yaml").read_text())
        assert saved["semi"]["enabled"] and "60 unlabelled samples" in saved["data"]["train"]["description"]
        held = store.count_samples(Split.HELDOUT)
        metrics = store.get_version("v0001").metrics
        assert metrics["evaluation"]["heldout_samples"]["all"] == held  # labelled held-out samples only
        assert store.count_samples(labeled=False) == 60  # pseudo-labels are never stored
        last = semi["epochs"][-1]
        assert metrics["training"]["semi"] == {
            "unlabeled_pool": 60, "unlabeled_per_step": 60, "unlabeled_used": semi["unlabeled_used"],
            "pseudo_labeled": semi["pseudo_labeled"], "epochs": 2, "last_epoch": last}
    # status, the page and /metrics tell what the last job did with them
    s = status(config, events=0)
    assert s["samples"]["unlabeled"] == 60
    assert s["pseudo_labels"] == {"version": "v0001", "job": 1, "pool": 60, "last_epoch_unlabeled": last["unlabeled"],
                                  "last_epoch_pseudo_labeled": last["pseudo_labeled"],
                                  "unlabeled_used": semi["unlabeled_used"], "pseudo_labeled": semi["pseudo_labeled"],
                                  "epochs": 2}
    line = (f"pseudo-labels: job 1 (v0001) gave {last['pseudo_labeled']} of the {last['unlabeled']} unlabelled images "
            f"of its last epoch a pseudo-label (pool 60; {semi['pseudo_labeled']} of {semi['unlabeled_used']} views "
            "over 2 epochs)")
    assert line in format_status(s).splitlines()
    assert html.escape(line.removeprefix("pseudo-labels: ")) in format_html(s)
    text = format_metrics(s)
    assert "\nedgerev_unlabeled_samples 60\n" in text
    assert f"\nedgerev_last_job_pseudo_labeled {last['pseudo_labeled']}\n" in text
    assert f"\nedgerev_last_job_unlabeled_taken {last['unlabeled']}\n" in text


@pytest.mark.slow
def test_status_before_a_job_and_after_one_without_unlabelled_images(tmp_path):
    """No job yet: no pseudo-label line, no gauge; a job with no unlabelled image says so (pool 0)."""
    from edgerev_daemon.service.daemon import Daemon

    config, _ = service_config(tmp_path)
    drop(config, 40, range(2))
    with Daemon(config, clock=Clock()) as daemon:
        assert daemon.cycle().job is None  # 40 of schedule.min_new_samples 100
    s = status(config, events=0)
    assert s["pseudo_labels"] is None and "pseudo-labels" not in format_status(s)
    assert "edgerev_last_job_pseudo_labeled" not in format_metrics(s)
    drop(config, 160, range(2), start=40)
    with Daemon(config, clock=Clock()) as daemon:
        assert daemon.cycle().job["version"] == "v0001"
    s = status(config, events=0)
    assert s["pseudo_labels"]["pool"] == 0
    assert "pseudo-labels: none (job 1, v0001, had no unlabelled image)" in format_status(s)
    assert "\nedgerev_last_job_pseudo_labeled 0\n" in format_metrics(s)


def _job(tmp_path, training: dict, unlabeled: int = 0):
    config = config_from_dict({**SMALL, "data_dir": str(tmp_path / "data"), "training": training})
    d = open_data_dir(config)
    drop(config, 80, range(2))
    for i in range(unlabeled):
        write(config.inbox_path / "unlabeled" / f"{i:03d}.png", image_bytes(500 + i, (16, 16)))
    ingest_inbox(d.config, d.store, clock=d.clock)
    return d


def _train(d, job=None):
    job = job or d.store.create_job("test")
    d.store.set_job_state(job.id, JobState.RUNNING)
    return job, run_job(d.config, d.store, d.blobs, job, None, 0, stop=lambda: False)


def test_a_job_without_unlabelled_images_is_the_labelled_job(tmp_path):
    on = _job(tmp_path / "on", SMALL["training"])
    off = _job(tmp_path / "off", {**SMALL["training"], "semi": {"enabled": False}})
    try:
        assert on.config.training.semi.enabled and not off.config.training.semi.enabled
        (_, a), (_, b) = _train(on), _train(off)
        assert a.status == b.status == "trained"
        assert a.summary["semi"] is None and a.summary["weights_sha256"] == b.summary["weights_sha256"]
    finally:
        for d in (on, off):
            d.store.close()
            d.lock.release()


def test_a_job_reads_the_newest_unlabelled_images_up_to_its_bound(tmp_path):
    d = _job(tmp_path, {**SMALL["training"], "max_unlabeled": 7}, unlabeled=12)
    try:
        job = d.store.create_job("test")
        newest = d.store.unlabeled_samples()[-7:]
        images = load_unlabeled(d.store, d.blobs, job, 7)
        assert images.shape == (7, 3, 16, 16)
        from edgerev.train.data import decode_image

        assert all((images[i] == decode_image(d.blobs.path(s.sha256))).all() for i, s in enumerate(newest))
        assert load_unlabeled(d.store, d.blobs, job, 0) is None
        _, outcome = _train(d, job)
        assert outcome.summary["semi"]["unlabeled_pool"] == 7
    finally:
        d.store.close()
        d.lock.release()


@pytest.mark.slow
def test_the_start_check_counts_the_extra_views(tmp_path):
    """The daemon's floor grows with FixMatch's views: a budget between the two floors is refused with it on."""
    from edgerev.models.resolve import resolve_model
    from edgerev.train.memory import floor
    from edgerev_daemon.learning.jobs import recipe

    training = {**SMALL["training"], "memory": {"budget": 1}, "continual": {"replay": 200, "distill": 0.0}}
    config = config_from_dict({**SMALL, "data_dir": str(tmp_path / "data"), "training": training})
    model = resolve_model("revnext", args=SMALL["training"]["model"]["args"], num_classes=2)
    cfg = recipe(config, None)
    plain = floor(cfg, model, None).total
    semi = floor(cfg, model, None, unlabeled=2 * 32).total
    assert semi > plain
    between = {**training, "memory": {"budget": (plain + semi) // 2}}
    with pytest.raises(ConfigError, match="smallest budget that fits is"):
        check_training(config_from_dict({**SMALL, "data_dir": str(tmp_path / "d"), "training": between}))
    check_training(config_from_dict({**SMALL, "data_dir": str(tmp_path / "d"),
                                     "training": {**between, "semi": {"enabled": False}}}))


def test_a_version_recorded_before_versions_kept_the_counts_is_unknown_not_zero():
    from types import SimpleNamespace

    from edgerev_daemon.service.status import pseudo_labels

    old = SimpleNamespace(id="v0001", job_id=1, metrics={"training": {"steps": 10}})
    none = SimpleNamespace(id="v0002", job_id=2, metrics={"training": {"steps": 10, "semi": None}})
    assert pseudo_labels([]) is None and pseudo_labels([old]) is None
    assert pseudo_labels([old, none])["pool"] == 0
