"""The read-only status page: routes, content types, the metrics format, loopback only, clean stop."""

from __future__ import annotations

import hashlib
import http.client
import json
import logging
import os
import re
import socket
import time
import urllib.error
import urllib.request
from dataclasses import replace
from pathlib import Path

import pytest

from edgerev.train.progress import Progress, write_progress
from edgerev_daemon import DaemonError, DataDirLock, EventKind, JobState, Store, prepare
from edgerev_daemon.config import DaemonConfig, HttpConfig
from edgerev_daemon.learning.jobs import set_running
from edgerev_daemon.service.http import METRICS_CONTENT_TYPE, StatusServer, escape_label_value, format_metrics
from edgerev_daemon.service.status import format_status, status
from edgerev_daemon.storage.records import NewSample

from ..conftest import Clock, make_config

SAMPLE_LINE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(?:[a-zA-Z_][a-zA-Z0-9_]*="(?:[^"\\\n]|\\.)*",?)*\})? (\S+)$')


def sha(i: int) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def http_config(config: DaemonConfig, host: str = "127.0.0.1", port: int = 0) -> DaemonConfig:
    """``config`` with an http section built past validation (port 0, or a host validation refuses)."""
    section = object.__new__(HttpConfig)
    for key, value in {"enabled": True, "host": host, "port": port}.items():
        object.__setattr__(section, key, value)
    return replace(config, http=section)


def populate(config: DaemonConfig) -> None:
    """A store with samples of three labels (one named like markup), two versions (the second in
    service, with a held-out accuracy), a failed job and a quarantine event."""
    prepare(config.layout, config.inbox_path)
    with Store(config.layout.database, clock=Clock(1000.0)) as store:
        samples = [NewSample(sha(i), label, 32, 32, sha(-i - 1), f"{label}/{i}.png")
                   for i, label in enumerate(["cat"] * 6 + ["dog"] * 3 + ["<script>x</script>"])]
        store.record_batch(samples, [(EventKind.QUARANTINE, {"source": "bad.png", "reason": "not an image"})],
                           heldout_fraction=0.3)
        job = store.create_job("test")
        store.set_job_state(job.id, JobState.FAILED, error="out of memory")
        store.add_version(reason="first", promoted=False)
        v2 = store.add_version(metrics={"evaluation": {"candidate": {"all": 0.875, "recent": 0.75},
                                                      "heldout_samples": {"all": 8, "recent": 4},
                                                      "recent_window_days": 30.0}}, reason="better")
        store.update_version(v2.id, promoted=True)
    (config.layout.root / "versions" / "v0002").mkdir(parents=True)
    (config.layout.root / "current").symlink_to("versions/v0002")
    (config.layout.quarantine / "bad.png").write_bytes(b"x")
    (config.layout.quarantine / "bad.png.reason.json").write_text("{}")


@pytest.fixture
def config(tmp_path) -> DaemonConfig:
    cfg = http_config(make_config(tmp_path))
    populate(cfg)
    return cfg


@pytest.fixture
def server(config):
    with StatusServer(config, poll_interval=0.02, clock=Clock(2000.0)) as s:
        yield s


def get(server: StatusServer, path: str, method: str = "GET", data: bytes | None = None, headers: dict | None = None):
    """``(status, headers, body)`` of one request (error statuses included)."""
    req = urllib.request.Request(server.url.rstrip("/") + path, data=data, method=method, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status, r.headers, r.read()
    except urllib.error.HTTPError as e:
        with e:
            return e.code, e.headers, e.read()


def parse_metrics(text: str) -> dict[str, dict]:
    """``{name: {"help", "type", "samples": {labels: value}}}``; asserts the exposition format line by line."""
    families: dict[str, dict] = {}
    assert text.endswith("\n")
    for line in text.splitlines():
        if line.startswith("# HELP ") or line.startswith("# TYPE "):
            _, what, name, rest = line.split(" ", 3)
            families.setdefault(name, {"samples": {}})[what.lower()] = rest
            continue
        assert not line.startswith("#") and line.strip() == line and line, line
        m = SAMPLE_LINE.match(line)
        assert m, f"not a sample line: {line!r}"
        name, labels, value = m.groups()
        float(value)
        assert name in families, f"{name} has no HELP/TYPE before its samples"
        families[name]["samples"][labels or ""] = float(value)
    for name, fam in families.items():
        assert fam.get("help") and fam.get("type") in ("gauge", "counter"), name
        assert fam["samples"], name
    return families


def test_metrics(server):
    status, headers, body = get(server, "/metrics")
    assert status == 200 and headers["Content-Type"] == METRICS_CONTENT_TYPE
    m = parse_metrics(body.decode())
    samples = m["edgerev_samples_total"]["samples"]
    assert sum(samples.values()) == 10 and set(samples) == {'{split="train"}', '{split="heldout"}'}
    assert m["edgerev_labels"]["samples"][""] == 3
    assert m["edgerev_new_samples_since_last_job"]["samples"][""] == 10
    assert m["edgerev_quarantined_files"]["samples"][""] == 1
    assert m["edgerev_versions"]["samples"] == {'{promoted="true"}': 1, '{promoted="false"}': 1}
    assert m["edgerev_current_version"]["samples"][""] == 2
    assert m["edgerev_current_heldout_accuracy"]["samples"][""] == 0.875
    assert m["edgerev_current_recent_heldout_accuracy"]["samples"][""] == 0.75
    assert m["edgerev_jobs_failed_total"]["samples"][""] == 1
    assert m["edgerev_daemon_up"]["samples"][""] == 0
    assert m["edgerev_store_rows"]["samples"]['{table="versions"}'] == 2
    assert m["edgerev_samples_total"]["type"] == "counter" and m["edgerev_labels"]["type"] == "gauge"


def test_metrics_of_a_running_daemon_and_of_an_empty_store(tmp_path):
    cfg = http_config(make_config(tmp_path))
    prepare(cfg.layout, cfg.inbox_path)
    Store(cfg.layout.database).close()
    with DataDirLock(cfg.data_dir), StatusServer(cfg, poll_interval=0.02) as server:
        m = parse_metrics(get(server, "/metrics")[2].decode())
    assert m["edgerev_daemon_up"]["samples"][""] == 1
    assert m["edgerev_current_version"]["samples"][""] == 0
    assert "edgerev_current_heldout_accuracy" not in m  # unknown: left out, not 0
    assert "edgerev_current_recent_heldout_accuracy" not in m


def test_label_values_are_escaped():
    assert escape_label_value('a\\b"c\nd') == 'a\\\\b\\"c\\nd'
    s = {"daemon_pid": None, "samples": {"train": 1, "heldout": 0}, "labels": [], "new_samples_since_last_job": 0,
         "quarantined_files": 0, "versions": [], "current": None, "job": None, "jobs_failed": 0,
         "counts": {'we"ird\ntable': 3}}
    parse_metrics(format_metrics(s))
    assert 'edgerev_store_rows{table="we\\"ird\\ntable"} 3' in format_metrics(s)


def test_html_page_escapes_the_status(server):
    status, headers, body = get(server, "/")
    text = body.decode()
    assert status == 200 and headers["Content-Type"] == "text/html; charset=utf-8"
    assert "v0002" in text and "out of memory" in text
    # the recent window's figure beside the all-time one
    assert ("<td>all held-out samples</td><td><span class=\"big\">87.5 %</span></td><td><span class=\"num\">8</span>"
            "</td></tr><tr><td>the recent window (the 30 days before each class&#x27;s newest sample)</td>"
            "<td><span class=\"big\">75.0 %</span></td><td><span class=\"num\">4</span></td>") in text
    assert "<dt>labels</dt><dd>cat, dog, &lt;script&gt;x&lt;/script&gt;</dd>" in text and "<script>" not in text
    assert "&lt;script&gt;x&lt;/script&gt; (0): too few training samples yet</dd>" in text  # held back


def test_status_json(server, config):
    status, headers, body = get(server, "/status.json")
    assert status == 200 and headers["Content-Type"] == "application/json"
    s = json.loads(body)
    assert s["data_dir"] == config.data_dir and s["current"]["version"] == "v0002"
    assert (s["current"]["heldout_accuracy"], s["current"]["recent_heldout_accuracy"]) == (0.875, 0.75)
    assert s["current"]["heldout_samples"] == {"all": 8, "recent": 4} and s["current"]["recent_window_days"] == 30
    assert s["samples"]["total"] == 10 and len(s["events"]) > 0


def test_healthz_and_head(server):
    assert get(server, "/healthz")[::2] == (200, b"ok\n")
    status, headers, body = get(server, "/metrics", method="HEAD")
    assert status == 200 and body == b"" and int(headers["Content-Length"]) > 0


def test_other_methods_and_paths_are_refused_and_change_nothing(server, config):
    before = json.loads(get(server, "/status.json")[2])
    for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "BREW"):
        status, headers, _ = get(server, "/status.json", method=method, data=b"{}" if method != "OPTIONS" else None)
        assert (status, headers["Allow"]) == (405, "GET, HEAD"), method
    assert get(server, "/nope")[0] == 404
    assert get(server, "/metrics/../status.json")[0] == 404
    assert json.loads(get(server, "/status.json")[2]) == before


def test_foreign_host_header_is_refused(server):
    assert get(server, "/metrics", headers={"Host": "attacker.example"})[0] == 403
    assert get(server, "/metrics", headers={"Host": f"localhost:{server.port}"})[0] == 200


def test_store_errors_answer_503_in_one_line(tmp_path):
    cfg = http_config(make_config(tmp_path))
    with StatusServer(cfg, poll_interval=0.02) as server:
        status, _, body = get(server, "/metrics")  # no store yet
        assert status == 503 and body.count(b"\n") == 1 and b"no store yet" in body
        prepare(cfg.layout, cfg.inbox_path)
        cfg.layout.database.write_bytes(b"not a database" * 100)
        status, _, body = get(server, "/status.json")
        assert status == 503 and body.count(b"\n") == 1 and b"Traceback" not in body
        assert get(server, "/healthz")[0] == 200


def open_store_files() -> int:
    fds = Path("/proc/self/fd")
    return sum(1 for fd in fds.iterdir() if "store.sqlite" in os.path.realpath(fd)) if fds.is_dir() else 0


@pytest.mark.skipif(not Path("/proc/self/fd").is_dir(), reason="needs /proc")
def test_each_request_closes_its_store(server):
    before = open_store_files()
    for path in ("/", "/status.json", "/metrics") * 3:
        assert get(server, path)[0] == 200
    assert open_store_files() == before == 0


def test_bound_to_loopback_and_port_closed_after_stop(config):
    server = StatusServer(config, poll_interval=0.02).start()
    host, port = server.server_address
    assert host == "127.0.0.1" and port == server.port > 0
    server.stop()
    server.stop()  # a second stop is a no-op
    with pytest.raises(ConnectionRefusedError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def test_localhost_resolves_to_loopback(config):
    with StatusServer(http_config(config, host="localhost"), poll_interval=0.02) as server:
        assert server.server_address[0] in ("127.0.0.1", "::1")
        assert get(server, "/healthz")[0] == 200


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "192.0.2.1", "10.0.0.1", "example.com", "127.0.0.1.nip.io"])
def test_non_loopback_host_is_refused_even_past_validation(config, host):
    with pytest.raises(DaemonError, match="loopback"):
        StatusServer(http_config(config, host=host)).start()


def test_port_in_use_and_double_start_are_errors(server, config):
    with pytest.raises(DaemonError, match="cannot listen"):
        StatusServer(http_config(config, port=server.port)).start()
    with pytest.raises(DaemonError, match="already running"):
        server.start()


def test_log_messages_go_to_the_debug_logger(server, caplog):
    with caplog.at_level("DEBUG", logger="edgerev.daemon.http"):
        get(server, "/healthz")
    assert any(r.name == "edgerev.daemon.http" and r.levelname == "DEBUG" and "/healthz" in r.getMessage()
               for r in caplog.records)


def test_http_client_sees_a_read_only_reply_to_post_with_body(server):
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=5)
    try:
        conn.request("POST", "/metrics", body=b"x" * 50_000)
        r = conn.getresponse()
        assert r.status == 405
    except ConnectionResetError:
        pytest.fail("the 405 was lost to a connection reset")
    finally:
        conn.close()


def test_the_page_shows_each_version_once_events_readable_in_local_time(server):
    text = get(server, "/")[2].decode()
    rows = re.findall(r"<tr><td>(v\d{4})</td>", text)
    assert rows == ["v0002", "v0001"]  # the table, newest first; the summary above it lists none
    assert re.findall(r"<tr><td>v\d{4}</td><td><span[^>]*>[^<]*</span></td><td><span[^>]*>([^<]*)</span>", text) == [
        "in service", "not promoted"]
    assert time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(1000.0)) in text  # the events' stored time, local
    assert "quarantined bad.png: not an image" in text and "&quot;reason&quot;" not in text
    assert "<td>1000.0</td>" not in text


def test_each_version_on_disk_shows_its_curves(server, config):
    png = b"\x89PNG\r\n\x1a\nplot"
    (config.layout.root / "versions" / "v0002" / "curves.png").write_bytes(png)
    text = get(server, "/")[2].decode()
    assert '<img src="/versions/v0002/curves.png" alt="training curves of v0002">' in text  # shown in the page
    assert '<a href="/versions/v0002/curves.png">curves</a></td>' in text  # and linked from its version's row
    assert "classes.png" not in text and "/versions/v0001/" not in text  # no such file; v0001 has no folder
    status, headers, body = get(server, "/versions/v0002/curves.png")
    assert (status, headers["Content-Type"], body) == (200, "image/png", png)
    (config.layout.root / "versions" / "v0002" / "classes.png").write_bytes(png + b"2")
    assert '<img src="/versions/v0002/classes.png" alt="accuracy per class of v0002">' in get(server, "/")[2].decode()
    assert get(server, "/versions/v0002/classes.png")[2] == png + b"2"
    for path in ("/versions/v0001/curves.png", "/versions/../versions/v0002/curves.png",
                 "/versions/v0002/model.json", "/versions/x/curves.png", "/versions/v0002%2Fcurves.png"):
        assert get(server, path)[0] == 404, path


def test_a_linked_curves_file_is_not_followed(server, config, tmp_path):
    secret = tmp_path / "secret.png"
    secret.write_bytes(b"outside")
    (config.layout.root / "versions" / "v0002" / "curves.png").symlink_to(secret)
    assert get(server, "/versions/v0002/curves.png")[0] == 404


def test_a_running_job_shows_its_step_epoch_loss_and_eta(tmp_path):
    cfg = http_config(make_config(tmp_path))
    populate(cfg)
    with Store(cfg.layout.database, clock=Clock(2000.0)) as store:
        job = store.create_job("20 new samples")
        set_running(store, cfg, job)
    run_dir = cfg.layout.job_dir(job.id)
    run_dir.mkdir(parents=True)
    s = status(cfg)
    assert s["job"]["state"] == "running" and s["job"]["progress"] is None  # no report yet
    report = Progress("running", 150, 1000, 3, 20, 0.812, 0.21, 4.1, 207.3, 0.712, 0.93, 0.72, 2, 2500.0)
    write_progress(run_dir, report)
    s = status(cfg)
    assert s["job"]["progress"] == report.to_json()
    assert f"job: {job.id} running (20 new samples)\n  {report.line()}" in format_status(s | {"daemon_pid": 4242})
    assert f"job: {job.id} interrupted (no daemon runs it; " in format_status(s)  # the store's 'running', no daemon
    assert f"next job: job {job.id} resumes from its checkpoint at the next start" in format_status(s)
    assert f"next job: job {job.id} runs now" in format_status(s | {"daemon_pid": 4242})
    m = parse_metrics(format_metrics(s))
    assert {name: m[name]["samples"][""] for name in ("edgerev_job_step", "edgerev_job_total_steps",
                                                      "edgerev_job_epoch", "edgerev_job_loss",
                                                      "edgerev_job_eta_seconds")} == {
        "edgerev_job_step": 150, "edgerev_job_total_steps": 1000, "edgerev_job_epoch": 3,
        "edgerev_job_loss": 0.812, "edgerev_job_eta_seconds": 207.3}
    # the data directory moved elsewhere (a new disk): the job's progress is read where the folder now is
    moved = replace(cfg, data_dir=str(tmp_path / "moved"))
    cfg.layout.root.rename(moved.layout.root)
    assert status(moved)["job"]["progress"] == report.to_json()
    with Store(moved.layout.database) as store:
        assert store.get_job(job.id).checkpoint_dir == f"jobs/job-{job.id:05d}"  # relative to the data directory
        store.set_job_state(job.id, JobState.DONE)
    s = status(moved)
    assert s["job"]["progress"] is None and "edgerev_job_step" not in parse_metrics(format_metrics(s))
    assert f"last job: {job.id} done" in format_status(s)


def test_the_start_up_line_is_logged_once(config, caplog):
    from types import SimpleNamespace

    from edgerev_daemon.service.cli import _http

    with caplog.at_level(logging.INFO):
        wakeup = SimpleNamespace(notify=lambda: None)  # the daemon's: an answer from the page wakes its loop
        server = _http(SimpleNamespace(config=config, requests=SimpleNamespace(wakeup=wakeup)))
        try:
            lines = [m for m in caplog.messages if "status page on" in m]
            assert lines == [f"status page on {server.url}"]
        finally:
            server.stop()


def test_a_version_judged_before_recent_windows_shows_its_all_time_figure_alone():
    from edgerev_daemon.service.status import accuracy_text

    assert accuracy_text({"heldout_accuracy": 0.9, "recent_heldout_accuracy": None}) == ", held-out accuracy 0.9000"
    assert accuracy_text({"heldout_accuracy": None}) == ""
    assert accuracy_text({"heldout_accuracy": 0.9, "recent_heldout_accuracy": 0.95, "recent_window_days": None,
                          "heldout_samples": {"all": 40, "recent": 40}}) == (
        ", held-out accuracy 0.9000 on all 40, 0.9500 on the recent 40 (all samples)")
