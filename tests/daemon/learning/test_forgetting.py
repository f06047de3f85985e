"""The forgetting rule end to end: a job that trains on the new classes alone (no replay, no distillation)
forgets the old ones, and the gate refuses it saying by how much and with what p-value."""

from __future__ import annotations

import re

import pytest

from edgerev_daemon.learning.evidence import p_text
from edgerev_daemon.service.daemon import Daemon
from tests.daemon.conftest import Clock
from tests.daemon.service.test_service import SMALL, drop, make_config


@pytest.mark.slow
def test_a_candidate_that_forgets_the_old_classes_is_refused(tmp_path):
    training = {**SMALL["training"], "continual": {"replay": 0, "distill": 0.0}}
    # the gate's defaults
    config, _ = make_config(tmp_path, training=training, promotion={"keep_last": 5, "exporter": "legacy"})
    with Daemon(config, clock=Clock()) as d:
        drop(config, 160, range(2))
        assert d.cycle().job["promoted"]
        drop(config, 160, range(2, 4), start=5000)
        job = d.cycle().job
        v2 = d.store.get_version(job["version"])
        test = v2.metrics["evaluation"]["test"]["old_classes"]
        assert not job["promoted"] and d.registry.current() == "v0001"
        m = re.fullmatch(r"worse on the old classes by (\d+\.\d) points \((\d+) of (\d+) lost, (\d+) gained\): "
                         r"too many losses to be chance, more than the allowed 2\.0 points "
                         r"\(p = (\S+), promotion\.alpha 0\.05\)", v2.reason)
        assert m, v2.reason
        lost, n, gained = int(m[2]), int(m[3]), int(m[4])
        assert (lost, n, gained) == (test["lost"], test["n"], test["gained"]) and lost > n / 2
        assert float(m[1]) == round(100 * (lost - gained) / n, 1)
        assert m[5] == p_text(test["p_worse"])
