"""The schedule says when the next job runs and, when none is due, why not (one function for the
service, ``once`` and ``status``)."""

from __future__ import annotations

from edgerev_daemon.config import ScheduleConfig
from edgerev_daemon.learning.schedule import next_job
from edgerev_daemon.storage.records import JobState
from tests.daemon.storage.test_store import sample


def test_why_no_job_runs_then_why_one_does(datadir):
    store, clock = datadir.store, datadir.clock
    s = ScheduleConfig(min_new_samples=50, max_interval_seconds=3600, retry_seconds=600)
    first = next_job(store, s, clock())
    assert first.due is None and first.waiting == "no new samples since the last job"
    store.record_batch([sample(i) for i in range(20)], [], 0.1)
    wait = next_job(store, s, clock())
    assert wait.due is None and wait.new_samples == 20 and wait.samples_needed == 30
    assert wait.waiting == "20 new samples: 30 more (schedule.min_new_samples 50), or 3600 s"
    clock.advance(3600)
    assert next_job(store, s, clock()).due == "20 new samples and 3600 s since the last job"
    store.record_batch([sample(i) for i in range(20, 60)], [], 0.1)
    assert next_job(store, s, clock()).due == "60 new samples (threshold 50)"


def test_a_failed_job_holds_the_schedule_back_and_says_until_when(datadir):
    store, clock = datadir.store, datadir.clock
    s = ScheduleConfig(min_new_samples=50, retry_seconds=600)
    store.record_batch([sample(i) for i in range(120)], [], 0.1)
    job = store.create_job("120 new samples")
    store.set_job_state(job.id, JobState.RUNNING)
    assert next_job(store, s, clock()).due == "resume the interrupted job"
    store.set_job_state(job.id, JobState.FAILED, error="disk full")
    clock.advance(100)
    held = next_job(store, s, clock())
    assert held.due is None and held.retry_at == clock() + 500 and held.new_samples == 120
    assert held.waiting == f"job {job.id} failed; retried after schedule.retry_seconds, in 500 s (120 new samples wait)"
    clock.advance(500)
    assert next_job(store, s, clock()).due == "120 new samples (threshold 50)"


def test_a_new_class_makes_one_job_due_once_it_can_be_trained(datadir):
    """A label the model in service does not know is due as soon as it has min_samples_per_label training
    samples, not after min_new_samples; the job that trains it (promoted or not) ends that reason."""
    store = datadir.store
    s = ScheduleConfig(min_new_samples=500, max_interval_seconds=10**9)
    store.record_batch([sample(i, label="cat") for i in range(40)], [], 0.1)
    known = ("cat",)
    assert next_job(store, s, datadir.clock(), known, minimum=5).due is None
    store.record_batch([sample(100 + i, label="dog") for i in range(4)], [], 0.1)
    assert next_job(store, s, datadir.clock(), known, minimum=5).due is None  # 4 of 5: held back, waits
    store.record_batch([sample(200, label="dog")], [], 0.1)
    assert next_job(store, s, datadir.clock(), known, minimum=5).due == "new class to learn: dog (5)"
    assert next_job(store, s, datadir.clock(), (), minimum=5).due is None  # no model in service: thresholds
    off = ScheduleConfig(min_new_samples=500, max_interval_seconds=10**9, new_classes=False)
    assert next_job(store, off, datadir.clock(), known, minimum=5).due is None
    assert next_job(store, s, datadir.clock(), known, minimum=5, minimum_heldout=1000).due is None
    job = store.create_job("new class")
    store.set_job_state(job.id, JobState.RUNNING)
    store.set_job_state(job.id, JobState.DONE)  # refused or not: the class was trained
    store.record_batch([sample(300 + i, label="dog") for i in range(5)], [], 0.1)
    assert next_job(store, s, datadir.clock(), known, minimum=5).due is None


def test_a_new_class_waits_for_the_held_out_samples_the_gate_judges_it_on(datadir):
    """Due at the first batch that gives the new label both minimums (train and held-out), not before."""
    from edgerev_daemon.storage.records import Split

    store = datadir.store
    s = ScheduleConfig(min_new_samples=10**6, max_interval_seconds=10**9)
    store.record_batch([sample(i, label="cat") for i in range(40)], [], 0.1)
    for i in range(400):
        counts = (store.label_counts(Split.TRAIN).get("dog", 0), store.label_counts(Split.HELDOUT).get("dog", 0))
        due = next_job(store, s, datadir.clock(), ("cat",), minimum=5, minimum_heldout=3).due
        assert (due is not None) == (counts[0] >= 5 and counts[1] >= 3), (i, counts, due)
        if due is not None:
            assert due == f"new class to learn: dog ({counts[0]})"
            return
        store.record_batch([sample(1000 + i, label="dog")], [], 0.1)
    raise AssertionError("400 samples never gave 3 held-out ones")


def test_the_schedule_reads_the_classes_in_service_as_a_job_does(tmp_path):
    """One reading of a version's classes (edgerev.models.directory.model_classes, no torch): what the registry
    gives the schedule is what the job trains from, and a description a job would refuse gives no classes."""
    import json

    import pytest

    from edgerev.models.directory import CheckpointError, model_classes
    from edgerev_daemon.storage.registry import Registry

    registry = Registry(tmp_path)
    assert registry.current_classes() == ()
    info = {"arch": "revnext", "classes": ["cat", "dog"], "input_size": 32, "mean": [0.5] * 3, "std": [0.25] * 3}
    for name, described in (("v0001", info), ("v0002", {**info, "classes": ["cat", "cat"]}),
                            ("v0003", {k: v for k, v in info.items() if k != "arch"})):
        registry.write(name, {"model.safetensors": b"w", "model.json": json.dumps(described).encode(),
                              "model.onnx": b"onnx"})
        registry.switch(name)
        if name == "v0001":
            assert registry.current_classes() == model_classes(registry.path(name)) == ("cat", "dog")
        else:
            with pytest.raises(CheckpointError):
                model_classes(registry.path(name))
            assert registry.current_classes() == ()


def test_unlabelled_samples_alone_make_no_job_due_and_the_reason_says_what_they_do(datadir):
    """150 unlabelled images and no labelled one: no job, and the reason names them and what becomes of them
    (the owner saw 'no new samples' beside '150 unlabelled' and could not tell why)."""
    store, clock = datadir.store, datadir.clock
    s = ScheduleConfig(min_new_samples=50, max_interval_seconds=3600)
    store.record_batch([sample(i, label=None) for i in range(150)], [], 0.1)
    clock.advance(7200)  # past max_interval_seconds too: unlabelled samples never make a job due
    for semi, use in ((True, "the next job learns from them with pseudo-labels (training.semi)"),
                      (False, "they are trained on once labelled (training.semi is off)")):
        wait = next_job(store, s, clock(), semi=semi)
        assert wait.due is None and wait.new_samples == 0
        assert wait.waiting == (f"no new samples since the last job; 150 unlabelled samples wait, which make no job "
                                f"due: {use}, and answering the questions (edgerev daemon label) labels some")
    store.record_batch([sample(i) for i in range(150, 210)], [], 0.1)
    assert next_job(store, s, clock(), semi=True).due == "60 new samples (threshold 50)"
