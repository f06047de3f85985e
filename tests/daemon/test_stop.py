"""Every phase of a cycle stops on time: a real ``edgerev daemon run`` process, parked in one phase
(``stop_child.py``: ingest, a training step, the final evaluation, the held-out evaluation, the ONNX
export, the promotion) gets a real SIGTERM from this process, exits 0 without finishing what the phase
had left to do (a promotion under way finishes: ``current`` is whole, on the old version or the new), and
the next start takes up the job where it stopped. Waits are on the daemon's own lines, never on the clock.

How long a stop takes in each phase is the benchmark's business (``benchmarks/stop_latency.py``); here a
phase that did not stop would show as work done after the signal (a model written, a version promoted).
"""

from __future__ import annotations

import shutil
import signal
import sys
from pathlib import Path

import pytest

from edgerev_daemon.errors import Stopped
from edgerev_daemon.learning.exporting import export
from edgerev_daemon.service.daemon import Daemon
from edgerev_daemon.storage.check import check_consistency
from edgerev_daemon.storage.records import JobState
from tests.daemon.conftest import Clock
from tests.daemon.running import Running
from tests.daemon.test_service import SMALL, assert_current_complete, drop, make_config

CHILD = Path(__file__).with_name("stop_child.py")


def _second_job(served: Path, tmp_path: Path) -> tuple:
    """A copy of ``served`` with a second job's images (a new class among them) in its inbox."""
    shutil.copytree(served, tmp_path / "data", symlinks=True)
    config, path = make_config(tmp_path)
    drop(config, 120, range(3), start=5000)
    return config, path


def _stop_in(phase: str, config, path: Path) -> str:
    """Run the daemon parked in ``phase``, SIGTERM it there; its log once it exited 0."""
    with Running(path, command=[sys.executable, str(CHILD), str(path), phase]) as d:
        d.wait_for(f"parked in {phase}")
        d.send(signal.SIGTERM)
        assert d.finish() == 0, d.log()[-3000:]
        log = d.log()
    assert "edgerev.daemon: stopped" in log, log[-3000:]
    return log


def _resume(config) -> dict:
    """The next start: one cycle, which finishes the job; the data directory is consistent after it."""
    with Daemon(config, clock=Clock()) as d:
        job = d.cycle().job
        assert job is not None and job.get("status") not in ("failed", "stopped"), job
        assert d.store.active_job() is None
        report = check_consistency(d.store, d.blobs)
        assert report.clean, report.to_json()
    assert_current_complete(config)
    return job


def _samples(config) -> int:
    with Daemon(config, clock=Clock()) as d:
        return d.store.count_samples()


@pytest.mark.slow
def test_a_stop_in_ingest_commits_the_files_examined_and_leaves_the_rest(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("ingest", config, path)
    assert "job 2" not in log  # no job after a stopped ingest
    assert _samples(config) == 160 + 3  # the third file was being examined when the signal came
    assert len(list(config.inbox_path.rglob("*.png"))) == 120 - 3
    _resume(config)


@pytest.mark.slow
def test_a_stop_in_a_training_step_ends_after_that_step(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("training", config, path)
    assert "job 2 stopped at step 3 of" in log, log[-2000:]
    assert (Path(config.data_dir) / "jobs" / "job-00002" / "checkpoints" / "latest.json").is_file()
    _resume(config)


@pytest.mark.slow
def test_a_stop_in_the_final_evaluation_writes_no_model(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("final", config, path)
    assert "job 2 stopped in the final evaluation; it resumes at the next start" in log, log[-2000:]
    run = Path(config.data_dir) / "jobs" / "job-00002"
    assert not (run / "model.json").exists() and not (run / "summary.json").exists()
    _resume(config)


@pytest.mark.slow
def test_a_stop_in_the_held_out_evaluation_decides_nothing(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("evaluation", config, path)
    assert "job 2 stopped in the evaluation; it resumes at the next start" in log, log[-2000:]
    with Daemon(config, clock=Clock()) as d:
        assert [v.id for v in d.store.versions()] == ["v0001"]  # no decision recorded
        assert d.store.active_job().state == JobState.QUEUED
    _resume(config)


@pytest.mark.slow
def test_a_stop_in_the_export_kills_it_and_keeps_the_current_version(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("export-forever", config, path)
    assert "job 2 stopped in the ONNX export; it resumes at the next start" in log, log[-2000:]
    pid = int(next(line for line in log.splitlines() if line.startswith("parked in export-forever")).split()[-1])
    assert not Path(f"/proc/{pid}").exists(), "the export's child outlived the daemon"
    assert assert_current_complete(config) == "v0001"
    assert not (Path(config.data_dir) / "versions" / "v0002").exists()
    job = _resume(config)  # the decision was recorded: the next start carries it out
    assert job["promoted"] and job["version"] == "v0002", job
    assert assert_current_complete(config) == "v0002"


@pytest.mark.slow
def test_a_stop_in_the_promotion_finishes_it_and_current_is_whole(served, tmp_path):
    config, path = _second_job(served, tmp_path)
    log = _stop_in("promotion", config, path)
    assert "promoted" in log and "job 2" in log, log[-2000:]
    assert assert_current_complete(config) == "v0002"
    with Daemon(config, clock=Clock()) as d:
        assert d.store.in_service() == "v0002" and d.store.active_job() is None


@pytest.mark.slow
def test_a_stop_in_the_stage_profile_measurement_kills_it(tmp_path, monkeypatch):
    """A model's first job under a memory budget measures its stage profile (minutes on a small CPU) in a
    child process: a stop kills it and nothing is cached."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("EDGEREV_CACHE", str(cache))  # no profile yet, whatever this machine measured before
    training = {**SMALL["training"], "memory": {"budget": "64MiB"}}
    config, path = make_config(tmp_path, training=training)
    drop(config, 120, range(2))
    log = _stop_in("plan", config, path)
    assert "job 1 stopped in the stage profile's measurement; it resumes at the next start" in log, log[-2000:]
    assert not list(cache.rglob("*.json")), "a profile was cached from a measurement that was stopped"


# the export's child process, without a model: cheap ----------------------------------------------------

PARKED = "import sys; print('parked', file=sys.stderr, flush=True); sys.stdin.read()"


def _parked(monkeypatch, code: str = PARKED) -> None:
    from edgerev_daemon.learning import exporting

    monkeypatch.setattr(exporting, "command", lambda run_dir, out, threads, trust=(): [sys.executable, "-c", code])


def test_a_stop_kills_the_export_child(tmp_path, monkeypatch):
    _parked(monkeypatch)
    asked = []

    def stop() -> bool:  # says stop once the child has written its line (it runs, parked)
        asked.append(1)
        log = tmp_path / "export.log"
        return log.is_file() and log.read_text().startswith("parked")

    with pytest.raises(Stopped, match="the ONNX export"):
        export(tmp_path, tmp_path / "model.onnx", stop)
    assert len(asked) >= 2 and not (tmp_path / "model.onnx").exists()


def test_a_failed_export_says_why(tmp_path, monkeypatch):
    _parked(monkeypatch, "import sys; sys.exit('edgerev: the exporter refused the model')")
    with pytest.raises(Exception, match="exit status 1.*the exporter refused the model"):
        export(tmp_path, tmp_path / "model.onnx", lambda: False)
