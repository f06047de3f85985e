"""Fleet requests handed to a running daemon through its data directory (edgerev_daemon.learning.handoff).

The daemon here is "running": this process holds its data directory (the lock), so a ClientApp's link
cannot open it and writes its request instead; the daemon's next cycle carries it out and answers.
"""

import os

import pytest
import torch
import yaml

pytest.importorskip("flwr")

from edgerev.fleet.model import FleetError, FleetModel  # noqa: E402
from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from edgerev_daemon.learning.fleet import label_counts  # noqa: E402
from edgerev_daemon.learning.handoff import requests_dir, serve_requests, submit, wait_result  # noqa: E402
from edgerev_daemon.service.fleet import DataDirLink  # noqa: E402

ARGS = {"width": 8, "blocks": [1, 1, 1, 1, 1]}
SETTINGS = FleetSettings(rounds=1, sharing="head+last", arch="revnext", model_args=ARGS, image_size=16)


@pytest.fixture
def running(tmp_path):
    from edgerev_daemon.config import load_config
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.demo import write_images

    path = tmp_path / "daemon.yaml"
    path.write_text(yaml.safe_dump({
        "data_dir": str(tmp_path / "dev"), "image_size": 16, "heldout_fraction": 0.25,
        "ingest": {"settle_seconds": 0}, "schedule": {"min_new_samples": 100000}, "storage": {"min_free_space": 0},
        "promotion": {"forgetting_margin": 1.0, "min_heldout_per_class": 1, "refuse_class_at_zero": False,
                      "exporter": "legacy"},  # the fast exporter: tests/daemon/service/test_service.py SMALL
        "training": {"model": {"arch": "revnext", "args": ARGS}, "train": {"batch": 16}}}))
    config = load_config(path)
    write_images(config.inbox_path, 16, [0, 1], size=16)
    with Daemon(config, config_path=path) as daemon:
        daemon.cycle(0.0)  # ingest only
        yield path, daemon


def _fleet_model(classes=("class0", "class1", "class2")):
    shared = {k: torch.from_numpy(v.numpy().copy()) for k, v in initial_arrays(SETTINGS, classes).items()}
    return FleetModel("7/1", "revnext", ARGS, 16, classes, shared, "head+last", False, 0, 1)


def test_a_link_to_a_running_daemon_hands_its_request_over_and_gives_up_when_unanswered(running):
    path, daemon = running
    with pytest.raises(FleetError, match="did not answer"):
        DataDirLink(str(path), timeout=0.0).classes()
    # the unanswered request is withdrawn: the daemon's next cycle does not run it for nobody
    assert not any(requests_dir(daemon.config.layout.root).iterdir())


@pytest.mark.slow
def test_the_daemons_cycle_answers_a_round_and_a_candidate(running):
    _, daemon = running
    root = daemon.config.layout.root
    rid = submit(root, "classes")
    assert daemon.cycle(0.0).fleet == 1
    counts = wait_result(root, rid, 0.0)
    assert set(counts) == {"class0", "class1"} and counts == label_counts(daemon)

    fm = _fleet_model()
    rid = submit(root, "round", fm)
    assert daemon.cycle(0.0).fleet == 1
    result = wait_result(root, rid, 0.0)
    assert set(result.shared) == set(fm.shared) and result.counts == [counts["class0"], counts["class1"], 0]
    assert [j.reason for j in daemon.store.jobs()] == ["fleet round 7/1"]

    rid = submit(root, "model", fm)
    serve_requests(daemon)
    c = wait_result(root, rid, 0.0)
    assert c.promoted and daemon.registry.current() == c.version
    assert not any(requests_dir(root).iterdir())  # requests and results are gone once read


def test_a_bad_request_is_refused_and_answered(running):
    _, daemon = running
    root = daemon.config.layout.root
    fm = _fleet_model()
    fm.shared["head.weight"] = fm.shared["head.weight"][:, :5]
    rid = submit(root, "round", fm)
    daemon.cycle(0.0)
    with pytest.raises(FleetError, match="has shape"):
        wait_result(root, rid, 0.0)
    assert daemon.store.jobs() == []


def test_a_link_in_the_requests_folder_is_not_followed(running, tmp_path):
    _, daemon = running
    root = daemon.config.layout.root
    elsewhere = tmp_path / "elsewhere"
    rid = submit(elsewhere, "classes")
    requests_dir(root).mkdir(parents=True, exist_ok=True)
    (requests_dir(root) / f"{rid}.request").symlink_to(requests_dir(elsewhere) / f"{rid}.request")
    assert daemon.cycle(0.0).fleet == 0
    assert not (requests_dir(root) / f"{rid}.result").exists()


def test_requests_results_and_the_local_copy_are_fsynced_before_and_after_their_renames(running, monkeypatch):
    """A power cut leaves no folder or a whole one: every file and folder is synced before its rename, the
    parent after it (recorded by path; a file is synced under its temporary folder's name)."""
    _, daemon = running
    root = daemon.config.layout.root
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))

    def whole(tmp):  # both files synced (each under its own temporary name, renamed after), then the folders
        files = [next((i for i, p in enumerate(synced) if p.startswith(f"{tmp}/.{name}.tmp-")), None)
                 for name in ("meta.json", "shared.safetensors")]
        folders = [i for i, p in enumerate(synced) if p == str(tmp)]
        return None not in files and folders and max(folders) > max(files) and str(tmp.parent) in synced

    rid = submit(root, "round", _fleet_model())
    folder = requests_dir(root)
    assert whole(folder / f".{rid}.request.tmp")
    synced.clear()
    assert daemon.cycle(0.0).fleet == 1
    assert whole(folder / f".{rid}.result.tmp")
    local = root / "fleet" / "local"
    files = [p.relative_to(local) for p in local.rglob("*") if p.is_file()]
    assert files and {str(local.with_name("local.new") / f) for f in files} <= set(synced)
    assert str(local.parent) in synced[synced.index(str(local.with_name("local.new"))):]  # the rename, after
    wait_result(root, rid, 0.0)


def test_the_previous_local_copy_is_read_between_the_two_renames(running):
    from edgerev_daemon.learning.fleet import local_state

    _, daemon = running
    root = daemon.config.layout.root
    submit(root, "round", _fleet_model())
    daemon.cycle(0.0)
    before = local_state(root)
    local = root / "fleet" / "local"
    local.rename(local.with_name("local.old"))  # stopped after the first rename, before the second
    after = local_state(root)
    assert after is not None and after[1] == before[1]
    assert all(torch.equal(after[0][k], v) for k, v in before[0].items())


def test_an_answer_that_cannot_be_read_is_one_fleet_error(running):
    _, daemon = running
    root = daemon.config.layout.root
    rid = submit(root, "classes")
    daemon.cycle(0.0)
    (requests_dir(root) / f"{rid}.result" / "meta.json").write_text('{"kind": "cla')  # torn
    with pytest.raises(FleetError, match=f"answer to request {rid} could not be read"):
        wait_result(root, rid, 0.0)
    assert not (requests_dir(root) / f"{rid}.result").exists()
