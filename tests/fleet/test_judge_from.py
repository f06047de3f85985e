"""``judge-from``: the fleet model goes to the devices' gates from that round on; before it, no device is asked."""

import numpy as np
import pytest

pytest.importorskip("flwr")


def test_devices_are_asked_to_judge_the_fleet_model_from_judge_from_on(identity):
    from flwr.app import ConfigRecord, MessageType

    from edgerev.fleet.aggregate import ClassRegistry
    from edgerev.fleet.grid import InProcessGrid
    from edgerev.fleet.strategy import CONFIG, FleetAvg, to_record

    fleet = FleetAvg(ClassRegistry(["a", "b"]), min_devices=2, judge_from=3)
    grid = InProcessGrid({2: (None, None), 3: (None, None)})
    arrays = to_record({"head.weight": np.zeros((2, 4), np.float32)})
    for early in (1, 2):
        assert list(fleet.configure_evaluate(early, arrays, ConfigRecord({}), grid)) == []
    asked = list(fleet.configure_evaluate(3, arrays, ConfigRecord({}), grid))
    assert sorted(m.metadata.dst_node_id for m in asked) == [2, 3]
    assert all(m.metadata.message_type == MessageType.EVALUATE for m in asked)
    assert all(list(m.content.config_records[CONFIG]["classes"]) == ["a", "b"] for m in asked)
