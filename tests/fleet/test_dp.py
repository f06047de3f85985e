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

from edgerev.fleet.server import initial_arrays  # noqa: E402
from edgerev.fleet.settings import FleetSettings  # noqa: E402
from tests.fleet.devices import run_fleet  # noqa: E402

FLEET = ("class0", "class1", "class2")


def _update(clip: float, noise: float) -> np.ndarray:
    """The fleet's first-round update (aggregate minus the initial weights), flattened."""
    settings = FleetSettings(rounds=1, sharing="head+last", arch="revnext", image_size=16, min_devices=2,
                             model_args={"width": 8, "blocks": [1, 1, 1, 1, 1]}, dp_clipping_norm=clip,
                             dp_noise_multiplier=noise)
    seen = {}
    run_fleet(settings, step=1.0, on_round=lambda r, arrays, classes: seen.update(arrays=arrays, classes=classes))
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
