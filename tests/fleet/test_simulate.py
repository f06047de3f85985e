"""``edgerev fleet simulate`` end to end: real daemons, real training jobs, Flower's apps over the in-process Grid.

Two small devices, two rounds, one device dropping out mid-round in the first: what the report says, and
what each device's store holds afterwards.
"""

import json

import pytest

pytest.importorskip("flwr")

from edgerev.cli import main  # noqa: E402
from edgerev_daemon.config import load_config  # noqa: E402
from edgerev_daemon.learning.fleet import CANDIDATE_PREFIX, JOB_PREFIX  # noqa: E402
from edgerev_daemon.storage.records import JobState  # noqa: E402
from edgerev_daemon.storage.store import Store  # noqa: E402

PRESET = """\
fleet: {rounds: 2, sharing: all, local_epochs: 1, arch: revnext, image_size: 16, min_devices: 2,
        model_args: {width: 4, blocks: [1, 1, 1, 1, 1]}}
data: {num_classes: 3, per_class: 16, test_per_class: 4}
local_epochs: 3
devices:
  - {name: d1, classes: [0, 1]}
  - {name: d2, classes: [1, 2]}
faults: {drop: {d2: [1]}}
daemon:
  training:
    train: {batch: 8, checkpoint_every: 1}
    memory: {budget: 24MiB, profile: estimate}
  promotion: {min_heldout_per_class: 1, exporter: legacy}  # the fast exporter: test_service.py's SMALL says why
  storage: {min_free_space: 0}
"""

REPORT = {"name", "accuracy_federated", "accuracy_local", "bytes_sent", "bytes_received", "peak_bytes", "cap_bytes",
          "accuracy_federated_own", "accuracy_local_own", "accuracy_in_service", "accuracy_in_service_own", "gate"}


@pytest.mark.slow
def test_simulate_reports_every_device_and_leaves_each_store_whole(tmp_path, capsys, identity):
    preset = tmp_path / "fleet.yaml"
    preset.write_text(PRESET)
    out = tmp_path / "run"
    assert main(["fleet", "simulate", "--config", str(preset), "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rounds"] == 2
    assert [d["name"] for d in report["devices"]] == ["d1", "d2"]
    assert json.loads((out / "fleet.json").read_text())["devices"] == report["devices"]
    for d in report["devices"]:
        assert REPORT <= set(d), d
        assert 0.0 <= d["accuracy_federated"] <= 1.0 and 0.0 <= d["accuracy_local"] <= 1.0
        # the own-classes part of the test set: a local-only model of two of three classes scores there, not on
        # the third class, so its accuracy on them is at least its accuracy on all (the test set is balanced)
        assert d["accuracy_local_own"] >= d["accuracy_local"]
        assert d["accuracy_in_service"] == d["per_round"][-1]["accuracy_in_service"]
        assert d["gate"] == d["per_round"][-1]["gate"]
        assert 0 < d["peak_bytes"] <= d["cap_bytes"] == 24 * 2**20, "the cap held on the device"
        assert d["bytes_sent"] > 0 and d["bytes_received"] > d["bytes_sent"]  # the weights come twice a round
        assert [r["round"] for r in d["per_round"]] == [1, 2]

        store = Store(load_config(out / d["name"] / "daemon.yaml").layout.database)
        try:
            jobs = sorted(store.jobs(), key=lambda j: j.id)
            rounds = [j for j in jobs if j.reason.startswith(JOB_PREFIX)]
            candidates = [j for j in jobs if j.reason.startswith(CANDIDATE_PREFIX)]
            assert all(j.state == JobState.DONE for j in candidates) and store.active_job() is None
            judged = [r["gate"] for r in d["per_round"]]
            if d["name"] == "d2":
                # its first round's reply was lost mid-round: the fleet model waited for that job (refused, and
                # said so), and the second round superseded it
                assert [j.state for j in rounds] == [JobState.FAILED, JobState.DONE]
                assert "superseded" in rounds[0].error
                assert len(candidates) == 1
                assert judged[0].startswith("not judged: job") and "under way" in judged[0], judged[0]
                assert judged[1].startswith("fleet model")
            else:
                assert [j.state for j in rounds] == [JobState.DONE, JobState.DONE] and len(candidates) == 2
                assert all(g.startswith("fleet model") for g in judged), judged
            for r in d["per_round"]:
                assert r["promoted"] == (r["in_service"] != "v0001"), "promoted means the fleet model serves"
            assert store.versions()[0].promoted, "the local model is in service before the fleet"
            assert d["in_service"] is not None
        finally:
            store.close()
