"""Secure aggregation (SecAgg+) as a fleet setting: the fleet's ServerApp runs the protocol's server side
(:mod:`edgerev.fleet.secagg`) against Flower's own device-side ``secaggplus_mod`` in the fleet's ClientApp,
every message serialized as on the wire (:class:`edgerev.fleet.grid.InProcessGrid`).

Three stand-in devices with different updates and different counts per class, so that a wrong weighting
or a mask left in the sum shows; the reference is the same fleet averaged in clear.
"""

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS, Key  # noqa: E402

from edgerev.config import ConfigError  # noqa: E402
from edgerev.fleet.grid import InProcessGrid  # noqa: E402
from edgerev.fleet.secagg import QUANTIZATION_RANGE  # noqa: E402
from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from edgerev.fleet.strategy import ARRAYS  # noqa: E402
from tests.fleet.devices import FakeDevice, run_fleet  # noqa: E402

STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
CLASSES = ("a", "b", "c")
TOLERANCE = 1e-4  # 2^22 quantization levels over +-8: 3.8e-6 a term, a few of them per device


def _devices(step4: float = -2.0, without4: bool = False):
    """Node id -> device; ``without4``: device 4 has no sample (the average of devices 2 and 3 alone, with
    the same fleet classes)."""
    devices = {2: FakeDevice(["a", "b"], 1.0, 10), 3: FakeDevice(["b", "c"], 3.0, 30), 4: FakeDevice(["c"], step4, 5)}
    if without4:
        devices[4].counts = {}
    return devices


def _fleet(secagg: bool, devices, deliver=lambda node, msg: True, **settings):
    """The fleet's weights after one round, and the Grid it ran on."""
    s = FleetSettings(rounds=1, sharing="head+last", arch="revnext", image_size=16, min_devices=2,
                      model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}, secagg=secagg, **settings)
    seen = {}
    grid = run_fleet(s, devices=devices, deliver=deliver,
                     on_round=lambda r, arrays, classes: seen.update(arrays=arrays, classes=classes))
    assert seen["classes"] == CLASSES
    return {k: v.numpy() for k, v in seen["arrays"].items()}, grid


def _apart(a, b) -> float:
    return max(float(np.abs(a[k].astype(np.float64) - b[k]).max()) for k in a)


def _drop_at(stage: str, dropped: set[int]):
    """A Grid ``deliver`` that loses the replies of ``dropped`` to the protocol's message of ``stage``."""
    count: dict[int, int] = {}

    def deliver(node, msg):
        if node not in dropped or RECORD_KEY_CONFIGS not in msg.content.config_records:
            return True
        count[node] = count.get(node, 0) + 1
        return STAGES[count[node] - 1] != stage

    return deliver


def test_the_secure_average_is_the_clear_one(identity):
    plain, _ = _fleet(False, _devices())
    secure, grid = _fleet(True, devices := _devices())
    start = initial_arrays(FleetSettings(arch="revnext", image_size=16, sharing="head+last",
                                         model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}), CLASSES)
    assert _apart(plain, {k: v.numpy() for k, v in start.items()}) > 0.5  # the round moved the weights
    assert _apart(secure, plain) < TOLERANCE
    assert all(not d.refusals for d in devices.values())
    # row "a" is device 2's alone (+1), "c" is 3's and 4's by their counts 30 and 5: (30 x 3 - 5 x 2) / 35
    delta = secure["head.weight"] - start["head.weight"].numpy()
    rows = [1.0, (10 * 1 + 30 * 3) / 40, (30 * 3 - 5 * 2) / 35]
    np.testing.assert_allclose(delta, np.broadcast_to(np.array(rows)[:, None], delta.shape), atol=TOLERANCE)


class _Recording(InProcessGrid):
    """An InProcessGrid that keeps every reply the server receives."""

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        self.received = [*getattr(self, "received", []), *replies]
        return replies


def test_the_server_receives_no_update_in_clear(identity, monkeypatch):
    monkeypatch.setattr("tests.fleet.devices.InProcessGrid", _Recording)
    _, grid = _fleet(True, _devices())
    trains = [m for m in grid.received if m.metadata.message_type == "train"]
    assert trains and not any(ARRAYS in m.content.array_records for m in trains)
    vectors = [m.content.config_records[RECORD_KEY_CONFIGS][Key.MASKED_PARAMETERS] for m in trains
               if Key.MASKED_PARAMETERS in m.content.config_records.get(RECORD_KEY_CONFIGS, {})]
    assert len(vectors) == 3
    from flwr.common import bytes_to_ndarray

    for vector in vectors:
        values = np.concatenate([bytes_to_ndarray(b).ravel() for b in vector[1:]])
        # unmasked, each quantized term lies in [0, 2^22]; masked, the terms are spread over [0, 2^32)
        assert (values > 4 * QUANTIZATION_RANGE).mean() > 0.9


@pytest.mark.parametrize("stage", STAGES)
def test_a_device_lost_at_any_step_leaves_the_others_average(identity, stage):
    secure, _ = _fleet(True, _devices(), deliver=_drop_at(stage, {4}))
    if stage == "unmask":  # its masked vector had arrived: the others' shares remove its masks
        expected, _ = _fleet(False, _devices())
    else:
        expected, _ = _fleet(False, _devices(without4=True))
    assert _apart(secure, expected) < TOLERANCE


def test_a_sum_of_one_update_is_not_made(identity):
    """Two of three devices lost before their vectors: the sum would be the third's update; the round keeps
    the fleet's weights."""
    secure, _ = _fleet(True, _devices(), deliver=_drop_at("collect_masked_vectors", {3, 4}))
    start = initial_arrays(FleetSettings(arch="revnext", image_size=16, sharing="head+last",
                                         model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}), CLASSES)
    assert _apart(secure, {k: v.numpy() for k, v in start.items()}) == 0.0


def test_an_update_beyond_the_range_is_left_out_with_its_reason(identity):
    devices = _devices(step4=-5.0)
    devices[4].counts = {"c": 100}  # the largest count: its weights are 1, its terms its update, -5
    secure, _ = _fleet(True, devices, secagg_range=4.0)
    assert len(devices[4].refusals) == 1 and "beyond the secure aggregation's range +-4" in devices[4].refusals[0]
    expected, _ = _fleet(False, _devices(without4=True))
    assert _apart(secure, expected) < TOLERANCE


class _Tampering(InProcessGrid):
    """Device 4's masked vector arrives with its last tensor cut short."""

    def pull_messages(self, message_ids):
        replies = list(super().pull_messages(message_ids))
        from flwr.common import bytes_to_ndarray, ndarray_to_bytes

        for m in replies:
            cfg = m.content.config_records.get(RECORD_KEY_CONFIGS) if m.has_content() else None
            if m.metadata.src_node_id == 4 and cfg is not None and Key.MASKED_PARAMETERS in cfg:
                vector = list(cfg[Key.MASKED_PARAMETERS])
                vector[-1] = ndarray_to_bytes(bytes_to_ndarray(vector[-1]).ravel()[:-1])
                cfg[Key.MASKED_PARAMETERS] = vector
        return replies


def test_a_masked_vector_of_another_layout_counts_as_a_lost_device(identity, monkeypatch):
    monkeypatch.setattr("tests.fleet.devices.InProcessGrid", _Tampering)
    secure, _ = _fleet(True, _devices())
    expected, _ = _fleet(False, _devices(without4=True))
    assert _apart(secure, expected) < TOLERANCE


@pytest.mark.parametrize("bad", [{"secagg_shares": 4}, {"secagg_shares": 1}, {"secagg_threshold": 0.0},
                                 {"secagg_range": 0.0}, {"secagg": True, "min_devices": 1}])
def test_settings_that_cannot_run_are_refused(bad):
    with pytest.raises(ConfigError, match=next(k for k in bad if k != "secagg")):
        FleetSettings(**bad)
