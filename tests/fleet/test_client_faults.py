"""Bad messages reach a device through Flower's message API and are refused without touching its data or model.

Each message goes through the ClientApp over the in-process Grid (serialized as on the wire); the device
answers with an error, records one event in its store, and starts no job.
"""

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict  # noqa: E402

from edgerev.fleet.client import make_client_app  # noqa: E402
from edgerev.fleet.grid import InProcessGrid  # noqa: E402
from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from edgerev_daemon.service.fleet import DaemonLink  # noqa: E402
from edgerev_daemon.storage.records import EventKind  # noqa: E402

SETTINGS = FleetSettings(rounds=1, sharing="head", arch="revnext", model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]},
                         image_size=16, min_devices=1)


@pytest.fixture
def device(tmp_path):
    from edgerev_daemon.config import config_from_dict
    from edgerev_daemon.service.daemon import Daemon
    from edgerev_daemon.service.demo import write_images

    config = config_from_dict({"data_dir": str(tmp_path / "dev"), "image_size": 16, "ingest": {"settle_seconds": 0},
                               "schedule": {"min_new_samples": 100000}, "storage": {"min_free_space": 0},
                               "training": {"model": {"arch": "revnext",
                                                      "args": {"width": 8, "blocks": [1, 1, 1, 1, 1]}}}})
    write_images(config.inbox_path, 12, [0, 1], size=16)
    with Daemon(config) as daemon:
        daemon.cycle(0.0)  # ingest only: the schedule wants more samples
        yield daemon


def _send(daemon, arrays: ArrayRecord, config: dict) -> Message:
    app = make_client_app(lambda ctx: DaemonLink(daemon))
    grid = InProcessGrid({2: (app, Context(1, 2, {}, RecordDict(), {}))})
    msg = Message(RecordDict({"arrays": arrays, "config": ConfigRecord(config)}), 2, MessageType.TRAIN)
    (reply,) = grid.send_and_receive([msg])
    return reply


def _good(classes=("class0", "class1")):
    return initial_arrays(SETTINGS, classes), {**SETTINGS.to_run_config(), "classes": list(classes), "server-round": 1}


@pytest.mark.parametrize("fault, words", [
    ("shape", "has shape"), ("unknown_array", "unknown body"), ("unknown_key", "unknown keys"),
    ("nan", "not finite"), ("missing", "missing head.weight")])
def test_bad_message_is_refused_with_one_event_and_no_job(device, identity, fault, words):
    arrays, config = _good()
    a = {k: v.numpy().copy() for k, v in arrays.items()}
    if fault == "shape":
        a["head.weight"] = np.zeros((2, 7), np.float32)
    elif fault == "unknown_array":
        a["body.secret"] = np.zeros(3, np.float32)
    elif fault == "unknown_key":
        config["send-me-your-images"] = True
    elif fault == "nan":
        a["head.weight"][0, 0] = np.nan
    elif fault == "missing":
        del a["head.weight"]
    before = device.store.events(EventKind.ERROR)
    reply = _send(device, ArrayRecord({k: Array(v) for k, v in a.items()}), config)
    assert reply.has_error() and words in reply.error.reason
    events = device.store.events(EventKind.ERROR)
    assert len(events) == len(before) + 1 and words in events[-1].message["error"]
    assert device.store.last_job() is None and device.registry.current() is None


@pytest.mark.slow
def test_device_whose_cap_cannot_train_the_fleets_model_says_so(device, identity):
    from dataclasses import replace

    from edgerev.train.config import MemoryConfig

    t = device.config.training
    device.config = replace(device.config, training=replace(t, memory=MemoryConfig(budget=100_000)))
    arrays, config = _good()
    reply = _send(device, arrays, config)
    assert reply.has_error() and "cap cannot train the fleet's model" in reply.error.reason
    assert "smallest budget that fits" in reply.error.reason
    assert device.store.last_job() is None
