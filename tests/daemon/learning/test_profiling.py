"""A model's first job under a memory budget measures its stage profile in a child process first (minutes on
a small CPU): the daemon says so before it starts, so the wait is not a silent one. The child itself, and a
stop during it, are tested in service/test_stop.py."""

from __future__ import annotations

import logging

from edgerev_daemon.learning import children, profiling
from tests.daemon.service.test_service import SMALL, make_config


def test_the_measurement_is_announced_before_it_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))  # nothing measured yet
    config, _ = make_config(tmp_path, training={**SMALL["training"], "memory": {"budget": "64MiB"}})
    said = []

    def run(command, log, stop, phase):
        said.extend(r.getMessage() for r in caplog.records)  # what was logged before the child started
        assert phase == "the stage profile's measurement" and log.parent == tmp_path / "job"
        return 0

    monkeypatch.setattr(children, "run", run)
    with caplog.at_level(logging.INFO, logger="edgerev.daemon.profiling"):
        assert profiling.ensure_profile(config, tmp_path / "job", lambda: False)
    assert len(said) == 1 and said[0].startswith("measuring the stage profile of revnext on the cpu (measured) "
                                                 "before the job trains: once per model"), said
    assert "minutes on a small CPU" in said[0]
