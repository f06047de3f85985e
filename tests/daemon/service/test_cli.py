"""``edgerev daemon ...`` through the real CLI entry point: the demo, status, check, rollback, logging."""

from __future__ import annotations

import io
import json
import logging

import pytest
import torch
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from PIL import Image

from edgerev.cli import main


@pytest.mark.slow
def test_demo_status_check_rollback(tmp_path, capsys):
    """The README's first command, then the commands a user runs next."""
    folder = tmp_path / "demo"
    assert main(["daemon", "demo", "--dir", str(folder), "--images", "300"]) == 0
    out = capsys.readouterr().out
    assert "ingest: 300 stored" in out and "promoted" in out
    assert "ONNX model: " in out and "prediction with ONNX Runtime" in out
    config = str(folder / "daemon.yaml")
    assert main(["daemon", "status", "--config", config, "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert s["current"]["version"] == "v0001" and s["samples"]["total"] == 300 and s["daemon_pid"] is None
    assert main(["daemon", "check", "--config", config]) == 0
    assert "300 samples, 300 blobs: consistent" in capsys.readouterr().out
    assert main(["daemon", "rollback", "--config", config]) == 2
    err = capsys.readouterr().err
    assert err.startswith("edgerev daemon rollback: error: no earlier promoted version") and err.count("\n") == 1


def test_status_before_the_daemon_ran(tmp_path, capsys):
    config = tmp_path / "d.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\n")
    assert main(["daemon", "status", "--config", str(config)]) == 2
    assert "holds no store yet" in capsys.readouterr().err
    config.write_text("data_dir: x\nschedule: {min_new_samples: many}\n")
    assert main(["daemon", "once", "--config", str(config)]) == 2
    assert "schedule.min_new_samples: expected int, got str 'many'" in capsys.readouterr().err


def test_journald_priorities(monkeypatch, capsys):
    from edgerev_daemon.service.cli import setup_logging

    monkeypatch.setenv("JOURNAL_STREAM", "8:12345")
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    try:
        setup_logging("INFO")
        logging.getLogger("edgerev.daemon").warning("disk %s", "almost full")
        logging.getLogger("edgerev.daemon").info("cycle")
        logging.getLogger("edgerev.daemon").debug("hidden")
    finally:
        root.handlers[:], _ = saved[0], root.setLevel(saved[1])
    assert capsys.readouterr().err.splitlines() == ["<4>edgerev.daemon: disk almost full", "<6>edgerev.daemon: cycle"]


def _once_setup(tmp_path, schedule: str, images: range) -> str:
    """A config for ``daemon once`` (settled at once, ``schedule`` as given) and ``images`` in two classes."""
    from tests.daemon.conftest import image_bytes, write

    config = tmp_path / "d.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\ningest: {{settle_seconds: 0}}\nschedule: {schedule}\n")
    for i in images:
        write(tmp_path / "data" / "inbox" / f"c{i % 2}" / f"{i}.png", image_bytes(i))
    return str(config)


def test_once_says_why_no_job_runs_and_exits_1_when_its_job_failed(tmp_path, capsys, monkeypatch):
    from edgerev.errors import EdgerevError
    from edgerev_daemon.service import daemon as service
    from tests.daemon.conftest import image_bytes, write

    config = _once_setup(tmp_path, "{min_new_samples: 30, retry_seconds: 600}", range(10))
    assert main(["daemon", "once", "--config", str(config)]) == 0
    assert "no job due (10 new samples: 20 more (schedule.min_new_samples 30)" in capsys.readouterr().out

    def diverged(*args, **kwargs):
        raise EdgerevError("training diverged at step 3")

    monkeypatch.setattr(service, "run_job", diverged)
    for i in range(10, 40):
        write(tmp_path / "data" / "inbox" / f"c{i % 2}" / f"{i}.png", image_bytes(i))
    assert main(["daemon", "once", "--config", str(config)]) == 1
    out, err = capsys.readouterr()
    assert '"status": "failed"' in out
    assert err.splitlines()[-1] == "edgerev daemon once: error: training failed: training diverged at step 3"
    assert main(["daemon", "once", "--config", str(config)]) == 0  # the back-off, said as it is
    assert "no job due (job 1 failed; retried after schedule.retry_seconds, in" in capsys.readouterr().out
    assert main(["daemon", "status", "--config", str(config)]) == 0
    assert "next job: not yet: job 1 failed; retried after schedule.retry_seconds" in capsys.readouterr().out


def test_status_and_check_import_no_torch(tmp_path):
    """A monitoring loop calls status: it reads the store and imports no torch (nor does check)."""
    import subprocess
    import sys

    from tests.daemon.conftest import image_bytes, write

    config = tmp_path / "d.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\ningest: {{settle_seconds: 0}}\n"
                      "schedule: {min_new_samples: 1000}\n")
    for i in range(4):
        write(tmp_path / "data" / "inbox" / "a" / f"{i}.png", image_bytes(i))
    assert main(["daemon", "once", "--config", str(config)]) == 0
    code = ("import sys\nfrom edgerev.cli import main\n"
            f"assert main(['daemon', 'status', '--config', {str(config)!r}, '--json']) == 0\n"
            f"assert main(['daemon', 'check', '--config', {str(config)!r}]) == 0\n"
            "assert 'torch' not in sys.modules, 'torch imported'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert '"total": 4' in done.stdout and "consistent" in done.stdout


def test_once_stopped_by_sigterm_exits_143_and_status_says_the_job_was_interrupted(tmp_path, capsys, monkeypatch):
    """A SIGTERM during ``daemon once``'s job: the job stops at a step boundary, ``once`` exits 143 with one
    line (not 0, as if the cycle had finished), and status calls the job interrupted, not running."""
    import os
    import signal
    import time

    from edgerev_daemon.learning.jobs import JobOutcome
    from edgerev_daemon.service import daemon as service

    def stopped_at_a_step(config, store, blobs, job, start, base_batch, halt, report=None):
        os.kill(os.getpid(), signal.SIGTERM)  # the CLI's handler sets the flag the trainer reads between steps
        while not halt():  # the signals' thread (sigwait) takes it and sets the flag
            time.sleep(0.001)  # gives that thread the GIL: a loop that never releases it could starve it
        return JobOutcome("stopped", tmp_path / "run", "stopped at step 3 of 12")

    monkeypatch.setattr(service, "run_job", stopped_at_a_step)
    config = _once_setup(tmp_path, "{min_new_samples: 10}", range(12))
    assert main(["daemon", "once", "--config", str(config)]) == 143
    out, err = capsys.readouterr()
    assert '"status": "stopped"' in out
    assert err.splitlines()[-1] == ("edgerev daemon once: stopped by SIGTERM before the cycle ended; a job under "
                                    "way resumes from its checkpoint at the next start")  # after the log's lines
    assert main(["daemon", "status", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    assert "job: 1 interrupted (no daemon runs it; it resumes from its checkpoint at the next start)" in out, out
    assert "job: 1 running" not in out
    assert main(["daemon", "status", "--config", str(config), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["job"]["state"] == "running"  # the store's word, unchanged
    assert main(["daemon", "once", "--config", str(config), "--json"]) == 143  # the job stops again: same status
    assert json.loads(capsys.readouterr().out)["stopped"] is True


def test_once_says_when_ingest_stopped_at_the_storage_budget(tmp_path, capsys):
    from tests.daemon.conftest import write

    config = tmp_path / "d.yaml"
    config.write_text(f"data_dir: {tmp_path / 'data'}\ningest: {{settle_seconds: 0, batch_files: 8}}\n"
                      "schedule: {min_new_samples: 100000}\n"
                      "storage: {max_bytes: 400KiB, min_free_space: 0, max_quarantine_bytes: 64KiB}\n")
    noise = torch.Generator().manual_seed(0)
    for i in range(80):  # incompressible 32x32 images: about 3 KiB each as stored
        pixels = torch.randint(0, 256, (32, 32, 3), dtype=torch.uint8, generator=noise).numpy()
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        write(tmp_path / "data" / "inbox" / f"c{i % 2}" / f"{i}.png", buf.getvalue())
    assert main(["daemon", "once", "--config", str(config)]) == 0
    out = capsys.readouterr().out
    line = next((x for x in out.splitlines() if x.startswith("ingest stopped at the storage budget: ")), None)
    assert line is not None and "inbox files wait for the next cycle" in line, out
    waiting = int(line.split("storage.max_bytes (409600): ")[1].split()[0])
    assert waiting == len(list((tmp_path / "data" / "inbox").rglob("*.png"))) > 0


@pytest.fixture(scope="module")
def ingested_store(tmp_path_factory):
    """A data directory after a cycle that took 12 images, with its config (made once: each example copies it)."""
    from tests.daemon.storage.test_rebuild import _ingested

    return _ingested(tmp_path_factory.mktemp("ingested"), n=12)


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flips=st.lists(st.tuples(st.floats(0.0, 1.0), st.integers(1, 255)), min_size=1, max_size=3))
@example(flips=[(0.90625, 128)])  # a flipped byte in a sample's hash: a text value that is not UTF-8
@example(flips=[(0.98046875, 4)])  # one in a column's name in the schema: a query finds no such column
@example(flips=[(0.9803997537364131, 0x28)])  # a malformed schema: SQLite quotes its SQL, newlines too
def test_the_commands_that_read_the_store_say_a_damaged_one_in_one_line(ingested_store, tmp_path_factory, capsys,
                                                                         flips):
    """The store file with bytes flipped anywhere: ``status``, ``label`` and ``check`` answer, or say in one line
    what is wrong (the rebuild command where the store is damaged); never a traceback, and the data directory's
    samples and journal are left as they were. (400 examples passed once; each found a fault of its own before.)"""
    import shutil

    from edgerev_daemon.config import load_config

    config, path = ingested_store
    root = tmp_path_factory.mktemp("copy")
    shutil.copytree(config.layout.root, root / "data")
    text = path.read_text().replace(str(config.layout.root), str(root / "data"))
    copy = root / "daemon.yaml"
    copy.write_text(text)
    copied = load_config(copy)
    db = copied.layout.database
    for suffix in ("-wal", "-shm"):
        db.with_name(db.name + suffix).unlink(missing_ok=True)
    data = bytearray(db.read_bytes())
    for where, xor in flips:
        data[min(len(data) - 1, int(where * len(data)))] ^= xor
    db.write_bytes(bytes(data))
    journal = (copied.layout.root / "journal.jsonl").read_bytes()
    for command in (["status"], ["label"], ["check"], ["status", "--json"]):
        code = main(["daemon", *command, "--config", str(copy)])
        err = capsys.readouterr().err.strip()
        assert code in (0, 1, 2), (command, code, err)
        if code == 2:
            assert len(err.splitlines()) == 1 and err.startswith(f"edgerev daemon {command[0]}: error: "), err
            if "damaged" in err:
                assert "edgerev daemon rebuild --config" in err, err
    assert (copied.layout.root / "journal.jsonl").read_bytes() == journal
