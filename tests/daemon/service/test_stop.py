"""Every phase of a cycle stops on time: a real ``edgerev daemon run`` process, parked in one phase
(``stop_child.py``: ingest, a training step, the final evaluation, the held-out evaluation, the ONNX
export, the promotion) gets a real SIGTERM from this process, exits 0 without finishing what the phase
had left to do (a promotion under way finishes: ``current`` is whole, on the old version or the new), and
the next start takes up the job where it stopped. Waits are on the daemon's own lines, never on the clock.

How long a stop takes in each phase is the benchmark's business (``benchmarks/stop_latency.py``); here a
phase that did not stop would show as work done after the signal (a model written, a version promoted, an
evaluation row logged, a batch scored), and a stopped daemon ends without the interpreter's teardown.
"""

from __future__ import annotations

import json
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
from tests.daemon.service.test_service import SMALL, assert_current_complete, drop, make_config

CHILD = Path(__file__).parents[1] / "stop_child.py"


def _second_job(served: Path, tmp_path: Path, **over) -> tuple:
    """A copy of ``served`` with a second job's images (a new class among them) in its inbox (``over``: the
    config's sections that differ from test_service's SMALL)."""
    shutil.copytree(served, tmp_path / "data", symlinks=True)
    config, path = make_config(tmp_path, **over)
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
    assert "interpreter teardown" not in log, "the stopped daemon went through the interpreter's teardown"
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
def test_a_stop_in_an_epochs_evaluation_leaves_it_due_for_the_resume(served, tmp_path):
    train = {**SMALL["training"]["train"], "eval_batch": 4}  # several batches: the stop is asked between two
    config, path = _second_job(served, tmp_path, training={**SMALL["training"], "train": train})
    log = _stop_in("epoch", config, path)
    run = Path(config.data_dir) / "jobs" / "job-00002"
    latest = json.loads((run / "checkpoints" / "latest.json").read_text())
    assert latest["extra"].get("evaluation_due") is True, latest
    assert f"job 2 stopped at step {latest['step']} of" in log, log[-2000:]
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert not [r for r in rows if r["kind"] == "eval"], "the evaluation ran after the stop"
    _resume(config)
    with Daemon(config, clock=Clock()) as d:
        steps = d.store.get_version("v0002").metrics["training"]["steps"]
    assert steps > latest["step"]  # the resumed job trained on from its checkpoint


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


# a stop inside the long loops, in this process: counted in batches and samples, not seconds ------------------

def test_a_stop_while_scoring_the_held_out_samples_waits_one_batch(tmp_path, monkeypatch):
    """The gate scores each model on every held-out sample (thousands on a device that ran for months): a
    stop is asked before each batch, and no batch runs after it said so."""
    import torch

    import edgerev.train.evaluate as evaluation
    from edgerev.models.directory import ModelInfo, save_model
    from edgerev.models.resolve import resolve_model
    from edgerev.train.labeled import LabeledImages
    from edgerev_daemon.learning.promote import HeldOut, score

    args = {"width": 8, "blocks": [1, 1, 1, 1, 1]}
    save_model(tmp_path / "m", resolve_model("revnext", args=args, num_classes=2),
               ModelInfo("revnext", ("a", "b"), 16, model_args=args))
    n = 600  # three batches of predict_logits's 256
    data = LabeledImages(torch.zeros(n, 3, 16, 16, dtype=torch.uint8), torch.zeros(n, dtype=torch.long), ("a", "b"))
    held = HeldOut(("a",) * n, (True,) * n, data)
    batches = []
    real = evaluation.normalize
    monkeypatch.setattr(evaluation, "normalize", lambda *a: batches.append(1) or real(*a))
    assert len(score(tmp_path / "m", held).right) == n and len(batches) == 3
    batches.clear()
    with pytest.raises(Stopped, match="the evaluation"):
        score(tmp_path / "m", held, stop=lambda: len(batches) >= 1)
    assert len(batches) == 1, "a batch was scored after the stop was asked for"


def test_a_stop_while_a_jobs_samples_are_decoded_waits_one_chunk(monkeypatch):
    """A job decodes its samples (a hundred thousand on a full store) before it trains: a stop is asked every
    DECODE_CHUNK samples."""
    import torch

    from edgerev_daemon.learning import jobs

    decoded = []
    monkeypatch.setattr(jobs, "DECODE_CHUNK", 4)
    monkeypatch.setattr(jobs, "decode_image", lambda path: decoded.append(path) or torch.zeros(3, 2, 2))

    class Blobs:
        def path(self, sha):
            return sha

    samples = [type("Sample", (), {"sha256": f"{i:064x}"})() for i in range(10)]
    assert jobs.decode_samples(samples, Blobs()).shape == (10, 3, 2, 2)
    decoded.clear()
    with pytest.raises(Stopped, match="reading the job's samples"):
        jobs.decode_samples(samples, Blobs(), stop=lambda: len(decoded) >= 1, what="reading the job's samples")
    assert len(decoded) == 4, "a sample was decoded past the chunk in which the stop was asked for"


# the export's child process, without a model: cheap ----------------------------------------------------

PARKED = "import sys; print('parked', file=sys.stderr, flush=True); sys.stdin.read()"


def _parked(monkeypatch, code: str = PARKED) -> None:
    from edgerev_daemon.learning import exporting

    monkeypatch.setattr(exporting, "command", lambda *args: [sys.executable, "-c", code])


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
