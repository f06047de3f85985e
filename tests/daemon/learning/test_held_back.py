"""Labels with too few training samples are held back (not trained as a class, not judged) and reported,
then trained on every sample they have once enough arrive."""

from __future__ import annotations

from dataclasses import replace

import pytest
import yaml

from edgerev.config import ConfigError
from edgerev.models.directory import read_info
from edgerev_daemon.config import config_from_dict
from edgerev_daemon.learning.jobs import job_data
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage.records import Split
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import SMALL, drop, make_config


@pytest.mark.slow
def test_a_rare_label_waits_reported_then_trains_on_all_its_samples(tmp_path):
    config, _ = make_config(tmp_path, training={**SMALL["training"], "min_samples_per_label": 8})
    drop(config, 100, range(2))
    drop(config, 4, [2], start=5000)  # class2: at most 4 training samples, fewer than 8
    with Daemon(config, clock=Clock()) as d:
        r = d.cycle()
        v1 = d.store.get_version(r.job["version"])
        rare = d.store.label_counts(Split.TRAIN)["class2"]
        assert v1.metrics["held_back"] == {"class2": rare} and rare < 8
        assert v1.metrics["classes"] == ["class0", "class1"]  # not a class of the model
        assert "class2" not in v1.metrics["evaluation"]["candidate"]["per_class"]  # nor judged
        assert any(e.message.get("message", "").startswith(f"job {r.job['job']}: held back (fewer than 8")
                   for e in d.store.events())
        s = status(config)
        assert s["labels_held_back"] == {"class2": rare}
        assert f"labels held back (too few training samples yet): class2 ({rare})" in format_status(s)

        drop(config, 100, [2], start=6000)  # enough of it now
        base = d.store.last_batch_id() - 1
        r = d.cycle()
        v2 = d.store.get_version(r.job["version"])
        assert v2.metrics["held_back"] == {} and v2.metrics["classes"] == ["class0", "class1", "class2"]
        assert status(config)["labels_held_back"] == {}
        # the job trained on every class2 sample, those that waited in the first batch included
        job = d.store.get_job(r.job["job"])
        train, held, waiting = job_data(d.store, d.blobs, job, base, known=["class0", "class1"], minimum=8)
        every = d.store.label_counts(Split.TRAIN, upto_batch=job.data_batch_id)["class2"]
        assert waiting == {} and int((train.labels == train.classes.index("class2")).sum()) == every
        assert 0 < rare < every  # some waited: the scenario tests what it says
        assert read_info(config.layout.root / "current")[0].classes == ("class0", "class1", "class2")
        trained = yaml.safe_load((config.layout.root / "current" / "config.yaml").read_text())
        assert trained["data"]["train"]["kind"] == "provided" and f"job {job.id}" in trained["data"]["train"][
            "description"] and "noise" not in trained["data"]["train"]  # what was trained, not the defaults


def test_a_first_model_needs_two_labels_with_enough_samples(tmp_path):
    config, _ = make_config(tmp_path, training={**SMALL["training"], "min_samples_per_label": 8},
                            schedule={"min_new_samples": 50, "max_interval_seconds": 3600.0})
    drop(config, 60, [0])
    drop(config, 3, [1], start=5000)
    with Daemon(config, clock=Clock()) as d:
        r = d.cycle()
        assert r.job["status"] == "skipped"
        assert "a first model needs two labels with at least 8 training samples each" in r.job["reason"]
        assert "held back: class1" in r.job["reason"]


@pytest.mark.parametrize("value", [0, -1])
def test_min_samples_below_one_is_one_line_naming_the_key(tmp_path, value):
    data = {**SMALL, "data_dir": str(tmp_path / "data"),
            "training": {**SMALL["training"], "min_samples_per_label": value}}
    with pytest.raises(ConfigError, match=r"training\.min_samples_per_label: must be at least 1"):
        config_from_dict(data)


def test_the_label_counts_cover_every_label_in_arrival_order(tmp_path):
    config, _ = make_config(tmp_path)
    drop(config, 20, [3, 1])
    with Daemon(replace(config), clock=Clock()) as d:
        d.cycle()
        counts = d.store.label_counts()
        assert list(counts) == d.store.labels() and sum(counts.values()) == 20
        train, held = d.store.label_counts(Split.TRAIN), d.store.label_counts(Split.HELDOUT)
        assert {k: train[k] + held[k] for k in counts} == counts
        assert d.store.label_counts(upto_batch=0) == dict.fromkeys(counts, 0)


def test_a_job_with_patience_but_too_few_samples_to_hold_any_out_runs_its_maximum(tmp_path):
    training = {**SMALL["training"], "min_samples_per_label": 2,
                "train": {**SMALL["training"]["train"], "epochs": 2, "patience": 1}}
    config, _ = make_config(tmp_path, training=training, heldout_fraction=0.01,
                            schedule={"min_new_samples": 4, "max_interval_seconds": 3600.0})
    drop(config, 4, range(2))
    with Daemon(config, clock=Clock()) as d:
        r = d.cycle()
        job = d.store.get_job(r.job["job"])
        train, held, _ = job_data(d.store, d.blobs, job, 0, minimum=2)
        assert len(held) == 0 and len(train.held_out(0.1)[1]) == 0  # the case this test is about
        assert r.job.get("version") is not None, r.job  # trained (not failed on "no sample is held out")
        assert d.store.get_version(r.job["version"]).metrics["training"]["steps"] == 2  # both epochs ran
