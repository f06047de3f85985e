"""A real deployment on loopback: ``flower-superlink``, two ``flower-supernode`` processes (``--insecure``),
the fleet submitted with ``flwr run deploy/fleet-app``; each device's daemon promotes the fleet model. The
updates are summed by secure aggregation (SecAgg+: four more messages to each device, whose ClientApp keeps the
update in its context between them, as the SuperNode carries it), the deployment's longest path. The same
deployment averaging in clear is not run a second time here (a minute and a half of a suite's worker): the
processes, the link to a stopped and to a running daemon and the promotion are this test's; the clear average
through the same ServerApp and ClientApp, messages serialized as on the wire, is
tests/fleet/test_simulate.py's (real daemons, two rounds) and tests/fleet/test_secagg.py's (clear against secure).

Each SuperNode names its device's daemon config in its node config; every message starts a
``flwr-clientapp`` process. Device 1's daemon is not running: the ClientApp opens its data directory, runs
the request as a daemon job and closes it. Device 2's daemon is running (``edgerev daemon run``): the
ClientApp hands the request over through the data directory and the daemon's loop carries it out.
Nothing waits on a clock: each step waits for a line in a process's output (or for ``flwr log`` to end
with the run), bounded by one deadline for the whole test.
"""

import json
import os
import queue
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("flwr")

pytestmark = pytest.mark.slow

APP = Path(__file__).resolve().parents[2] / "deploy" / "fleet-app"
DEADLINE = 900.0  # seconds for the whole test; each client request starts a process that imports torch
BIN = Path(sys.executable).parent


class Process:
    """A child process whose output lines are read by a thread and can be waited for."""

    def __init__(self, args: list[str], env: dict, log: Path) -> None:
        self.log = log.open("w")
        self.lines: queue.Queue[str | None] = queue.Queue()
        # its own process group: a SuperNode starts a SuperExec and ClientApp processes, stopped with it
        self.proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.log.write(line)
            self.log.flush()
            self.lines.put(line)
        self.lines.put(None)

    def wait_for(self, pattern: str, deadline: float) -> str:
        """The first line from now on matching ``pattern``; fails at the deadline or when the process ends."""
        rx = re.compile(pattern)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no line matching {pattern!r} before the deadline (see {self.log.name})")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"the process ended before a line matching {pattern!r} (see {self.log.name})")
            if rx.search(line):
                return line

    def stop(self) -> None:
        if self.log.closed:
            return
        for sig in (signal.SIGTERM, signal.SIGKILL):
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                break
            try:
                self.proc.wait(timeout=30)
                break
            except subprocess.TimeoutExpired:
                continue
        self.log.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(root: Path, name: str, classes: list[int], start: int) -> Path:
    import yaml

    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.demo import write_images

    d = root / name
    d.mkdir(parents=True)
    cfg = {"data_dir": str(d), "image_size": 16, "heldout_fraction": 0.25, "ingest": {"settle_seconds": 0},
           "schedule": {"min_new_samples": 100000}, "storage": {"min_free_space": 0},
           "promotion": {"forgetting_margin": 1.0, "min_heldout_per_class": 1, "refuse_class_at_zero": False,
                         "exporter": "legacy"},  # the fast exporter: tests/daemon/service/test_service.py SMALL
           "training": {"model": {"arch": "revnext", "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}},
                        "train": {"batch": 16}}}
    path = d / "daemon.yaml"
    path.write_text(yaml.safe_dump(cfg))
    config = load_config(path)
    write_images(config.inbox_path, 8 * len(classes), classes, seed=0, start=start, num_classes=3, size=16)
    with Daemon(config) as daemon:
        daemon.cycle(0.0)  # ingest only: no job of its own is due
        assert len(daemon.store.samples()) == 8 * len(classes)
    return path


@pytest.mark.longest  # a minute and a half: first, beside the rest (tests/conftest.py)
@pytest.mark.skipif(shutil.which("flower-superlink", path=str(BIN)) is None, reason="Flower's commands not installed")
def test_superlink_two_supernodes_and_flwr_run_promote_the_fleet_model_under_secagg(tmp_path):
    deadline = time.monotonic() + DEADLINE
    configs = [_device(tmp_path / "devices", "d1", [0, 1], 0), _device(tmp_path / "devices", "d2", [1, 2], 5000)]
    home = tmp_path / "flwr"
    home.mkdir()
    link_port = _free_port()
    (home / "config.toml").write_text(f'[superlink]\ndefault = "local"\n\n[superlink.local]\n'
                                      f'address = "127.0.0.1:{link_port}"\ninsecure = true\n')
    env = {**os.environ, "FLWR_HOME": str(home), "EDGEREV_CACHE": str(tmp_path / "cache"),
           "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1"}
    procs: list[Process] = []
    started = time.monotonic()
    try:
        link = Process([str(BIN / "flower-superlink"), "--insecure", "--disable-runtime-dependency-installation",
                        "--port", str(link_port), "--database", str(tmp_path / "link.db")], env,
                       tmp_path / "superlink.log")
        procs.append(link)
        link.wait_for(r"Uvicorn running on", deadline)
        nodes = []
        for i, cfg in enumerate(configs):
            node = Process([str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{link_port}",
                            "--port", str(_free_port()), "--node-config", f'daemon-config="{cfg}"'], env,
                           tmp_path / f"supernode{i + 1}.log")
            procs.append(node)
            nodes.append(node)
        daemon = Process([str(BIN / "edgerev"), "daemon", "run", "--config", str(configs[1]), "--poll", "1"], env,
                         tmp_path / "daemon2.log")
        procs.append(daemon)
        daemon.wait_for(r"serving ", deadline)
        for node in nodes:
            node.wait_for(r"SuperNode ID", deadline)
        run = subprocess.run([str(BIN / "flwr"), "run", str(APP), "local", "--format", "json", "--run-config",
                              "rounds=1 image-size=16 min-devices=2 local-epochs=1 timeout=600.0 secagg=true"],
                             env=env, capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        assert run.returncode == 0, run.stdout + run.stderr
        run_id = json.loads(run.stdout[run.stdout.index("{"):])["run-id"]
        # `flwr log` streams the run's log and returns when the run has ended
        log = subprocess.run([str(BIN / "flwr"), "log", str(run_id), "local", "--stream"], env=env,
                             capture_output=True, text=True, timeout=max(1.0, deadline - time.monotonic()))
        (tmp_path / "run.log").write_text(log.stdout + log.stderr)
        # the round averaged both devices' updates: the SecAgg+ protocol finished with both vectors
        assert re.search(r"Aggregated MetricRecord: \{'num-examples': \d+, 'devices': 2\}", log.stdout), log.stdout
        listed = subprocess.run([str(BIN / "flwr"), "ls", "local", "--format", "json"], env=env, capture_output=True,
                                text=True, timeout=60)
        (run_info,) = [r for r in json.loads(listed.stdout)["runs"] if str(r["run-id"]) == str(run_id)]
        assert run_info["status"].startswith("finished"), run_info
        assert "completed" in run_info["status"] or "N/A" in run_info.get("status-details", ""), run_info
        daemon.stop()  # SIGTERM: the daemon stops and lets go of its data directory
        assert daemon.proc.returncode == 0
        served = (tmp_path / "daemon2.log").read_text()
        assert f"fleet round {run_id}/1" in served and f"fleet model {run_id}/1" in served, served[-2000:]
    finally:
        for p in reversed(procs):
            p.stop()
    seconds = time.monotonic() - started
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon

    for cfg in configs:
        with Daemon(load_config(cfg)) as daemon:
            versions = daemon.store.versions()
            rounds = [v.metrics.get("fleet_round") for v in versions]
            assert rounds and all(r and r.endswith("/1") for r in rounds), rounds
            current = daemon.registry.current()
            assert current is not None, [v.reason for v in versions]
            v = daemon.store.get_version(current)
            assert v.metrics["fleet_round"] == f"{run_id}/1" and v.promoted, v.reason
            assert v.metrics["classes"] == ["class0", "class1", "class2"]
            assert (daemon.registry.path(current) / "model.onnx").is_file()
    print(f"deployment with SecAgg+: 1 round, 2 devices in {seconds:.0f} s")
