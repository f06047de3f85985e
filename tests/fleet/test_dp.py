"""Differential privacy as a fleet setting: each device's update is clipped on the device (Flower's
``fixedclipping_mod``) and the server adds Gaussian noise to the aggregate (Flower's
``DifferentialPrivacyClientSideFixedClipping``), through the fleet's own ServerApp and ClientApp.

The devices do not train: each sends back what it received plus 1.0 on every float, an update far above
the clipping norm, the same on every device (so the aggregate of the clipped updates is the clipped
update itself, whatever the per-class weighting).
"""

import numpy as np
import pytest

pytest.importorskip("flwr")

from flwr.app import Context, RecordDict  # noqa: E402
from flwr.common.constant import SUPERLINK_NODE_ID  # noqa: E402

from edgerev.fleet.client import make_client_app  # noqa: E402
from edgerev.fleet.grid import InProcessGrid  # noqa: E402
from edgerev.fleet.server import initial_arrays, make_server_app  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from edgerev_daemon.fleet import Consideration, RoundResult  # noqa: E402

CLASSES = {2: ["class0", "class1"], 3: ["class1", "class2"]}
FLEET = ("class0", "class1", "class2")


class Stepper:
    """A device whose round moves every shared float by +1.0."""

    def __init__(self, classes):
        self.counts = {c: 10 for c in classes}

    def classes(self):
        return dict(self.counts)

    def train_round(self, fm):
        counts = [self.counts.get(c, 0) for c in fm.classes]
        return RoundResult({k: v + 1.0 for k, v in fm.shared.items()}, counts, sum(counts), None, None, 0)

    def consider(self, fm):
        return Consideration(False, "", None, 0.0, 0)

    def refused(self, what, error):
        raise AssertionError(error)


def _update(clip: float, noise: float) -> np.ndarray:
    """The fleet's first-round update (aggregate minus the initial weights), flattened."""
    settings = FleetSettings(rounds=1, sharing="head+last", arch="revnext", image_size=16, min_devices=2,
                             model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}, dp_clipping_norm=clip,
                             dp_noise_multiplier=noise)
    links = {n: Stepper(c) for n, c in CLASSES.items()}
    app = make_client_app(lambda ctx: links[ctx.node_id])
    grid = InProcessGrid({n: (app, Context(1, n, {}, RecordDict(), {})) for n in links})
    seen = {}
    make_server_app(lambda r, arrays, classes: seen.update(arrays=arrays, classes=classes))(
        grid, Context(1, SUPERLINK_NODE_ID, {}, RecordDict(), settings.to_run_config()))
    assert seen["classes"] == FLEET
    start = initial_arrays(settings, FLEET)
    return np.concatenate([(seen["arrays"][k].numpy() - start[k].numpy()).ravel() for k in start.keys()])


def test_without_dp_the_update_is_the_devices(identity):
    u = _update(0.0, 0.0)
    np.testing.assert_allclose(u, 1.0, rtol=1e-5)


def test_each_update_is_clipped_on_the_device(identity):
    u = _update(0.5, 0.0)
    assert np.linalg.norm(u) == pytest.approx(0.5, rel=1e-4)
    np.testing.assert_allclose(u, u[0], rtol=1e-4)  # clipping scales the update, it keeps its direction


def test_the_server_adds_noise_scaled_to_the_norm_over_the_devices(identity):
    u = _update(0.5, 2.0)
    clipped = 0.5 / np.sqrt(u.size)  # every coordinate of the clipped update (all equal)
    noise = u - clipped
    # Flower's wrapper: standard deviation noise_multiplier x clipping_norm / devices sampled = 2 x 0.5 / 2
    assert noise.std() == pytest.approx(0.5, rel=0.05)
    assert abs(noise.mean()) < 5 * 0.5 / np.sqrt(u.size)
