"""A model's first job under a memory budget measures its stage profile in a child process first (minutes on
a small CPU): the daemon says so before it starts, so the wait is not a silent one. The child itself, and a
stop during it, are tested in service/test_stop.py."""

from __future__ import annotations

import json
import logging
import sys

from edgerev_daemon.learning import children, profiling
from tests.daemon.service.test_service import SMALL, make_config


def test_the_measurement_is_announced_before_it_runs(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))  # nothing measured yet
    config, _ = make_config(tmp_path, training={**SMALL["training"], "memory": {"budget": "64MiB"}})
    said = []

    def run(command, log, stop, phase, lines):
        said.extend(r.getMessage() for r in caplog.records)  # what was logged before the child started
        assert phase == "the stage profile's measurement" and log.parent == tmp_path / "job"
        lines(f"{profiling.PROGRESS}measuring stage 1/3")  # the child's progress is logged as it comes
        lines("Traceback (most recent call last):")  # anything else stays in the child's log file
        return 0

    monkeypatch.setattr(children, "run", run)
    with caplog.at_level(logging.INFO, logger="edgerev.daemon.profiling"):
        assert profiling.ensure_profile(config, tmp_path / "job", lambda: False)
    assert len(said) == 1 and said[0].startswith("measuring the stage profile of revnext on the cpu (measured) "
                                                 "before the job trains: once per model"), said
    assert "each stage is logged as it begins" in said[0]
    after = [r.getMessage() for r in caplog.records][1:]
    assert after == ["stage profile: measuring stage 1/3"], after


def test_a_childs_lines_are_passed_on_as_they_come_and_kept_in_its_log(tmp_path):
    script = ("import sys\n"
              "for i in range(3):\n"
              "    print(f'progress: stage {i + 1}/3', file=sys.stderr, flush=True)\n"
              "sys.stderr.write('a last line without its end')\n")
    got = []
    code = children.run([sys.executable, "-c", script], tmp_path / "child.log", lambda: False, "a child",
                        lines=got.append)
    assert code == 0
    assert got == ["progress: stage 1/3", "progress: stage 2/3", "progress: stage 3/3"]  # whole lines only
    assert (tmp_path / "child.log").read_text().endswith("a last line without its end")


def test_the_child_names_each_stage_it_measures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("EDGEREV_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(children, "end_with_parent", lambda: None)  # no daemon on the other end of stdin here
    spec = {"arch": "revnet", "weights": None, "args": {"width": 8, "blocks": [1, 1]}, "size": 16, "device": "cpu",
            "estimate": True, "threads": 1}
    assert profiling.main([json.dumps(spec)]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith(profiling.PROGRESS)]
    assert err and err[0] == f"{profiling.PROGRESS}estimating stage 1/{len(err)}"
    assert err[-1] == f"{profiling.PROGRESS}estimating stage {len(err)}/{len(err)}"
